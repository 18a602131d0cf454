"""A live monitor's verdicts over time (monitor/live.py): one record per period (`--monitor-period-s`, an hour by
default), as NannyML reports per period: when it began and ended, the texts that came in it, whether any
verdict in it was drift (and on which signals), the verdict and the estimated accuracy at its end, and whether
that verdict was stale. The last KEEP records are in GET /v1/monitor and on the status page; with
`--monitor-history FILE` each record is also appended to that JSON-lines file as its period ends (a line per
record, a model's name in it, so the models of a fleet can share one file)."""

from __future__ import annotations

import json
import logging
from collections import deque
from typing import Any

log = logging.getLogger("torchloom.serve")

KEEP = 48  # records in memory: two days of hours


class History:
    def __init__(self, model: str, period_s: float, path: str = "", keep: int = KEEP) -> None:
        self.model, self.period_s, self.path = model, float(period_s), path
        self.records: deque[dict[str, Any]] = deque(maxlen=keep)
        self.open: dict[str, Any] | None = None

    def _period(self, now: float) -> dict[str, Any]:
        """The period `now` falls in: a period that ended before it is closed first (one record for a stretch
        nothing happened in)."""
        if self.open is not None and now >= self.open["end"]:
            self._close()
        if self.open is None:
            start = now - now % self.period_s  # periods on the clock's boundaries (an hour: each full hour)
            self.open = {"model": self.model, "start": start, "end": start + self.period_s, "texts": 0,
                         "drift_seen": False, "drifted": set()}
        return self.open

    def observed(self, texts: int, now: float) -> None:
        """`texts` came at `now`."""
        self._period(now)["texts"] += texts

    def note(self, report: dict[str, Any], now: float) -> None:
        """A verdict of the monitor's, worked out at `now`."""
        period = self._period(now)
        if report.get("state") in ("drift", "no_drift"):
            period["drift_seen"] |= bool(report.get("drift"))
            period["drifted"] |= set(report.get("drifted") or [])
        period.update(state=report.get("state"), stale=bool(report.get("stale")),
                      estimated_accuracy=report.get("estimated_accuracy"))

    def _close(self) -> None:
        period, self.open = self.open, None
        record = {"model": period["model"], "start": period["start"], "end": period["end"],
                  "texts": period.get("texts", 0), "state": period.get("state"), "stale": period.get("stale", False),
                  "drift_seen": period["drift_seen"], "drifted": sorted(period["drifted"]),
                  "estimated_accuracy": (period.get("estimated_accuracy") or {}).get("value")}
        self.records.append(record)
        if self.path:
            try:
                with open(self.path, "a", encoding="utf-8") as f:
                    f.write(json.dumps(record) + "\n")
            except OSError as e:  # the file is the user's: a full disk or a moved mount costs a warning, never a text
                log.warning("monitor %s: the history record could not be appended to %s (%s)", self.model, self.path,
                            e.strerror or e)

    def view(self) -> list[dict[str, Any]]:
        """The closed periods, oldest first, and the open one as it stands (`open`: true)."""
        now = [] if self.open is None else [{
            "model": self.model, "start": self.open["start"], "end": self.open["end"],
            "texts": self.open.get("texts", 0), "state": self.open.get("state"), "stale": self.open.get("stale"),
            "drift_seen": self.open["drift_seen"], "drifted": sorted(self.open["drifted"]),
            "estimated_accuracy": (self.open.get("estimated_accuracy") or {}).get("value"), "open": True}]
        return [*self.records, *now]
