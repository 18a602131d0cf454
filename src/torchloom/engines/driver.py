"""The driver side of the driver <-> worker protocol (engines/common.py lists the files): one launch of
the workers, its attempts, and the reading of how they ended.

`attempts` is the skeleton every engine that the driver launches runs (local, Spark, Ray): each engine
gives it only how to start one attempt's workers.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TextIO

from torchloom.config import Config
from torchloom.engines.common import (
    NOT_A_CAUSE,
    Preempted,
    TrainingFailed,
    describe_loss,
    failure_cause,
    is_peer_loss,
)
from torchloom.engines.progress import LogTailer, ProgressMonitor
from torchloom.errors import UserError, message_line
from torchloom.jsonio import read_json
from torchloom.runs.rundir import RunDir
from torchloom.runs.runfiles import RunFiles
from torchloom.train.result import TrainResult


@dataclass(frozen=True)
class Attempt:
    """One attempt of a launch: what an engine's launch function passes to its workers."""

    launch_id: str  # the same for every attempt: a re-run worker finds its earlier starts by it
    number: int  # 0 for the first attempt
    launched_at: float  # the launch's start (time.time()): workers time their first step from it


class LauncherStopped(Exception):
    """An engine's launch function saw its launcher told to stop (SIGTERM to `torchloom train`); the workers
    had the notice too and, given the grace period, stopped after the same step with a checkpoint."""


class AttemptFailed(Exception):
    """An engine's own account of a failed attempt, where its exception's text says too little or too much.

    how: one line for the re-run notice; fallback: the job's error when no rank recorded one."""

    def __init__(self, how: str, fallback: str):
        super().__init__(how)
        self.how, self.fallback = how, fallback


def new_launch_id() -> str:
    return uuid.uuid4().hex[:12]


@contextlib.contextmanager
def driver_stream(quiet: bool) -> Iterator[TextIO]:
    """Where the driver's live view goes: this terminal's stderr, or nowhere when quiet."""
    if not quiet:
        yield sys.stderr
        return
    with open(os.devnull, "w") as stream:
        yield stream


def attempts(files: RunFiles, cfg: Config, launch_once: Callable[[Attempt], None], engine_label: str,
             quiet: bool = False, tail_logs: bool = True,
             failures: tuple[type[BaseException], ...] = (Exception,),
             resize: Callable[[], int] | None = None) -> TrainResult:
    """Launch the workers, up to engine.max_restarts + 1 attempts; returns rank 0's result.

    launch_once starts one attempt's workers and returns when they are done, or raises one of `failures`.
    torchloom restarts, not the engine (which would restart on any failure): only after a lost process
    (killed, or gone without a word), never after an error of a rank's own, which would recur.
    engine_label: the engine as the job's error names it ("Spark (local[2])").
    tail_logs: copy the ranks' logs/rank-*.log to the terminal (workers that run with capture=True).
    resize: after a preemption, how many workers the next attempt gets (an engine that sizes to what the
    cluster holds now: Ray with engine.min_workers); None: engine.workers.
    """
    # Errors stay across the attempts of a launch: the first one is the cause, and a restarted rank
    # tells a peer that failed from one that vanished.
    rd = files.rd
    rd.clear_errors()
    launch_id = new_launch_id()
    launched_at = time.time()
    count = cfg.engine.max_restarts + 1
    failed, number, preemptions = 0, 0, []  # failed attempts (the budget), all attempts, notices met
    with driver_stream(quiet) as stream:
        while True:
            files.pull(rd.logs, quiet=True)  # a run on a store: what the workers of other hosts recorded so far
            stopped = False
            try:
                tailer = LogTailer(files, stream=stream) if tail_logs else contextlib.nullcontext()
                with ProgressMonitor(files, stream=stream), tailer:
                    launch_once(Attempt(launch_id, number, launched_at))
            except LauncherStopped:
                stopped = True
            except failures as e:  # the engine wraps the workers' failure; our error files hold the real one
                files.pull(rd.logs, quiet=True)
                rerun_or_raise(files, launch_id, failed, count, e, engine_label, start=number)
                failed, number = failed + 1, number + 1
                continue
            files.pull(rd.logs, rd.metrics, rd.progress, quiet=True)
            result = read_result(rd, launch_id, stopped)
            own, preemptions = result.preemptions, preemptions + result.preemptions
            result.preemptions = preemptions
            if not own:
                return result
            # notices that keep coming with no step done between them (a host whose notice URL stays up): stop
            stalled = len(preemptions) > 1 and preemptions[-1]["step"] == preemptions[-2]["step"]
            go_on_or_stop(rd, launch_id, preemptions[-1], stopped or stalled,
                          lambda: resize() if resize else cfg.engine.workers)
            number += 1


def go_on_or_stop(rd: RunDir, launch_id: str, preemption: dict, stopped: bool, workers: Callable[[], int]) -> None:
    """After an attempt that ended preempted: say so in one line; go on with the workers this engine can
    start now (the attempt does not count against engine.max_restarts), or, when the launcher itself was
    told to stop, raise Preempted."""
    step, resume_at = preemption["step"], preemption["resumed_from_step"]
    written = (f"checkpoint written in {preemption['checkpoint_s']:.1f} s" if preemption["checkpoint_s"] >= 0 else
               f"no checkpoint fitted in train.preemption_grace_s, so step {resume_at} is where it goes on")
    line = f"preempted at step {step} (notice: {preemption['notice']}), {written}"
    if stopped:
        raise Preempted(f"train: {line}; run the same command with --resume to go on from step {resume_at}")
    rd.result_file(launch_id).unlink(missing_ok=True)  # the next attempt writes its own
    preemption["workers"] = workers()
    print(f"torchloom: train: {line}; resuming on {preemption['workers']} workers", file=sys.stderr, flush=True)


def read_result(rd: RunDir, launch_id: str, stopped: bool = False) -> TrainResult:
    """Rank 0's result of this launch; without one, the first worker error (or a pointer to the logs).
    stopped: the launcher was told to stop, and the workers had no time to end with a result."""
    path = rd.result_file(launch_id)
    if not path.is_file() and stopped:
        raise Preempted(f"train: stopped by a signal before the workers could write a checkpoint; run the same"
                        f" command with --resume to go on from the newest checkpoint in {rd.home(rd.checkpoints)}")
    if not path.is_file():
        raise_worker_failure(rd, f"training ended without a result from rank 0; see the logs in {rd.logs}")
    return TrainResult.from_dict(read_json(path))


def worker_user_error(text: str) -> str | None:
    """The one-line message of a worker's UserError in an engine's error text (Spark, Ray and torchrun
    put the worker's traceback in theirs), for when the worker could not write its error file."""
    found = re.findall(r"(?:UserError|RunDirNotVisible): (.+)", text)
    return found[-1].strip() if found else None


# The engine's own word on a lost worker, where the ranks' heartbeats cannot name it yet (Spark saw the executor
# lost and aborted the barrier stage before the survivor's collective timed out).
ENGINE_LOSS = re.compile(r"ExecutorLostFailure \((executor \S+)[^)]*\) Reason: ([^\n]+)")


def engine_account(text: str) -> str:
    """A lost worker as the engine's error names it, in one line ("" when it names none)."""
    found = ENGINE_LOSS.findall(text)
    if not found:
        return ""
    executor, reason = found[-1]
    return f"Spark lost {executor}: {reason.strip().rstrip('.')}"


def rerun_or_raise(files: RunFiles, launch_id: str, attempt: int, attempts: int, error: Exception,
                   engine_label: str, start: int | None = None) -> None:
    """After `attempt` (0-based) of `attempts` failed with `error`: when a lost process caused it and an
    attempt is left, say so and return (the caller re-runs the workers, which resume from the latest
    checkpoint); else raise the job's error. A rank's own error (a user error too) would come back the same."""
    text = str(error)
    rd = files.rd
    loss = describe_loss(files, launch_id, attempt if start is None else start)  # start: counting preempted ones
    if attempt + 1 < attempts and not worker_user_error(text) and failure_cause(rd, launch_id) is None:
        how = error.how if isinstance(error, AttemptFailed) else engine_account(text) or type(error).__name__
        print(f"torchloom: train: attempt {attempt + 1} of {attempts} failed ({loss or how});"
              " re-running the workers from the latest checkpoint", file=sys.stderr, flush=True)
        return
    if isinstance(error, AttemptFailed):
        raise_worker_failure(rd, error.fallback)
    first = message_line(text) or repr(error)
    raise_worker_failure(rd, f"training on {engine_label} failed: {loss or engine_account(text) or first}", text)


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
        line = message_line(first["message"]) or first["type"]
        raise TrainingFailed(f"{fallback}\n(rank {first['rank']} then lost its peer: {line[:200]})")
    raise TrainingFailed(
        f"training failed on rank {first['rank']}: {first['type']}: {first['message']}\n"
        f"--- traceback of rank {first['rank']} ---\n{first['traceback'].rstrip()}"
    )
