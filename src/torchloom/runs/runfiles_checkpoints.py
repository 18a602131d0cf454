"""The store's checkpoints, as RunFiles moves them: which complete ones the store holds, bringing them into this
host's copy, a rank's own files of a checkpoint published, and rank 0's uploads in the background
(`RunFiles.checkpoints`, runs/runfiles.py: a part of the run's owner that holds it, not a mixin of it).

CheckpointUploader: checkpoints to the store in the background, while training goes on (a run on a store). Rank 0
writes each checkpoint to local disk as always (train/checkpoint.py), then hands the directory to
one upload thread and returns to training. Backpressure: a new checkpoint waits until the previous
upload is done, so at most one is in flight and the local copies it reads are never pruned under it;
`blocked_s` is how long the loop waited. meta.json is uploaded last, so a checkpoint on the store counts
only once it is whole; a crash in the middle leaves the previous one the newest complete. After each
upload the store keeps what the local directory keeps (keep_last and the best). The job does not end
before the last upload is done (`drain`).
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

from torchloom.jsonio import write_atomic
from torchloom.runs.rundir import STEP_DIR
from torchloom.store import storage


class StoredCheckpoints:
    """The checkpoints of one run where it lives (`files.checkpoints`): built by its RunFiles, whose verbs (listing,
    sync_copy, uri, push_as) move them."""

    def __init__(self, files) -> None:
        self.files, self.rd, self._remote = files, files.rd, files.rd.remote

    def uploader(self, log=None) -> CheckpointUploader | None:
        """Rank 0's uploader of each checkpoint in the background; None for a local run (nothing to move)."""
        return CheckpointUploader(self.files, log) if self._remote is not None else None

    def publish_part(self, written: Path, final: Path, mine: Callable[[Path], bool]) -> None:
        """A rank other than 0 wrote its part of a checkpoint (`mine`: its RNG state, its shards) into `written`:
        on a store, where hosts share no directory, those files go straight to the store as `final`'s (rank 0
        uploads the rest); a local run's ranks share the directory, so nothing moves."""
        if self._remote is None:
            return
        for p in sorted(written.rglob("*")):
            if p.is_file() and mine(p.relative_to(written)):
                self.files.push_as(p, final / p.relative_to(written))

    def drop_part(self, written: Path) -> None:
        """After every rank's part is on the store: this (non-zero) rank's local copy of it goes (rank 0's copy is
        the checkpoint); a local run's is the shared checkpoint itself, kept."""
        if self._remote is not None:
            shutil.rmtree(written, ignore_errors=True)

    def steps(self) -> list[int]:
        """The steps of the complete checkpoints (those with meta.json) the run holds where it lives, newest first:
        the store's for a run on one, the directory's for a local run."""
        if self._remote is None:
            root = self.rd.checkpoints
            return sorted((int(m.group(1)) for p in (root.iterdir() if root.is_dir() else ())
                           if (m := STEP_DIR.match(p.name)) and (p / "meta.json").is_file()), reverse=True)
        steps = set()
        for rel in self.files.listing(self.rd.checkpoints):
            name, _, rest = rel.partition("/")
            if rest == "meta.json" and (m := STEP_DIR.match(name)):
                steps.add(int(m.group(1)))
        return sorted(steps, reverse=True)

    def pull(self, intact: Callable[[Path], bool] | None = None) -> list[int]:
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
        self.files.sync_copy()
        steps = self.steps()
        if self.rd.checkpoints.is_dir():
            for local in self.rd.checkpoints.iterdir():
                m = STEP_DIR.match(local.name)
                if m and int(m.group(1)) not in steps and (local / "meta.json").is_file():
                    shutil.rmtree(local, ignore_errors=True)
        found = False
        for step in steps:
            local = self.rd.checkpoint(step)
            meta = storage.read_bytes(self.files.uri(local / "meta.json"))
            if found:
                if not ((local / "meta.json").is_file() and (local / "meta.json").read_bytes() == meta):
                    shutil.rmtree(local, ignore_errors=True)
                    local.mkdir(parents=True)
                    write_atomic(local / "meta.json", meta)
                continue
            if not _holds(local, meta):
                tmp = local.with_name(f".{local.name}.{os.getpid()}.pull")
                shutil.rmtree(tmp, ignore_errors=True)
                storage.pull_tree(self.files.uri(local), tmp, only_if_changed=False)
                shutil.rmtree(local, ignore_errors=True)
                os.replace(tmp, local)
            found = intact is not None and intact(local)
        return steps


def _holds(local: Path, meta: bytes) -> bool:
    """Does this host's checkpoint directory hold the store's (the same meta.json, every file it records there at
    its size)? A copy of meta.json alone (StoredCheckpoints.pull) does not."""
    if not (local / "meta.json").is_file() or (local / "meta.json").read_bytes() != meta:
        return False
    try:
        files = json.loads(meta).get("files") or {}
    except ValueError:
        return True  # the resume judges a meta.json it cannot read
    return all((local / name).is_file() and (local / name).stat().st_size == want.get("size")
               for name, want in files.items() if isinstance(want, dict))


class CheckpointUploader:
    def __init__(self, files, log=None):  # files: the run's RunFiles (push, listing, delete)
        self.files, self.rd = files, files.rd
        self.log = log or (lambda record: None)  # a metrics.jsonl line per finished upload
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._done: dict | None = None
        self.uploads: list[dict] = []

    def wait(self) -> float:
        """Block until the upload in flight is done (raising its error); returns the seconds waited."""
        started = time.perf_counter()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        blocked = time.perf_counter() - started
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        if self._done is not None:
            record, self._done = self._done, None
            self.uploads.append(record)
            self.log(record)
        return blocked

    def submit(self, checkpoint_dir: str | Path, blocked_s: float) -> None:
        """Upload this (complete, local) checkpoint in the background; `blocked_s` is what the loop waited
        for the previous one before writing it."""
        assert self._thread is None, "wait() first: one upload in flight at the most"
        checkpoint_dir = Path(checkpoint_dir)
        step = int(STEP_DIR.match(checkpoint_dir.name).group(1))
        self._thread = threading.Thread(target=self._upload, args=(checkpoint_dir, step, blocked_s),
                                        name=f"torchloom-upload-step-{step}", daemon=True)
        self._thread.start()

    def _upload(self, checkpoint_dir: Path, step: int, blocked_s: float) -> None:
        started = time.perf_counter()
        try:
            size = self.files.push(checkpoint_dir)  # meta.json last
            self._verify(checkpoint_dir)
            self._prune()
            self._done = {"kind": "checkpoint", "step": step, "bytes": size, "blocked_s": round(blocked_s, 3),
                          "upload_s": round(time.perf_counter() - started, 3)}
        except BaseException as e:  # raised in the training thread at the next wait()
            self._error = e

    def _verify(self, checkpoint_dir: Path) -> None:
        """Every file of the checkpoint is on the store at its local size (the hashes are in meta.json, which
        resume checks); a store that lost or cut an object fails the upload here, not at resume."""
        local = {p.relative_to(checkpoint_dir).as_posix(): p.stat().st_size
                 for p in checkpoint_dir.rglob("*") if p.is_file()}
        remote = self.files.listing(checkpoint_dir)
        wrong = sorted(name for name, size in local.items() if remote.get(name) != size)
        if wrong:
            raise OSError(f"{self.rd.home(checkpoint_dir)}: after the upload {wrong[0]} is missing or of another"
                          " size on the store")

    def _prune(self) -> None:
        """The store keeps the checkpoints the local directory kept (keep_last and the best)."""
        local = {p.name for p in self.rd.checkpoints.iterdir() if STEP_DIR.match(p.name)}
        remote = {rel.split("/", 1)[0] for rel in self.files.listing(self.rd.checkpoints)}
        for name in sorted(remote - local):
            if STEP_DIR.match(name):
                self.files.delete(self.rd.checkpoints / name)

    def drain(self) -> dict:
        """Wait for the last upload; the totals for the summary."""
        self.wait()
        return {"checkpoints_uploaded": len(self.uploads),
                "blocked_s": round(sum(u["blocked_s"] for u in self.uploads), 3),
                "upload_s": round(sum(u["upload_s"] for u in self.uploads), 3)}
