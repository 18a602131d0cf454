"""The function every engine runs in every worker process."""

from __future__ import annotations

import os
import time
from pathlib import Path

from torchloom.config import Config, from_dict
from torchloom.train.distributed import setup, teardown
from torchloom.train.reporter import Reporter, worker_reporter


def worker_threads(cfg: Config) -> int:
    if cfg.engine.threads_per_worker:
        return cfg.engine.threads_per_worker
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    return max(1, (os.cpu_count() or 1) // max(1, local_world))


def placement(d) -> str:
    """One line per rank at start: where it runs and with what (the driver shows it prefixed by rank)."""
    import socket

    import torch

    line = (f"rank {d.rank} of {d.world_size} on {socket.gethostname()} (pid {os.getpid()}): {d.device},"
            f" {torch.get_num_threads()} torch thread{'s' if torch.get_num_threads() != 1 else ''}")
    niceness = os.nice(0) if hasattr(os, "nice") else 0
    if niceness > 0:  # e.g. Ray's default for worker processes: every normal-priority process preempts it
        line += f", niceness {niceness} (lower CPU priority than the processes around it)"
    return line


def run(cfg: Config | dict, run_dir: str | Path, reporter: Reporter | None = None, on_error=None) -> dict:
    """Train on this rank: join the process group, build, fit, leave. Returns this rank's result."""
    from torchloom.train.loop import Trainer

    if isinstance(cfg, dict):
        cfg = from_dict(cfg)
    d = setup(cfg.engine.device, worker_threads(cfg))
    print(placement(d), flush=True)
    reporter = worker_reporter(run_dir, d.rank, reporter)
    try:
        return Trainer(cfg, d, run_dir, reporter).fit()
    except BaseException as e:
        # When it failed, before teardown: the other ranks fail as soon as this one leaves the
        # process group, and the driver reports the earliest failure as the cause.
        try:
            e.torchloom_time = time.time()
        except AttributeError:  # an exception type that takes no attributes
            pass
        if on_error is not None:
            # Record it now: once this rank leaves, a launcher may kill it before the error surfaces.
            on_error(e)
        raise
    finally:
        try:
            reporter.close()  # e.g. flush the MLflow queue
        finally:
            teardown(d)
