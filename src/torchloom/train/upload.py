"""Checkpoints to the store in the background, while training goes on (a run whose output.dir is a URI).

Rank 0 writes each checkpoint to local disk as always (train/checkpoint.py), then hands the directory to
one upload thread and returns to training. Backpressure: a new checkpoint waits until the previous
upload is done, so at most one is in flight and the local copies it reads are never pruned under it;
`blocked_s` is how long the loop waited. meta.json is uploaded last, so a checkpoint on the store counts
only once it is whole; a crash in the middle leaves the previous one the newest complete. After each
upload the store keeps what the local directory keeps (keep_last and the best). The job does not end
before the last upload is done (`drain`).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from torchloom.rundir import STEP_DIR
from torchloom.runfiles import RunFiles


class CheckpointUploader:
    def __init__(self, files: RunFiles, log=None):
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
