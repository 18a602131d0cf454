"""The store's checkpoints, as RunFiles moves them: which complete ones the store holds, and bringing them into
this host's copy (a part of RunFiles, runfiles.py, by job)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from torchloom import storage
from torchloom.jsonio import write_atomic
from torchloom.rundir import STEP_DIR


class CheckpointFiles:
    """RunFiles' checkpoint verbs (it sets rd, _remote and the verbs used here: listing, sync_copy, uri)."""

    def stored_steps(self) -> list[int]:
        """The steps of the complete checkpoints (those with meta.json) the store holds, newest first ([] for a
        local run)."""
        if self._remote is None:
            return []
        steps = set()
        for rel in self.listing(self.rd.checkpoints):
            name, _, rest = rel.partition("/")
            if rest == "meta.json" and (m := STEP_DIR.match(name)):
                steps.add(int(m.group(1)))
        return sorted(steps, reverse=True)

    def pull_checkpoints(self, intact: Callable[[Path], bool] | None = None) -> list[int]:
        """Bring the store's complete checkpoints into the copy, newest first, each downloaded beside and renamed
        into place; returns their steps, newest first. A local copy counts only while its meta.json (which holds
        every file's sha256) equals the store's and its files are there at their sizes; a complete local
        checkpoint the store does not hold is removed, so no host resumes from a step the others cannot load.

        intact: a resume's check of a local checkpoint (its files hash as its meta.json says; train/checkpoint.py).
        With it the pull stops at the first checkpoint that passes: it, and any damaged newer one (left for the
        resume to warn of and skip), are downloaded whole; of the older ones only meta.json, so the copy still lists
        every checkpoint the store keeps without their bytes. Without it (export, which may take the best) all are
        whole."""
        if self._remote is None:
            return []
        self.sync_copy()
        steps = self.stored_steps()
        if self.rd.checkpoints.is_dir():
            for local in self.rd.checkpoints.iterdir():
                m = STEP_DIR.match(local.name)
                if m and int(m.group(1)) not in steps and (local / "meta.json").is_file():
                    shutil.rmtree(local, ignore_errors=True)
        found = False
        for step in steps:
            local = self.rd.checkpoint(step)
            meta = storage.read_bytes(self.uri(local / "meta.json"))
            if found:
                if not ((local / "meta.json").is_file() and (local / "meta.json").read_bytes() == meta):
                    shutil.rmtree(local, ignore_errors=True)
                    local.mkdir(parents=True)
                    write_atomic(local / "meta.json", meta)
                continue
            if not _holds(local, meta):
                tmp = local.with_name(f".{local.name}.{os.getpid()}.pull")
                shutil.rmtree(tmp, ignore_errors=True)
                storage.pull_tree(self.uri(local), tmp, only_if_changed=False)
                shutil.rmtree(local, ignore_errors=True)
                os.replace(tmp, local)
            found = intact is not None and intact(local)
        return steps


def _holds(local: Path, meta: bytes) -> bool:
    """Does this host's checkpoint directory hold the store's (the same meta.json, every file it records there at
    its size)? A copy of meta.json alone (pull_checkpoints) does not."""
    if not (local / "meta.json").is_file() or (local / "meta.json").read_bytes() != meta:
        return False
    try:
        files = json.loads(meta).get("files") or {}
    except ValueError:
        return True  # the resume judges a meta.json it cannot read
    return all((local / name).is_file() and (local / name).stat().st_size == want.get("size")
               for name, want in files.items() if isinstance(want, dict))
