"""The one place engine-specific calls enter the loop (Ray's report; nothing elsewhere)."""

from __future__ import annotations

from typing import Protocol


class Reporter(Protocol):
    def report(self, metrics: dict, checkpoint_dir: str | None) -> None:
        """Called on every rank at every evaluation, the same number of times on each."""


class NullReporter:
    def report(self, metrics: dict, checkpoint_dir: str | None) -> None:
        return None
