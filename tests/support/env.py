"""Environment variables a test server sets for this process, put back as they were."""

from __future__ import annotations

import os


def saved(names) -> dict[str, str | None]:
    """The current values of `names` (None: unset), for restore()."""
    return {k: os.environ.get(k) for k in names}


def restore(values: dict[str, str | None]) -> None:
    """Each variable back to its saved value; one that was unset is removed."""
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
