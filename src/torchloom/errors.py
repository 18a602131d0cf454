"""The one exception type a user sees as a one-line message (exit code 2, no traceback)."""

from __future__ import annotations


class UserError(Exception):
    """Bad input from the user: names the input, the problem and the fix."""

    exit_code = 2


def missing_extra(module: str, extra: str) -> UserError:
    """The error for an optional engine that is not installed."""
    return UserError(f"{module} is not installed: pip install 'torchloom[{extra}]'")
