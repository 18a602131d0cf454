"""Where a training starts: a fresh start (the earlier training's checkpoints and metrics cleared), or the
checkpoint `train.resume` names, on the same workers or on others (the same global batches go on)."""

from __future__ import annotations

from typing import Any

from torchloom.config import elastic_micro_batch
from torchloom.train import checkpoint
from torchloom.train.state import TrainState


def resume(t: Any) -> str | None:
    """Load the checkpoint to resume from into `t`, the train/loop.Trainer being built (model, optimizer,
    schedule, counters, loader position); the checkpoint's path, or None for a fresh start."""
    if t.tc.resume == "latest":  # a run on a store: the checkpoints this host's copy needs, from the store
        if t.d.local_rank == 0:  # one download per host; the ranks beside it read the same copy
            t.files.pull_checkpoints(intact=lambda p: checkpoint.damage(p) is None)
        t.d.io_barrier()
    path = checkpoint.resolve_once(t.d, t.tc.resume, t.rd.checkpoints)
    if path is None:
        if t.d.is_main:
            t.rd.reset_metrics(None, keep_driver=True)
            if not t.tc.resume:  # a fresh training: the earlier one's checkpoints would be exported
                checkpoint.clear_earlier(t.files)
        return None
    ts = checkpoint.load(t.d, path, model=t.model, optimizer=t.optimizer, sharded=t.par.sharded)
    t.scheduler.load_state_dict(ts["scheduler"])
    if t.scaler is not None and ts.get("scaler"):
        t.scaler.load_state_dict(ts["scaler"])
    t.state = TrainState(**ts["state"])
    t.resumed_step = t.state.step
    saved = ts["loader"]
    if saved.get("world_size") not in (None, t.par.dp_size) and t.par.pipeline is None:
        # Elastic: other workers, the same global batches. A micro-batch that fit the old
        # workers' memory is kept, with more accumulation, rather than grown.
        t.resumed_world_size = int(saved["world_size"])
        micro = elastic_micro_batch(t.tc.batch_size, t.par.dp_size, t.micro_batch,
                                    int(saved.get("batch_size") or t.micro_batch))
        if micro != t.micro_batch:
            t.micro_batch = micro
            t.loader = t.build_loader(micro)
        if t.d.is_main:
            print(f"train: resuming step {t.state.step} on {t.par.dp_size} workers (the checkpoint's run"
                  f" had {saved['world_size']}): the same global batches of {t.tc.batch_size} go on, as"
                  f" {t.loader.accum} micro-batch(es) of {micro} per worker", flush=True)
    if t.tc.length_bucketing == "auto" and "length_bucketing" in saved:
        t.loader.length_bucketing = bool(saved["length_bucketing"])  # auto goes on as the run began
    t.loader.load_state_dict(saved)
    if t.d.is_main:
        t.files.catch_up_metrics(t.state.step)
        t.rd.reset_metrics(t.state.step)
    return str(path)
