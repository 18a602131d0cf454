"""The trainer's state in and out: what a checkpoint keeps of a training, and where a training starts.

The state contract is one dict, `trainer_state()`: the schedule, the scaler, the loader's position and the counters
(TrainState); a checkpoint holds it beside the weights and the optimizer (train/checkpoint.py), and `restore()`
takes it back. `start()` runs at the start of `fit()`, once the Trainer is whole: a fresh start (the earlier
training's checkpoints and metrics cleared), or the checkpoint `train.resume` names, on the same workers or on others
(the same global batches go on). Trainer (train/loop.py) is built with this part.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path

from torchloom.config import elastic_micro_batch
from torchloom.train import checkpoint
from torchloom.train.state import TrainState


def check_fresh(files, resume: str, overwrite: bool, inputs: list[str] = (),
                flags: tuple[str, str] = ("--train.resume latest", "--output.overwrite true")) -> None:
    """Before a training starts on any entry (the CLI's driver, the torchrun entry a pod runs): a fresh one (no
    train.resume) removes the earlier training's checkpoints, so only with --overwrite, and only when they are all
    torchloom's by the run's ledger; else one line before anything is written (`flags`: how the caller's user
    says resume and overwrite)."""
    from torchloom.errors import UserError
    from torchloom.runs.ledger import deletable

    if resume:
        return
    steps = files.stored_steps()
    if not steps:
        if files.holds(files.rd.checkpoints):  # a killed training's unfinished ones: removed only by record
            deletable(files.tree(), "output.dir", inputs, under="checkpoints")
        return
    if not overwrite:
        shown = ", ".join(map(str, sorted(steps)[-3:]))
        more = "..." if len(steps) > 3 else ""
        raise UserError(f"output.dir {files.rd.where}: holds {len(steps)} checkpoint(s) of an earlier training (steps"
                        f" {more}{shown}), which a fresh training would delete; pass {flags[0]} to go on from the"
                        f" latest, or {flags[1]} to train afresh")
    deletable(files.tree(), "output.dir", inputs, under="checkpoints")


def starting_point(files, d, resume: str) -> Path | None:
    """The checkpoint a training starts from (train.resume: "latest", a path, or "" for a fresh start), held by this
    host's copy of the run (`files`: the run's owner; a run on a store: one download per host, the ranks beside it
    read the same copy); None: a fresh start, for which rank 0 clears the earlier training's metrics and (unless a
    resume found nothing) its checkpoints, which would otherwise be exported."""
    if resume == "latest":
        if d.local_rank == 0:
            files.pull_checkpoints(intact=lambda p: checkpoint.damage(p) is None)
        d.io_barrier()
    path = checkpoint.resolve_once(d, resume, files.rd.checkpoints)
    if path is None and d.is_main:
        if resume == "latest":
            where = files.rd.home(files.rd.checkpoints)
            print(f"torchloom: train: train.resume latest: no complete checkpoint in {where} to resume from;"
                  " training from step 0", flush=True)
        files.rd.reset_metrics(None, keep_driver=True)
        if not resume:
            checkpoint.clear_earlier(files)
    return path


class Checkpointing:
    """The Trainer's checkpoint side (it sets d, tc, files, rd, model, optimizer, scheduler, scaler, loader, par,
    state, micro_batch, uploader, clock and build_loader)."""

    resumed_world_size: int | None = None  # the checkpoint's, when it had other workers
    resumed_step: int | None = None
    checkpoint_s = 0.0  # the last checkpoint's write (0 before the first)

    def trainer_state(self) -> dict:
        """The state contract: what a checkpoint keeps of the training besides the weights and the optimizer."""
        return {"scheduler": self.scheduler.state_dict(),
                "scaler": self.scaler.state_dict() if self.scaler is not None else {},
                "loader": self.loader.state_dict(), "state": asdict(self.state)}

    def restore(self, ts: dict) -> None:
        """The training where trainer_state() left it: schedule, scaler, counters, and the loader's position on
        these workers. Elastic (other workers): the same global batches; a micro-batch that fit the old workers'
        memory is kept, with more accumulation, rather than grown."""
        self.scheduler.load_state_dict(ts["scheduler"])
        if self.scaler is not None and ts.get("scaler"):
            self.scaler.load_state_dict(ts["scaler"])
        self.state = TrainState(**ts["state"])
        self.resumed_step = self.state.step
        saved, dp = ts["loader"], self.par.dp_size
        if saved.get("world_size") not in (None, dp) and self.par.pipeline is None:
            self.resumed_world_size = int(saved["world_size"])
            micro = elastic_micro_batch(self.tc.batch_size, dp, self.micro_batch,
                                        int(saved.get("batch_size") or self.micro_batch))
            if micro != self.micro_batch:
                self.micro_batch = micro
                self.loader = self.build_loader(micro)
            if self.d.is_main:
                print(f"train: resuming step {self.state.step} on {dp} workers (the checkpoint's run had"
                      f" {saved['world_size']}): the same global batches of {self.tc.batch_size} go on, as"
                      f" {self.loader.accum} micro-batch(es) of {micro} per worker", flush=True)
        if self.tc.length_bucketing == "auto" and "length_bucketing" in saved:
            self.loader.length_bucketing = bool(saved["length_bucketing"])  # auto goes on as the run began
        self.loader.load_state_dict(saved)

    def start(self) -> str | None:
        """Where this training starts (at the start of fit): the checkpoint's path once its weights, optimizer and
        trainer_state are loaded, or None for a fresh start."""
        path = starting_point(self.files, self.d, self.tc.resume)
        if path is None:
            return None
        self.restore(checkpoint.load(self.d, path, model=self.model, optimizer=self.optimizer,
                                     sharded=self.par.sharded))
        if self.d.is_main:  # the history goes on from the checkpoint's step (the store's lines first)
            self.files.catch_up_metrics(self.state.step)
            self.rd.reset_metrics(self.state.step)
        return str(path)

    def save_checkpoint(self) -> str:
        s = self.state
        s.last_checkpoint_step = s.step
        meta = {"epoch": s.epoch, "samples_seen": s.samples_seen, "best_step": s.best_step,
                "strategy": self.par.strategy, "eval": self.last_eval_summary()}
        keep = {s.best_step} if s.best_step >= 0 else set()
        # Backpressure: the previous upload finishes before this checkpoint is written (and pruned against).
        blocked = self.uploader.wait() if self.uploader else 0.0
        started = time.perf_counter()
        with self.clock.phase("checkpoint"):
            path = checkpoint.save(
                self.d, self.rd.checkpoints, s.step, model=self.model, optimizer=self.optimizer,
                trainer_state=self.trainer_state(), meta=meta, keep_last=self.tc.keep_last, keep=keep,
                sharded=self.par.sharded, files=self.files,
            )
        self.checkpoint_s = time.perf_counter() - started  # what a checkpoint at a preemption would take
        if self.uploader:
            self.uploader.submit(path, blocked)
        return str(path)
