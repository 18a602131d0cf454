"""The worker side of the driver <-> worker protocol (engines/common.py lists the files): what a rank
speaks, whatever engine started it.

`run_worker` is the one function every launcher runs in every worker: it counts restarts, assembles
the reporter handed to the training entry, records a failure, and writes the result. It builds the run's
files (RunFiles) once and hands that owner to everything the rank does with them: the trainer and its
checkpoints, the heartbeat, the log, the progress and error files. `worker_env` is the environment every
engine gives its workers.
"""

from __future__ import annotations

import importlib
import os
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import replace
from pathlib import Path

from torchloom.config import Config, from_dict
from torchloom.engines import faults
from torchloom.engines.common import (
    HEARTBEAT_S,
    REMOTE_BEAT_S,
    REMOTE_LOG_S,
    NotRestarted,
    RestartLimit,
    describe_loss,
    failure_cause,
    is_peer_loss,
    not_visible,
)
from torchloom.errors import UserError
from torchloom.jsonio import read_json, write_json
from torchloom.model.env import model_env
from torchloom.redaction import TUNE_STORAGE_ENV, mask_streams, remember
from torchloom.runs.rundir import RunDir
from torchloom.runs.runfiles import RunFiles
from torchloom.train import preemption
from torchloom.train.reporter import Reporter, combine
from torchloom.train.result import TrainResult

# Variables of the driver's environment that go to its workers only when set there (a test's fault):
# a long-lived process that runs workers (a Spark executor) must not keep an earlier job's.
FORWARDED = (faults.ENV, TUNE_STORAGE_ENV)


def worker_env() -> dict[str, str]:
    """The environment of every worker on every engine: the model environment (never a hub), and the
    forwarded variables the driver has."""
    return {**model_env(), **{k: os.environ[k] for k in FORWARDED if k in os.environ}}


def enter_worker_env(env: dict[str, str]) -> None:
    """In a process that runs workers of many jobs (a Spark executor): this job's worker_env()."""
    for key in FORWARDED:
        os.environ.pop(key, None)
    os.environ.update(env)


def env_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def capture_output(files: RunFiles, rank: int) -> None:
    """Send this process's stdout and stderr (Python's and native code's) to logs/rank-{rank}.log. A run on a
    store: a host that has no such log yet first takes the store's (an earlier start of this rank, on a host
    that was lost), so the log goes on from there instead of replacing it."""
    path = files.rd.rank_log(rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():  # the rank runs without the earlier lines if the store fails; it is judged elsewhere
        files.pull(path, quiet=True)
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)


# -- the reporters a worker gets -----------------------------------------------------------------
class ProgressFile(Reporter):
    """Rank 0's progress, for the driver's live bar, whatever engine runs the workers (a run on a store:
    uploaded too, at most every PUSH_EVERY_S, for a driver on another host)."""

    PUSH_EVERY_S = 2.0

    def __init__(self, files: RunFiles):
        self.path, self.files = files.rd.progress, files
        self._pushed = 0.0

    def progress(self, fields: dict) -> None:
        write_json(self.path, fields, indent=None)
        if time.monotonic() - self._pushed >= self.PUSH_EVERY_S:
            self._pushed = time.monotonic()
            self.files.push(self.path, quiet=True, wait=False)  # the training thread never waits for the bar


class ErrorFile(Reporter):
    """Records this rank's failure where the driver looks for it, before the rank leaves the group."""

    def __init__(self, files: RunFiles, rank: int, launch_id: str | None = None):
        self.files, self.rank, self.launch_id = files, rank, launch_id

    def failed(self, error: BaseException) -> None:
        record_error(self.files, self.rank, error, self.launch_id)


def hooked_reporters(rd: RunDir, rank: int) -> list[Reporter]:
    """The reporters the driver asked for in hooks.json; each class is built with rank= and its args."""
    out = []
    for spec in rd.read_hooks().get("reporters", []):
        module, _, name = spec["class"].partition(":")
        if not module.startswith("torchloom."):
            raise UserError(f"{rd.hooks}: reporter {spec['class']!r} is not torchloom's; remove the file")
        cls = getattr(importlib.import_module(module), name)
        out.append(cls(rank=rank, **spec.get("args", {})))
    return out


def worker_reporter(files: RunFiles, rank: int, engine_reporter: Reporter | None = None,
                    launch_id: str | None = None) -> Reporter:
    """Everything one rank reports to: the driver's files, the engine's own reporter, the driver's hooks, faults."""
    return combine([ErrorFile(files, rank, launch_id), ProgressFile(files), engine_reporter,
                    *hooked_reporters(files.rd, rank), faults.from_env(files, rank)])


# -- the worker ----------------------------------------------------------------------------------
def check_visible(files: RunFiles) -> None:
    """The driver prepared the data before any launch, so a worker that cannot see it is on a host
    without the shared storage; failing here takes seconds, while waiting for peers would hang. A run on a
    store has no shared directory: this host's working copy takes the prepared data from the store."""
    rd = files.rd
    files.ensure(rd.manifest)  # on a store the shards themselves are streamed from it (train/loop.py)
    if not rd.manifest.is_file():
        raise not_visible(files, [socket.gethostname()])


def record_start(files: RunFiles, launch_id: str, rank: int) -> int:
    """Record where this rank starts; returns how often it started before in this launch (0: first). A run on
    a store counts the starts the store holds: a replacement host has none of its own."""
    rd = files.rd
    files.pull(rd.logs, quiet=True)  # placements and errors of the ranks before this start, from every host
    start = len(rd.placements(launch_id, rank=rank))
    rd.logs.mkdir(parents=True, exist_ok=True)
    write_json(rd.placement_file(launch_id, rank, start), {"rank": rank, "host": socket.gethostname(),
                                                           "pid": os.getpid(), "time": time.time()}, indent=None)
    files.push(rd.placement_file(launch_id, rank, start), quiet=True)
    return start


PLACEMENT_LOCK = threading.Lock()  # the threads that rewrite this rank's placement file take turns


def update_placement(placement: Path, **fields) -> None:
    with PLACEMENT_LOCK:
        write_json(placement, {**read_json(placement), **fields}, indent=None)


def start_heartbeat(placement: Path, files: RunFiles | None = None, log: Path | None = None):
    """Touch the placement file every HEARTBEAT_S; write the beat's time in it every REMOTE_BEAT_S and publish it
    (a run on a store uploads it: common.lost_ranks reads it there), and publish the rank's `log` when it grew,
    every REMOTE_LOG_S (a host that is lost keeps its lines up to then), quietly: a store that does not answer now
    is judged by the driver. A local run's publishing moves nothing (its driver reads the files themselves).
    Returns stop(): the beats end, and the file is not touched again (a command that records its files in the
    ledger, as the torchrun entry's rank 0 does in its own process, lists it as it stays)."""
    stopped = threading.Event()

    def beat() -> None:
        pushed = logged = 0.0
        log_size = -1
        while not stopped.wait(HEARTBEAT_S):
            try:
                os.utime(placement)
                if files is None:
                    continue
                # a beat is due again in seconds: never wait on the store (and miss the local touches) for one
                if time.monotonic() - pushed >= REMOTE_BEAT_S:
                    pushed = time.monotonic()
                    update_placement(placement, beat=time.time())
                    files.push(placement, wait=False)
                if log is not None and time.monotonic() - logged >= REMOTE_LOG_S:
                    logged = time.monotonic()
                    size = log.stat().st_size
                    if size != log_size:
                        files.push(log, wait=False)
                        log_size = size
            except Exception:
                pass

    thread = threading.Thread(target=beat, name="torchloom-heartbeat", daemon=True)
    thread.start()

    def stop() -> None:
        stopped.set()
        thread.join(timeout=10)

    return stop


def note_stop_signal(placement: Path, rank: int, grace_s: float) -> None:
    """SIGTERM to this rank (a preempted host, a scheduler, or its launcher stopping it) is a notice of
    preemption (train/preemption.py): the rank stops after the step every rank agrees on, with a
    checkpoint. Its placement file records the notice; if the process is still alive `grace_s` later (it
    waits in a collective on a peer that vanished, or the checkpoint did not fit), it is marked "stopped"
    and exits, so the next start does not report it lost."""

    def mark(**fields) -> None:
        update_placement(placement, **fields)

    def expire() -> None:
        try:
            mark(stopped=True, stopped_at=time.time())
        finally:
            os._exit(128 + signal.SIGTERM)

    preemption.watch_sigterm(f"rank {rank}", grace_s, lambda: mark(notice_at=time.time()), expire)


NOTICE_POLL_S = 2.0  # how often one worker per host looks for the driver's notice file


def watch_notice_file(files: RunFiles, path: Path, every_s: float = NOTICE_POLL_S) -> None:
    """A notice that reaches the driver rather than the workers (Spark decommissioning an executor): the
    driver writes it to `path`, and this thread gives it here when the file appears (on a store: when the
    store has it). One worker per host is enough: the flag reaches every rank at the next step boundary."""

    def poll() -> None:
        while not preemption.NOTICE.given:
            try:
                files.pull(path, wait=False)  # asked again in every_s
                if path.is_file():
                    preemption.NOTICE.give(str(read_json(path).get("notice") or "the driver's notice"))
                    return
            except Exception:  # a store that does not answer now: ask again
                pass
            time.sleep(every_s)

    threading.Thread(target=poll, name="torchloom-notice-file", daemon=True).start()


def preempted_starts(rd: RunDir, launch_id: str, rank: int) -> int:
    """Starts of this rank that ended preempted: they never count against engine.max_restarts."""
    count = 0
    for path in rd.placements(launch_id, rank=rank):
        try:
            count += bool(read_json(path).get("preempted"))
        except (OSError, ValueError):
            continue
    return count


def restarted(files: RunFiles, cfg: Config, launch_id: str, rank: int, starts: int) -> Config:
    """The config of a worker that the engine (torch elastic, Ray, Spark's own stage retry or torchloom's)
    started again after a failure: resuming from the latest checkpoint. Whoever restarts,
    engine.max_restarts bounds how often; and a rank's own error, which would recur, stops it at once."""
    rd = files.rd
    limit = cfg.engine.max_restarts
    failed = starts - preempted_starts(rd, launch_id, rank)  # a start after a preemption is not a restart
    if failed > limit:
        raise RestartLimit(f"rank {rank} was restarted {failed} times; engine.max_restarts is {limit}")
    cause = failure_cause(rd, launch_id)
    if cause is not None:  # an engine that restarts on any failure (Ray, torchrun): stop at once
        raise NotRestarted(f"not restarted: rank {cause['rank']} failed with {cause['type']}, which would"
                           " happen again; restarts are for lost processes")
    if not cfg.train.resume:
        cfg = replace(cfg, train=replace(cfg.train, resume="latest"))
    loss = describe_loss(files, launch_id, starts - 1)
    label = f"restart {starts}" if failed else f"start {starts + 1}, after a preemption"
    print(f"{label}: {loss + '; ' if loss else ''}resuming from the latest checkpoint in"
          f" {rd.home(rd.checkpoints)}", flush=True)
    return cfg


PEER_LOSS_LINGER_S = 1.5


def run_worker(cfg_dict: dict, run_dir: str, launch_id: str, engine_reporter: Reporter | None = None,
               capture: bool = False, launched_at: float | None = None, device: str | None = None,
               attempt: int | None = None) -> TrainResult:
    """Train on this rank; record a failure where the driver looks for it, and re-raise it.
    run_dir: the run's location (RunDir.location: its URI, or the directory every host mounts), never the driver's
    RunFiles itself, whose staging copy is where the driver's host keeps it.
    attempt: the driver's attempt number, given where the driver may pass on a notice (rd.notice_file)."""
    from torchloom.train.entry import run as train
    from torchloom.train.resume import check_fresh

    remember([cfg_dict, os.environ.get(TUNE_STORAGE_ENV, "")])  # never printed or written (redaction.py)
    mask_streams()
    files = RunFiles(RunDir(run_dir))  # this rank's one owner of the run's files
    rd = files.rd
    rank = env_rank()
    check_visible(files)  # before anything is written: on a host without the shared storage it would land locally
    if capture:
        capture_output(files, rank)
    stop_beats = None
    try:
        cfg = from_dict(cfg_dict)  # parsed once, before any key is read: what the driver recorded, checked again
        cfg = replace(cfg, output=replace(cfg.output, dir=rd.location))
        starts = record_start(files, launch_id, rank)
        if not starts:  # this launch's first start (a restart resumes): never over an earlier training unasked
            check_fresh(files, cfg.train.resume, cfg.output.overwrite)
        placement = rd.placement_file(launch_id, rank, starts)
        note_stop_signal(placement, rank, float(cfg.train.preemption_grace_s))
        if cfg.train.preemption_url and int(os.environ.get("LOCAL_RANK", "0")) == 0:
            preemption.poll_url(cfg.train.preemption_url)
        if attempt is not None and int(os.environ.get("LOCAL_RANK", "0")) == 0:
            watch_notice_file(files, rd.notice_file(launch_id, attempt))
        stop_beats = start_heartbeat(placement, files, rd.rank_log(rank) if capture else None)
        if starts:
            cfg = restarted(files, cfg, launch_id, rank, starts)
        result = train(cfg, files, worker_reporter(files, rank, engine_reporter, launch_id),
                       launched_at=launched_at, device=device)
        stop_beats()  # trained: the placement file is written once more below at most, never touched after
        if result.preemptions:  # this start ended preempted: the next one is not a restart
            update_placement(placement, preempted=True)
            files.push(placement, quiet=True)
        if rank == 0:
            write_json(rd.result_file(launch_id), result.to_dict(), indent=None)
            # the result last: a driver that sees it finds everything it reads with it
            files.push(rd.metrics, rd.progress, rd.result_file(launch_id), quiet=True)
        return result
    except BaseException as e:
        record_error(files, rank, e, launch_id)
        if is_peer_loss(str(e)):
            # A consequence of another rank's end: leave a moment after it, so that a launcher that names the
            # first worker it finds ended (torch elastic polls every 0.5 s) names the rank that went away.
            time.sleep(PEER_LOSS_LINGER_S)
        raise
    finally:
        if stop_beats is not None:
            stop_beats()
        if capture:
            sys.stdout.flush()
            sys.stderr.flush()
            files.push(rd.rank_log(rank), quiet=True)


def record_error(files: RunFiles, rank: int, e: BaseException, launch_id: str | None = None) -> None:
    """Write this rank's error for the driver; the first one stays (a restarted attempt may fail too)."""
    path = files.rd.error_file(rank)
    if path.exists():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, {
        "rank": rank,
        "launch": launch_id,
        "time": time.time(),
        "type": type(e).__name__,
        "user_error": isinstance(e, UserError),
        "transient": bool(getattr(e, "transient", False)),  # storage.StoreUnavailable: restartable
        "message": str(e),
        "traceback": "".join(traceback.format_exception(e)),
    }, indent=None)
    files.push(path, quiet=True)
