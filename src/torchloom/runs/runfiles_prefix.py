"""Whose the run's place is, as RunFiles sees it: what the run holds where it lives, the own-prefix rule, the ledger's
view of the run, --overwrite (`RunFiles.place`, runs/runfiles.py: a part of the run's owner that holds it, not a
mixin of it), and whether a local directory can be written."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from torchloom.errors import UserError
from torchloom.runs import ledger
from torchloom.runs.ledger import replace_local
from torchloom.runs.recording import recording
from torchloom.runs.rundir import CONFIG_FILE, RUN_RECORD
from torchloom.runs.runrecord import is_own, is_own_file, parse_record
from torchloom.runs.store_tree import StoreTree
from torchloom.store import storage


class Place:
    """Whose one run's place is (`files.place`): built by its RunFiles, whose verbs (listing, read) look."""

    def __init__(self, files) -> None:
        self.files, self.rd, self._remote = files, files.rd, files.rd.remote

    def _objects(self) -> tuple[dict[str, int], Callable[[str], bytes | None]]:
        """The run's objects but its lease (runs/lease.py: a driver holds it before it looks whether the prefix is empty
        or torchloom's, and --overwrite leaves it to its owner) and its ledger, and a reader of them (is_own's)."""
        assert self._remote is not None
        remote = self._remote
        listing = {rel: size for rel, size in storage.list_files(remote).items() if ledger.is_content(rel)}

        def read(rel: str) -> bytes | None:
            try:
                return storage.read_bytes(storage.join(remote, rel)) if rel in listing else None
            except FileNotFoundError:
                return None

        return listing, read

    def holds(self, path: str | Path) -> bool:
        """The run holds a file, or anything under a directory, at `path` where it lives (the store's objects for a
        run on one, never this copy's)."""
        if self._remote is not None:
            return bool(self.files.listing(path)) or self.files.read(path) is not None
        path = Path(path)
        return path.is_file() or (path.is_dir() and any(path.iterdir()))

    def holds_anything(self) -> bool:
        """The store holds objects of this run (its lease aside); a local run: its directory is not empty."""
        if self._remote is None:
            return not ledger.is_empty(ledger.LocalTree(self.rd.root))
        return bool(self._objects()[0])

    def check_own(self, key: str = "output.dir") -> None:
        """Before a stage writes into a run: it holds no config.toml of someone else's (a Hugo site's), and on a
        store the prefix is empty or torchloom's (its record, or a marker of torchloom's content); one line
        otherwise. Read from the store for a run on one, never from this host's copy."""
        if self._remote is None:
            config = self.files.read(self.rd.config)
            if config is not None and not is_own_file(CONFIG_FILE, config):
                raise UserError(f"{key} {self.rd.where}: holds a config.toml that torchloom did not write; it is left"
                                " alone; pass another --output.dir")
            return
        listing, read = self._objects()
        if not listing:
            return
        config = read(CONFIG_FILE)
        if config is not None and not is_own_file(CONFIG_FILE, config):
            raise UserError(f"{key} {self.rd.where}: holds a config.toml that torchloom did not write; it is left"
                            " alone; pass another --output.dir")
        if parse_record(read(RUN_RECORD)) is None and not is_own(read):
            some = ", ".join(sorted(listing)[:3])
            raise UserError(f"{key} {self.rd.where}: holds {len(listing)} objects that torchloom did not write"
                            f" ({some}); they are left alone; pass another --output.dir")

    def tree(self) -> ledger.Tree:
        """The run as its ledger sees it: the directory, or the store's objects for a run on one."""
        return StoreTree(self._remote) if self._remote is not None else ledger.LocalTree(self.rd.root)

    def recording(self):
        """Around a command that writes into the run: what it wrote is listed in the run's ledger (runs/ledger.py)."""
        return recording(self.tree())

    def remove_recorded(self, path: str | Path, key: str = "output.dir") -> list[str]:
        """Delete a directory of the run where it lives by the run's ledger (ledger.replace: only what torchloom
        wrote, as it left it, all of it or nothing in one line); a run on a store: this host's copy of it too (in
        torchloom's private cache). Returns what was deleted."""
        path = Path(path)
        rel = path.resolve().relative_to(self.rd.root).as_posix()
        removed = ledger.replace(self.tree(), key, under=rel)
        if self._remote is not None and path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        return removed

    def replace(self, key: str = "output.dir", inputs: list[str] = (), under: str | Path | None = None) -> None:
        """--overwrite: delete the files the run's ledger lists as torchloom left them (ledger.deletable), all or
        nothing; a bucket's root, or a directory or prefix holding anything torchloom did not write or any input of
        the command, is refused in one line before anything is deleted. under: only this directory of the run (its
        data). A run on a store: the store's objects (this host's copy is then emptied by sync_copy)."""
        rel = Path(under).relative_to(self.rd.root).as_posix() if under is not None else ""
        if self._remote is None:
            if not rel:
                replace_local(self.rd.root, key, inputs)
            else:
                ledger.replace(self.tree(), key, inputs, under=rel)
            return
        fs, path = storage.resolve(self._remote)
        if not rel and "/" not in path.strip("/") and self._objects()[0]:
            raise UserError(f"{key} {self.rd.where}: not replaced: it is a bucket's root, which --overwrite never"
                            f" empties; give the run a prefix of its own, e.g. {self.rd.where}/runs/NAME")
        ledger.replace(self.tree(), key, inputs, under=rel)


def check_local_dir(path: Path, key: str = "output.dir") -> None:
    """A local directory that cannot be made or written (a file on its path, a directory this user may not
    write) is one line, and nothing is created to find out."""
    fix = f"pass another --{key}"
    if path.exists() and not path.is_dir():
        raise UserError(f"{key} {path}: is a file, not a directory; {fix}")
    nearest = path
    while not nearest.exists() and nearest.parent != nearest:  # a path under a file does not exist either
        nearest = nearest.parent
    if not nearest.is_dir():
        raise UserError(f"{key} {path}: cannot be created, {nearest} is a file, not a directory; {fix}")
    if not os.access(nearest, os.W_OK | os.X_OK):
        made = "written" if nearest == path else f"created, {nearest} is not writable"
        raise UserError(f"{key} {path}: cannot be {made} for this user; {fix} or make it writable")
