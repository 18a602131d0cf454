"""The local engine: N worker processes on this machine through torch's elastic launcher."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from torchloom.config import Config, to_dict
from torchloom.engines.driver import Attempt, AttemptFailed, LauncherStopped, attempts
from torchloom.engines.lifeline import DRIVER_ENV, driver_token, worker_lifeline
from torchloom.engines.worker import run_worker, worker_env
from torchloom.errors import UserError
from torchloom.runs.runfiles import RunFiles
from torchloom.train.result import TrainResult


def _entry(cfg_dict: dict, run_dir: str, launch_id: str, launched_at: float) -> TrainResult:
    # torchloom re-launches the workers after a lost process; run_worker sees the restart and resumes
    # from the latest complete checkpoint instead of starting over.
    worker_lifeline()  # a driver killed with SIGKILL takes its workers with it (engines/lifeline.py)
    result = run_worker(cfg_dict, run_dir, launch_id, launched_at=launched_at)
    if result.preemptions:
        leave_soon()
    return result


def leave_soon(after_s: float = 2.0) -> None:
    """A worker whose run ended preempted leaves `after_s` after returning its result. torch elastic's
    worker waits, after handing its result to the launcher, until the launcher has read every rank's; a
    launcher that was itself told to stop never does, and the worker would wait for the SIGKILL 30 s later.
    The result is in the pipe by then, so a launcher that reads it still finds it."""
    def leave() -> None:
        time.sleep(after_s)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    threading.Thread(target=leave, name="torchloom-leave", daemon=True).start()


def tail_text(path: Path, lines: int = 20) -> str:
    if not path.is_file():
        return "(no log)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) or "(empty log)"


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


def launch_config(cfg: Config, log_dir: Path, start_method: str = "spawn"):
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.launcher.api import LaunchConfig

    return LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=cfg.engine.workers,
        run_id=f"torchloom-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        max_restarts=0,  # torchloom restarts (driver.attempts), only after a lost process
        monitor_interval=0.5,
        start_method=start_method,
        # Every rank's output goes to its log file under <run>/logs/workers and to this terminal.
        logs_specs=DefaultLogsSpecs(log_dir=str(log_dir), tee=Std.ALL),
        log_line_prefix_template="[rank${rank}] ",
        local_addr="127.0.0.1",
    )


PRELOAD = "torchloom.engines.preload"
# The fork server the workers start from: the environment it started with, and the launches using it now.
_server: dict = {"env": None, "launches": 0}
_server_lock = threading.Lock()


@contextlib.contextmanager
def worker_start(cfg: Config) -> Iterator[str]:
    """How one launch's workers start: as forks of a fork server that has imported what a worker needs
    (engines/preload.py: a worker is then ready in a fraction of a second instead of ~8 CPU s of imports,
    on every restart too), or with spawn (a fresh interpreter each) where forking is not safe: with CUDA,
    which a forked child cannot initialise once its parent has, and where the platform has no fork server.
    The server starts with this process's environment as it is now, and again once that has changed (as
    spawn would give the workers the environment of the moment). It stays for the next launch of this process
    (a restart, a tune study's next trial) and ends with the process; `run` stops it once training is done."""
    import multiprocessing
    from multiprocessing import forkserver

    import torch

    if (cfg.engine.start_method == "spawn" or (cfg.engine.device != "cpu" and torch.cuda.is_available())
            or "forkserver" not in multiprocessing.get_all_start_methods()
            or not hasattr(forkserver._forkserver, "_stop")):
        yield "spawn"
        return
    # torch elastic's own settings of the launcher (TORCHELASTIC_SIGNALS_TO_HANDLE, set by the first launch):
    # the workers get theirs from the launch; the driver's token names this process, whichever thread launches
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_") and k != DRIVER_ENV}
    with _server_lock:
        if _server["env"] not in (None, env) and not _server["launches"]:  # else a launch runs from it: spawn
            _stop_server()
        if _server["env"] is None:
            forkserver.set_forkserver_preload([PRELOAD])
            forkserver.ensure_running()
            _server["env"] = env
        method = "forkserver" if _server["env"] == env else "spawn"
        _server["launches"] += method == "forkserver"
    try:
        yield method
    finally:
        if method == "forkserver":
            with _server_lock:
                _server["launches"] -= 1


def stop_fork_server() -> None:
    """Stop the fork server once no launch uses it (its workers' ends are reported through it): it holds a
    worker's imports in memory."""
    with _server_lock:
        if _server["env"] is not None and not _server["launches"]:
            _stop_server()


def _stop_server() -> None:
    from multiprocessing import forkserver

    forkserver._forkserver._stop()
    _server["env"] = None


@contextlib.contextmanager
def quiet_launcher() -> Iterator[None]:
    """torch elastic logs each failure at length, and torch's spawn warns of each process it stops
    ("Terminating process N via signal SIGTERM"); we report the failing rank's error ourselves."""
    quieted = [logging.getLogger(name) for name in ("torch.distributed.elastic", "torch.multiprocessing")]
    levels = [log.level for log in quieted]
    for log in quieted:
        log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for log, level in zip(quieted, levels):
            log.setLevel(level)


def train(cfg: Config, run: RunFiles | str | Path, quiet: bool = False) -> TrainResult:
    """Train with cfg.engine.workers local processes; returns rank 0's result."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    check_gpus(cfg)
    files = RunFiles.of(run)  # the command's Run's files (a path: a Python caller's run directory)
    rd = files.rd
    log_dir = rd.worker_logs
    log_dir.mkdir(parents=True, exist_ok=True)
    os.environ.update(worker_env())  # the workers start with this environment (worker_start)
    os.environ[DRIVER_ENV] = driver_token()  # ...and die with this process (engines/lifeline.py)

    def launch_once(attempt: Attempt) -> None:
        try:
            with worker_start(cfg) as method:
                elastic_launch(launch_config(cfg, log_dir, method), _entry)(to_dict(cfg), rd.location,
                                                                            attempt.launch_id, attempt.launched_at)
        except SignalException as e:
            # SIGTERM to this launcher: torch elastic passed it to the workers and gave them 30 s to stop
            # (they stop after the same step with a checkpoint: train/preemption.py)
            raise LauncherStopped(str(e)) from e
        except ChildFailedError as e:
            rank, failure = e.get_first_failure()
            exited = failure.exitcode >= 0  # else a signal, which the message names
            how = f"exit code {failure.exitcode}" if exited else failure.message
            raise AttemptFailed(f"rank {rank}: {how}" if exited else how,
                                f"training failed on rank {rank} ({how}); its last output:\n{tail_log(log_dir, rank)}"
                                ) from e

    with quiet_launcher():
        # torch elastic's logs already reach this terminal, each line prefixed (tee)
        return attempts(files, cfg, launch_once, "local", quiet=quiet, tail_logs=False, failures=(AttemptFailed,))
