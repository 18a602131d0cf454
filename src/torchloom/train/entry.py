"""The function every engine runs in every worker process: parse, set up, fit, clean up."""

from __future__ import annotations

import os
import socket

from torchloom.config import Config, from_dict
from torchloom.machine import usable_cores
from torchloom.runs.runfiles import RunFiles
from torchloom.train.distributed import Dist, setup, teardown
from torchloom.train.reporter import Reporter
from torchloom.train.result import TrainResult


def worker_threads(cfg: Config) -> int:
    if cfg.engine.threads_per_worker:
        return cfg.engine.threads_per_worker
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    return max(1, usable_cores() // max(1, local_world))


def placement(d: Dist) -> str:
    """One line per rank at start: where it runs and with what (the driver shows it prefixed by rank)."""
    import torch

    threads = torch.get_num_threads()
    line = (f"rank {d.rank} of {d.world_size} on {socket.gethostname()} (pid {os.getpid()}): {d.device},"
            f" {threads} torch thread{'s' if threads != 1 else ''}")
    niceness = os.nice(0) if hasattr(os, "nice") else 0
    if niceness > 0:  # e.g. Ray's default for worker processes: every normal-priority process preempts it
        line += f", niceness {niceness} (lower CPU priority than the processes around it)"
    return line


def run(cfg: Config | dict, files: RunFiles, reporter: Reporter | None = None, *, launched_at: float | None = None,
        device: str | None = None) -> TrainResult:
    """Train on this rank: join the process group the engine described, fit, leave. Returns this rank's result.

    files: the run's (the worker's one owner of them, for the trainer, its checkpoints and uploads);
    `launched_at` is the wall-clock time the engine launched the job, from which the time to the first step is
    measured;
    `device` is the device the engine assigned this rank (Ray Train's), else engine.device decides.
    """
    import time

    from torchloom.train.loop import Trainer

    entered = time.time()
    cfg = from_dict(cfg) if isinstance(cfg, dict) else cfg
    reporter = reporter or Reporter()
    d = setup(cfg.engine.device, worker_threads(cfg), device, cfg.engine.collective_timeout_s)
    # the engine's part of the start-up: from its launch to this process running torchloom (interpreter,
    # imports; Ray's and Spark's own scheduling), then joining the process group
    startup = {"worker_launch_s": entered - launched_at if launched_at else None,
               "process_group_s": time.time() - entered}
    print(placement(d), flush=True)
    try:
        return Trainer(cfg, d, files, reporter, launched_at=launched_at, startup=startup).fit()
    except BaseException as e:
        # Before teardown: the other ranks fail as soon as this one leaves the process group, and a
        # launcher may kill this one then; the driver reports the earliest failure as the cause.
        reporter.failed(e)
        raise
    finally:
        try:
            reporter.close()  # e.g. flush the MLflow queue
        finally:
            teardown(d)
