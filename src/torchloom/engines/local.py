"""The local engine: N worker processes on this machine through torch's elastic launcher."""

from __future__ import annotations

import logging
import os
import sys
import time
import uuid
from pathlib import Path

from torchloom.config import Config, to_dict
from torchloom.engines.common import (
    describe_loss,
    failure_cause,
    new_launch_id,
    raise_worker_failure,
    read_result,
    run_worker,
    tail_text,
)
from torchloom.engines.progress import ProgressMonitor
from torchloom.errors import UserError
from torchloom.rundir import RunDir
from torchloom.train.result import TrainResult


def _entry(cfg_dict: dict, run_dir: str, launch_id: str, launched_at: float) -> TrainResult:
    # torchloom re-launches the workers after a lost process; run_worker sees the restart and resumes
    # from the latest complete checkpoint instead of starting over.
    return run_worker(cfg_dict, run_dir, launch_id, launched_at=launched_at)


def tail_log(log_dir: Path, rank: int, lines: int = 20) -> str:
    """The end of the newest stderr log of a local rank (torch elastic writes attempt_N/<rank>/)."""
    logs = sorted(log_dir.glob(f"*/attempt_*/{rank}/stderr.log"), key=lambda p: p.stat().st_mtime)
    return tail_text(logs[-1], lines) if logs else "(no log)"


def check_gpus(cfg: Config) -> None:
    """One process per GPU: more local workers than visible GPUs is refused before anything starts."""
    import torch

    if cfg.engine.device == "cpu" or not torch.cuda.is_available():
        return
    count = torch.cuda.device_count()
    if cfg.engine.workers > count:
        raise UserError(f"engine.workers {cfg.engine.workers}: this machine has {count} visible GPU"
                        f"{'s' if count != 1 else ''} and each worker takes one; set --engine.workers {count}"
                        " or --engine.device cpu")


def launch_config(cfg: Config, log_dir: Path):
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.launcher.api import LaunchConfig

    return LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=cfg.engine.workers,
        run_id=f"torchloom-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        max_restarts=0,
        monitor_interval=0.5,
        start_method="spawn",
        # Every rank's output goes to its log file under <run>/logs/workers and to this terminal.
        logs_specs=DefaultLogsSpecs(log_dir=str(log_dir), tee=Std.ALL),
        log_line_prefix_template="[rank${rank}] ",
        local_addr="127.0.0.1",
    )


def train(cfg: Config, run_dir: str | Path, quiet: bool = False) -> TrainResult:
    """Train with cfg.engine.workers local processes; returns rank 0's result."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    check_gpus(cfg)
    rd = RunDir(run_dir)
    log_dir = rd.worker_logs
    log_dir.mkdir(parents=True, exist_ok=True)
    rd.clear_errors()
    launch_id = new_launch_id()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    launched_at = time.time()  # workers measure time to their first step from here
    stream = open(os.devnull, "w") if quiet else sys.stderr
    # torch elastic logs each failure at length, and torch's spawn warns of each process it stops
    # ("Terminating process N via signal SIGTERM"); we report the failing rank's error ourselves.
    quieted = [logging.getLogger(name) for name in ("torch.distributed.elastic", "torch.multiprocessing")]
    levels = [log.level for log in quieted]
    for log in quieted:
        log.setLevel(logging.CRITICAL)
    # torchloom restarts, not torch elastic (which restarts on any failure): only after a lost process
    # (killed, or gone without a word), never after an error of a rank's own, which would recur.
    attempts = cfg.engine.max_restarts + 1
    try:
        for attempt in range(attempts):
            try:
                with ProgressMonitor(rd, stream=stream):
                    elastic_launch(launch_config(cfg, log_dir), _entry)(to_dict(cfg), str(rd.root), launch_id,
                                                                       launched_at)
                break
            except ChildFailedError as e:
                if attempt + 1 < attempts and failure_cause(rd, launch_id) is None:
                    rank, failure = e.get_first_failure()
                    how = f"rank {rank}: exit code {failure.exitcode}" if failure.exitcode >= 0 else failure.message
                    print(f"torchloom: train: attempt {attempt + 1} of {attempts} failed"
                          f" ({describe_loss(rd, launch_id, attempt) or how}); re-running the workers from the"
                          " latest checkpoint", file=stream, flush=True)
                    continue
                rank, failure = e.get_first_failure()
                how = f"exit code {failure.exitcode}" if failure.exitcode >= 0 else failure.message
                raise_worker_failure(rd, f"training failed on rank {rank} ({how});"
                                              f" its last output:\n{tail_log(log_dir, rank)}")
    finally:
        for log, level in zip(quieted, levels):
            log.setLevel(level)
        if quiet:
            stream.close()
    return read_result(rd, launch_id)
