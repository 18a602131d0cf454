"""Files written whole or not at all, and JSON in and out of them. Standard library only, below the run
directory's contract (runs/rundir.py) and the store client (store/storage.py)."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

# What every file written here passes through first (str or bytes in, the same kind out): redaction.py puts its
# mask of the passwords this process has seen here, so no record, config or report holds one.
MASKERS: list[Callable[[Any], Any]] = []


def write_atomic(path: str | Path, data: str | bytes) -> Path:
    """Write to a temporary name beside `path`, then rename: readers see the old file or the new, never half."""
    path = Path(path)
    for mask in MASKERS:
        data = mask(data)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        if isinstance(data, bytes):
            tmp.write_bytes(data)
        else:
            tmp.write_text(data, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def append_text(path: str | Path, text: str) -> None:
    """Append to a file of the run's own: one that is a symbolic link, or a hard link shared with another name (a
    snapshot made with `cp -al`), is first made a file of its own (its content copied), so the append never
    writes into what the link points at."""
    path = Path(path)
    try:
        st = path.lstat()
        if os.path.islink(path) or st.st_nlink > 1:
            write_atomic(path, path.read_bytes() if path.exists() else b"")
    except FileNotFoundError:
        pass
    with open(path, "a", encoding="utf-8") as f:
        f.write(text)


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def write_json(path: str | Path, data: Any, indent: int | None = 2) -> Path:
    return write_atomic(path, json.dumps(data, indent=indent, default=str))


def read_json(path: str | Path) -> Any:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The JSON objects of a JSON-lines file; [] when it is missing. Unparsable lines (a line still being
    written by a live run) are skipped."""
    p = Path(path)
    if not p.is_file():
        return []
    rows = []
    for line in p.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows
