"""The trainer's state in and out: what a checkpoint keeps of a training, and where a training starts.

The state contract is one dict, `trainer_state()`: the schedule, the scaler, the loader's position and the counters
(TrainState); a checkpoint holds it beside the weights and the optimizer (train/checkpoint.py), and `restore()`
takes it back. `start()` runs at the start of `fit()`, once the Trainer is whole: a fresh start (the earlier
training's checkpoints and metrics cleared), or the checkpoint `train.resume` names, on the same workers or on others
(the same global batches go on). The Trainer (train/loop.py) holds a Checkpoints, not a mixin of this.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from torchloom.config import elastic_micro_batch
from torchloom.train import checkpoint, preemption
from torchloom.train.distributed import all_gather_objects, any_rank
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
    steps = files.checkpoints.steps()
    if not steps:
        if files.place.holds(files.rd.checkpoints):  # a killed training's unfinished ones: removed only by record
            deletable(files.place.tree(), "output.dir", inputs, under="checkpoints")
        return
    if not overwrite:
        shown = ", ".join(map(str, sorted(steps)[-3:]))
        more = "..." if len(steps) > 3 else ""
        raise UserError(f"output.dir {files.rd.where}: holds {len(steps)} checkpoint(s) of an earlier training (steps"
                        f" {more}{shown}), which a fresh training would delete; pass {flags[0]} to go on from the"
                        f" latest, or {flags[1]} to train afresh")
    deletable(files.place.tree(), "output.dir", inputs, under="checkpoints")


def starting_point(files, d, resume: str) -> Path | None:
    """The checkpoint a training starts from (train.resume: "latest", a path, or "" for a fresh start), held by this
    host's copy of the run (`files`: the run's owner; a run on a store: one download per host, the ranks beside it
    read the same copy); None: a fresh start, for which rank 0 clears the earlier training's metrics and (unless a
    resume found nothing) its checkpoints, which would otherwise be exported."""
    if resume == "latest":
        if d.local_rank == 0:
            files.checkpoints.pull(intact=lambda p: checkpoint.damage(p) is None)
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


def elastic_micro_batch_of(saved: dict, tc, par, micro_batch: int) -> tuple[int | None, int]:
    """A resume on other workers than the checkpoint's (`saved`: its loader's state): the checkpoint's number of
    workers (None: the same, or a pipeline) and the micro-batch that goes on. The same global batches go on; a
    micro-batch that fit the old workers' memory is kept, with more accumulation, rather than grown."""
    dp = par.dp_size
    if saved.get("world_size") in (None, dp) or par.pipeline is not None:
        return None, micro_batch
    return int(saved["world_size"]), elastic_micro_batch(tc.batch_size, dp, micro_batch,
                                                         int(saved.get("batch_size") or micro_batch))


def trainer_state(scheduler, scaler, loader, state: TrainState) -> dict:
    """The state contract: what a checkpoint keeps of the training besides the weights and the optimizer."""
    return {"scheduler": scheduler.state_dict(), "scaler": scaler.state_dict() if scaler is not None else {},
            "loader": loader.state_dict(), "state": asdict(state)}


class Checkpoints:
    """A training's checkpoints, an object its Trainer holds (`trainer.checkpoints`): where the training starts,
    each checkpoint written (rank 0's uploaded in the background for a run on a store) and what one took. The
    Trainer hands it the weights, the optimizer and trainer_state(); what the state holds is the Trainer's."""

    def __init__(self, d, files, tc, par, clock, log) -> None:
        self.d, self.files, self.rd, self.tc, self.par, self.clock = d, files, files.rd, tc, par, clock
        # A run on a store: rank 0 uploads each checkpoint in the background (RunFiles.checkpoints.uploader).
        self.uploader = files.checkpoints.uploader(log) if d.is_main else None
        self.checkpoint_s = 0.0  # the last checkpoint's write (0 before the first): what one at a preemption takes

    def start(self, model, optimizer) -> tuple[str, dict] | None:
        """Where the training starts (at the start of fit): the checkpoint train.resume names, its weights and
        optimizer loaded, and its trainer_state; None for a fresh start."""
        path = starting_point(self.files, self.d, self.tc.resume)
        if path is None:
            return None
        return str(path), checkpoint.load(self.d, path, model=model, optimizer=optimizer, sharded=self.par.sharded)

    def went_on(self, step: int) -> None:
        """After a resume: the run's history goes on from the checkpoint's step (the store's lines first)."""
        if self.d.is_main:
            self.files.catch_up_metrics(step)
            self.rd.reset_metrics(step)

    def save(self, s: TrainState, model, optimizer, state: dict, eval_summary: dict) -> str:
        """A checkpoint of step s.step (`state`: the Trainer's trainer_state()), kept by keep_last and the best."""
        s.last_checkpoint_step = s.step
        meta = {"epoch": s.epoch, "samples_seen": s.samples_seen, "best_step": s.best_step,
                "strategy": self.par.strategy, "eval": eval_summary}
        keep = {s.best_step} if s.best_step >= 0 else set()
        # Backpressure: the previous upload finishes before this checkpoint is written (and pruned against).
        blocked = self.uploader.wait() if self.uploader else 0.0
        started = time.perf_counter()
        with self.clock.phase("checkpoint"):
            path = checkpoint.save(
                self.d, self.rd.checkpoints, s.step, model=model, optimizer=optimizer, trainer_state=state,
                meta=meta, keep_last=self.tc.keep_last, keep=keep, sharded=self.par.sharded, files=self.files,
            )
        self.checkpoint_s = time.perf_counter() - started
        if self.uploader:
            self.uploader.submit(path, blocked)
        return str(path)

    def at_notice(self, s: TrainState, save: Callable[[], str]) -> tuple[int, float, dict]:
        """Collective, every rank preempted after step s.step: one checkpoint of it (`save`) if one fits in what is
        left of train.preemption_grace_s on every rank (else the newest checkpoint stands), uploads drained. Returns
        the step the run goes on from, the seconds from the earliest notice to the checkpoint written (-1: none)
        and the uploads."""
        grace = self.tc.preemption_grace_s
        earliest = min(x for x in all_gather_objects(self.d, preemption.NOTICE.at))
        newest, need = s.last_checkpoint_step, 1.5 * self.checkpoint_s
        short = any_rank(self.d, s.last_checkpoint_step != s.step and need > preemption.NOTICE.left_s(grace))
        if s.last_checkpoint_step != s.step and not short:
            save()
        uploads = self.drain()
        if short and self.d.is_main:
            where = f"the newest checkpoint, step {newest}," if newest > 0 else "with no checkpoint yet, the start"
            print(f"torchloom: preempted at step {s.step}: a checkpoint takes about {need:.0f} s, more than the"
                  f" {preemption.NOTICE.left_s(grace):.0f} s left of train.preemption_grace_s {grace:g}; {where}"
                  " is where the run goes on", flush=True)
        if short:
            return max(0, newest), -1.0, uploads
        return s.step, round(time.time() - earliest, 2), uploads

    def drain(self) -> dict:
        """The job ends with its last upload done: the uploads' totals ({} for a local run, or a rank but 0)."""
        return self.uploader.drain() if self.uploader else {}
