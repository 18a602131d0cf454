"""What every engine shares: the worker side of the driver <-> worker protocol, and the driver's reading of it.

Whatever started them, workers talk to the driver only through files in the run directory (shared
storage on a cluster), so the three engines behave the same. rundir.py names the files; this module
owns what they mean:
  hooks.json                 written by the driver before a launch: reporters the workers must add
                             (e.g. an Optuna pruner), as {"reporters": [{"class": "module:Name", "args": {...}}]}
  progress.json              rewritten by rank 0 at every log step; the driver draws it (engines/progress.py)
  logs/error-rank{R}.json    a failed rank's error and traceback (the driver raises the first)
  logs/result-{launch}.json  rank 0's TrainResult of one launch
  logs/rank-{R}.log          a rank's stdout and stderr, when the engine does not collect them itself
  logs/placement-{launch}-rank{R}-start{N}.json  where rank R ran at its Nth start in this launch: a
                             second start is a restart; touched every second (a heartbeat). A rank that
                             left no error file, was not stopped by its launcher ("stopped": true,
                             written on SIGTERM) and whose heartbeat ended well before the others' was lost

`run_worker` is the one function every launcher runs in every worker: it counts restarts, assembles
the reporter handed to the training entry, records a failure, and writes the result.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import re
import signal
import socket
import sys
import threading
import time
import traceback
import uuid
from pathlib import Path

from torchloom.errors import UserError
from torchloom.rundir import RunDir, read_json, write_json
from torchloom.train.reporter import Reporter, combine
from torchloom.train.result import TrainResult


class TrainingFailed(Exception):
    """A worker failed; the message carries that rank's traceback."""

    exit_code = 1


class RestartLimit(RuntimeError):
    """A worker refused to start again: the job already used its restarts."""


class NotRestarted(RuntimeError):
    """A worker refused to start again: a rank failed with an error of its own, which a restart repeats."""


def replace_engine(cfg, **changes):
    """A copy of cfg with engine fields changed (the caller's config stays as the user gave it)."""
    return dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, **changes))


def new_launch_id() -> str:
    return uuid.uuid4().hex[:12]


def env_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def capture_output(rd: RunDir, rank: int) -> None:
    """Send this process's stdout and stderr (Python's and native code's) to logs/rank-{rank}.log."""
    path = rd.rank_log(rank)
    path.parent.mkdir(parents=True, exist_ok=True)
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
    """Rank 0's progress, for the driver's live bar, whatever engine runs the workers."""

    def __init__(self, rd: RunDir):
        self.path = rd.progress

    def progress(self, fields: dict) -> None:
        write_json(self.path, fields, indent=None)


class ErrorFile(Reporter):
    """Records this rank's failure where the driver looks for it, before the rank leaves the group."""

    def __init__(self, rd: RunDir, rank: int, launch_id: str | None = None):
        self.rd, self.rank, self.launch_id = rd, rank, launch_id

    def failed(self, error: BaseException) -> None:
        record_error(self.rd, self.rank, error, self.launch_id)


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


def worker_reporter(rd: RunDir, rank: int, engine_reporter: Reporter | None = None,
                    launch_id: str | None = None) -> Reporter:
    """Everything one rank reports to: the driver's files, the engine's own reporter, the driver's hooks, faults."""
    from torchloom.engines import faults

    return combine([ErrorFile(rd, rank, launch_id), ProgressFile(rd), engine_reporter, *hooked_reporters(rd, rank),
                    faults.from_env(rd, rank)])


# -- the worker ----------------------------------------------------------------------------------
class RunDirNotVisible(UserError):
    """This host does not see the run directory the driver prepared (no shared storage, another path)."""


def not_visible(rd: RunDir, hosts: list[str]) -> RunDirNotVisible:
    return RunDirNotVisible(
        f"output.dir {rd.root}: not visible on host{'s' if len(hosts) > 1 else ''} {', '.join(hosts)} (no"
        f" {rd.manifest.relative_to(rd.root)} there); put the run directory on storage every host mounts at the same"
        " path")


def check_visible(rd: RunDir) -> None:
    """The driver prepared the data before any launch, so a worker that cannot see it is on a host
    without the shared storage; failing here takes seconds, while waiting for peers would hang."""
    if not rd.manifest.is_file():
        raise not_visible(rd, [socket.gethostname()])


def worker_user_error(text: str) -> str | None:
    """The one-line message of a worker's UserError in an engine's error text (Spark, Ray and torchrun
    put the worker's traceback in theirs), for when the worker could not write its error file."""
    found = re.findall(r"(?:UserError|RunDirNotVisible): (.+)", text)
    return found[-1].strip() if found else None


def record_start(rd: RunDir, launch_id: str, rank: int) -> int:
    """Record where this rank starts; returns how often it started before in this launch (0: first)."""
    start = len(rd.placements(launch_id, rank=rank))
    rd.logs.mkdir(parents=True, exist_ok=True)
    write_json(rd.placement_file(launch_id, rank, start), {"rank": rank, "host": socket.gethostname(),
                                                           "pid": os.getpid(), "time": time.time()}, indent=None)
    return start


# Each rank touches its placement file every HEARTBEAT_S from a thread of its own (which runs while
# the training thread waits in a collective); a rank whose touches stopped LOST_AFTER_S before the
# last of its attempt's did not simply fail with the others: its process or host went away.
HEARTBEAT_S = 1.0
LOST_AFTER_S = 3.0  # under the smallest engine.collective_timeout_s (5), less a beat each side


def start_heartbeat(placement: Path) -> None:
    def beat() -> None:
        while True:
            time.sleep(HEARTBEAT_S)
            try:
                os.utime(placement)
            except OSError:
                pass

    threading.Thread(target=beat, name="torchloom-heartbeat", daemon=True).start()


def lost_ranks(rd: RunDir, launch_id: str, start: int) -> list[dict]:
    """The ranks of the given start of this launch that vanished: they left no error of their own (a
    failing rank records one before it leaves), were not stopped by their launcher, and their heartbeat
    ended well before the others' (as when a host dies or is cut off, and the others wait for it)."""
    placed = []
    for p in rd.placements(launch_id, start):
        try:
            placed.append((read_json(p), p.stat().st_mtime))
        except (OSError, ValueError):
            continue
    if not placed:
        return []
    last = max(beat for _, beat in placed)
    return [info for info, beat in placed
            if not info.get("stopped") and not rd.error_file(info["rank"]).exists() and last - beat > LOST_AFTER_S]


def note_stop_signal(placement: Path) -> None:
    """When the launcher stops this rank with SIGTERM (torch elastic does, after another rank failed or
    when a node joins), mark its placement file "stopped" and exit, so the next start does not report
    it lost. Python runs a signal handler only between bytecodes, and a rank blocked in a collective
    would not run one until the collective times out; so the signal wakes a thread, which records the
    stop and exits at once. Only from the main thread (Ray runs the training function in another)."""
    if threading.current_thread() is not threading.main_thread():
        return
    wake, wakeup = os.pipe()  # plain descriptors: they stay open for the life of the process
    os.set_blocking(wakeup, False)
    signal.signal(signal.SIGTERM, lambda *_: None)  # a Python-level handler makes the C handler write to the fd
    signal.set_wakeup_fd(wakeup, warn_on_full_buffer=False)

    def watch() -> None:
        while data := os.read(wake, 64):
            if signal.SIGTERM in data:
                try:
                    write_json(placement, {**read_json(placement), "stopped": True, "stopped_at": time.time()},
                               indent=None)
                finally:
                    os._exit(128 + signal.SIGTERM)

    threading.Thread(target=watch, name="torchloom-sigterm", daemon=True).start()


def describe_loss(rd: RunDir, launch_id: str, start: int) -> str:
    lost = lost_ranks(rd, launch_id, start)
    if not lost:
        return ""
    return "; ".join(f"rank {p['rank']} on host {p['host']} stopped answering (lost)" for p in lost)


def run_worker(cfg_dict: dict, run_dir: str, launch_id: str, engine_reporter: Reporter | None = None,
               capture: bool = False, launched_at: float | None = None, device: str | None = None) -> TrainResult:
    """Train on this rank; record a failure where the driver looks for it, and re-raise it."""
    from torchloom.train.entry import run

    rd = RunDir(run_dir)
    rank = env_rank()
    check_visible(rd)  # before anything is written: on a host without the shared storage it would land locally
    if capture:
        capture_output(rd, rank)
    try:
        cfg_dict = {**cfg_dict, "output": {**cfg_dict["output"], "dir": str(rd.root)}}
        starts = record_start(rd, launch_id, rank)
        note_stop_signal(rd.placement_file(launch_id, rank, starts))
        start_heartbeat(rd.placement_file(launch_id, rank, starts))
        if starts:
            # The engine (torch elastic, Ray, Spark's own stage retry or torchloom's) restarted this
            # worker after a failure. Whoever restarts, engine.max_restarts bounds how often.
            limit = cfg_dict["engine"]["max_restarts"]
            if starts > limit:
                raise RestartLimit(f"rank {rank} was restarted {starts} times; engine.max_restarts is {limit}")
            cause = failure_cause(rd, launch_id)
            if cause is not None:  # an engine that restarts on any failure (Ray, torchrun): stop at once
                raise NotRestarted(f"not restarted: rank {cause['rank']} failed with {cause['type']}, which would"
                                   " happen again; restarts are for lost processes")
            if not cfg_dict["train"]["resume"]:
                cfg_dict = {**cfg_dict, "train": {**cfg_dict["train"], "resume": "latest"}}
            loss = describe_loss(rd, launch_id, starts - 1)
            print(f"restart {starts}: {loss + '; ' if loss else ''}resuming from the latest checkpoint in"
                  f" {rd.checkpoints}", flush=True)
        result = run(cfg_dict, worker_reporter(rd, rank, engine_reporter, launch_id), launched_at=launched_at,
                     device=device)
        if rank == 0:
            write_json(rd.result_file(launch_id), result.to_dict(), indent=None)
        return result
    except BaseException as e:
        record_error(rd, rank, e, launch_id)
        raise
    finally:
        if capture:
            sys.stdout.flush()
            sys.stderr.flush()


def record_error(rd: RunDir, rank: int, e: BaseException, launch_id: str | None = None) -> None:
    """Write this rank's error for the driver; the first one stays (a restarted attempt may fail too)."""
    path = rd.error_file(rank)
    if path.exists():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, {
        "rank": rank,
        "launch": launch_id,
        "time": time.time(),
        "type": type(e).__name__,
        "user_error": isinstance(e, UserError),
        "message": str(e),
        "traceback": "".join(traceback.format_exception(e)),
    }, indent=None)


# -- the driver's side ---------------------------------------------------------------------------
def read_result(rd: RunDir, launch_id: str) -> TrainResult:
    """Rank 0's result of this launch; without one, the first worker error (or a pointer to the logs)."""
    path = rd.result_file(launch_id)
    if not path.is_file():
        raise_worker_failure(rd, f"training ended without a result from rank 0; see the logs in {rd.logs}")
    return TrainResult.from_dict(read_json(path))


PEER_LOSS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "gloo/transport",
             "NCCL communicator was aborted", "Socket Timeout", "collective operation timeout",
             "Failed to recv, got 0 bytes", "wait timeout after")
# A rank's own error that says nothing of its cause: the launcher's refusals, or a stop it was sent.
NOT_A_CAUSE = ("RestartLimit", "NotRestarted")


def failure_cause(rd: RunDir, launch_id: str) -> dict | None:
    """The error a rank of this launch recorded of its own (not a peer's loss seen in a collective, not
    a refusal to restart): a deterministic failure, which a restart would repeat. None: the ranks that
    failed only lost peers, or vanished without a word (a killed process, a lost host): restartable."""
    causes = []
    for p in rd.error_files():
        try:
            e = read_json(p)
        except (OSError, ValueError):
            continue
        if e.get("launch") == launch_id and e["type"] not in NOT_A_CAUSE and not is_peer_loss(e["message"]):
            causes.append(e)
    return min(causes, key=lambda e: (e.get("time", 0.0), e["rank"])) if causes else None


def is_peer_loss(message: str) -> bool:
    """A collective that failed because another rank went away: a consequence, not a cause."""
    return any(p in message for p in PEER_LOSS)


def rerun_or_raise(rd: RunDir, launch_id: str, attempt: int, attempts: int, error: Exception, engine: str) -> None:
    """After `attempt` (0-based) of `attempts` failed with `error`: when a lost process caused it and an
    attempt is left, say so and return (the caller re-runs the workers, which resume from the latest
    checkpoint); else raise the job's error. A rank's own error (a user error too) would come back the same."""
    text = str(error)
    if attempt + 1 < attempts and not worker_user_error(text) and failure_cause(rd, launch_id) is None:
        loss = describe_loss(rd, launch_id, attempt)
        print(f"torchloom: train: attempt {attempt + 1} of {attempts} failed ({loss or type(error).__name__});"
              " re-running the workers from the latest checkpoint", file=sys.stderr, flush=True)
        return
    loss = describe_loss(rd, launch_id, attempt)
    first = text.splitlines()[0] if text else repr(error)
    raise_worker_failure(rd, f"training on {engine} failed: {loss or first}", text)


def raise_worker_failure(rd: RunDir, fallback: str, engine_error: str = "") -> None:
    """Turn the first recorded worker error into the error the user sees.

    engine_error: the engine's own error text, searched for a worker's UserError when no rank could
    record one (a host that does not see the run directory).
    """
    errors = []
    for p in rd.error_files():
        try:
            errors.append(read_json(p))
        except (OSError, ValueError):
            continue
    if not errors:
        message = worker_user_error(engine_error)
        if message:
            raise UserError(message)
        raise TrainingFailed(fallback)
    # The root cause is the first error: the other ranks typically fail after it, in a collective
    # whose peer went away.
    first = min(errors, key=lambda e: (e["type"] in NOT_A_CAUSE, is_peer_loss(e["message"]), e.get("time", 0.0),
                                       e["rank"]))
    if first.get("user_error"):
        raise UserError(first["message"])
    if is_peer_loss(first["message"]) or first["type"] in NOT_A_CAUSE:
        # Only consequences were recorded: a rank vanished without a word (killed, its host lost), and
        # the engine's account names it; the others' connection errors would only mislead.
        line = first["message"].strip().splitlines()[0] if first["message"].strip() else first["type"]
        raise TrainingFailed(f"{fallback}\n(rank {first['rank']} then lost its peer: {line[:200]})")
    raise TrainingFailed(
        f"training failed on rank {first['rank']}: {first['type']}: {first['message']}\n"
        f"--- traceback of rank {first['rank']} ---\n{first['traceback'].rstrip()}"
    )


def tail_text(path: Path, lines: int = 20) -> str:
    if not path.is_file():
        return "(no log)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) or "(empty log)"


class LogTailer:
    """Copies new lines of logs/rank-*.log to the driver's stderr, each prefixed `[rankN] `."""

    def __init__(self, rd: RunDir, stream=None, interval: float = 0.5):
        self.rd = rd
        self.stream = stream or sys.stderr
        self.interval = interval
        self._offsets: dict[Path, int] = {}
        self._partial: dict[Path, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="torchloom-logs")

    def __enter__(self) -> LogTailer:
        # Only what this launch writes: start at the current end of existing logs.
        for p in self.rd.rank_logs():
            self._offsets[p] = p.stat().st_size
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.poll()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.poll()

    def poll(self) -> None:
        for p in self.rd.rank_logs():
            start = self._offsets.get(p, 0)
            try:
                with open(p, "rb") as f:
                    f.seek(start)
                    data = f.read()
            except OSError:
                continue
            if not data:
                continue
            self._offsets[p] = start + len(data)
            text = self._partial.pop(p, "") + data.decode("utf-8", errors="replace")
            lines = text.split("\n")
            if lines[-1]:
                self._partial[p] = lines[-1]
            prefix = f"[{p.stem.replace('-', '')}] "
            for line in lines[:-1]:
                self.stream.write(prefix + line + "\n")
            self.stream.flush()
