"""Runs made before ledgers (runs/ledger.py): the files their content-verified markers vouch for, never a bare name:
a run record, a config.toml and a manifest that torchloom's readers accept, the shards a manifest lists, a
checkpoint's files that its meta.json lists at their sizes, a study marker, torchloom's temporary names."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from torchloom.runs.local_tree import Stat
from torchloom.runs.rundir import CONFIG_FILE, MANIFEST_FILE, RUN_RECORD, STEP_DIR, STUDY_FILE
from torchloom.runs.runrecord import TEMP_NAME, is_own_file, parse_record


def verified(inventory: dict[str, Stat], read) -> dict[str, Stat]:
    """A run made before ledgers: the files its content-verified markers vouch for (module docstring)."""
    ours: set[str] = set()
    for rel in inventory:
        name = rel.rsplit("/", 1)[-1]
        # a temporary or lock file of torchloom's own pattern (a study's .running.lock), the record, a config or
        # study marker that torchloom's readers accept
        if (TEMP_NAME.match(name) or (rel == RUN_RECORD and parse_record(read(rel)) is not None)
                or (rel in (CONFIG_FILE, STUDY_FILE) and is_own_file(rel, read(rel) or b""))):
            ours.add(rel)
        elif name == MANIFEST_FILE and rel in (MANIFEST_FILE, f"data/{MANIFEST_FILE}"):
            ours |= _manifest_files(rel, read(rel) or b"", inventory)
        elif name == "meta.json" and _is_checkpoint(rel):
            ours |= _checkpoint_files(rel, read(rel) or b"", inventory)
    return {rel: inventory[rel] for rel in ours}


def _manifest_files(rel: str, raw: bytes, inventory: dict[str, Stat]) -> set[str]:
    if not is_own_file(rel, raw):
        return set()
    base = rel.rsplit("/", 1)[0] + "/" if "/" in rel else ""
    shards = {f"{base}{s.get('path')}" for split in json.loads(raw)["splits"].values()
              for s in split["shards"] if isinstance(s, dict) and isinstance(s.get("path"), str)}
    return {rel} | (shards & inventory.keys())


def _is_checkpoint(rel: str) -> bool:
    parts = rel.split("/")
    return len(parts) == 3 and parts[0] == "checkpoints" and STEP_DIR.match(parts[1]) is not None


def _checkpoint_files(rel: str, raw: bytes, inventory: dict[str, Stat]) -> set[str]:
    try:
        files = json.loads(raw).get("files")
    except (ValueError, AttributeError):
        return set()
    if not isinstance(files, dict) or not files:
        return set()
    base = rel.rsplit("/", 1)[0]
    listed = {f"{base}/{name}": want.get("size") for name, want in files.items() if isinstance(want, dict)}
    if any(inventory.get(path, (None,))[0] != size for path, size in listed.items()):
        return set()  # not as its meta.json says: not vouched for
    return {rel, *listed}


def remove_written(path: Path) -> None:
    """A checkpoint this training wrote, by its record: the files its meta.json lists (at their sizes) and the
    meta.json, then the directories they leave empty; anything else found there stays (and so does its folder)."""
    try:
        listed = json.loads((path / "meta.json").read_text()).get("files") or {}
    except (OSError, ValueError, AttributeError):
        return
    for name, want in listed.items():
        f = path / name
        if isinstance(want, dict) and f.is_file() and not f.is_symlink() and f.stat().st_size == want.get("size"):
            f.unlink()
    (path / "meta.json").unlink(missing_ok=True)
    for d in sorted((p for p in path.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        with contextlib.suppress(OSError):
            d.rmdir()
    with contextlib.suppress(OSError):
        path.rmdir()
