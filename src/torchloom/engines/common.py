"""What every engine shares: the worker wrapper, and what the driver reads back from the run dir.

Whatever started them, workers talk to the driver only through files in the run directory (shared
storage on a cluster), so the three engines behave the same:
  logs/error-rank{R}.json    a failed rank's error and traceback (the driver raises the first)
  logs/result-{launch}.json  rank 0's result of one launch
  logs/rank-{R}.log          a rank's stdout and stderr, when the engine does not collect them itself
  logs/launch-{launch}-rank{R}  "this rank has started in this launch": a second start is a restart
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
import uuid
from pathlib import Path

from torchloom.errors import UserError


class TrainingFailed(Exception):
    """A worker failed; the message carries that rank's traceback."""

    exit_code = 1


class RestartLimit(RuntimeError):
    """A worker refused to start again: the job already used its restarts."""


def replace_engine(cfg, **changes):
    """A copy of cfg with engine fields changed (the caller's config stays as the user gave it)."""
    import dataclasses

    return dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, **changes))


def new_launch_id() -> str:
    return uuid.uuid4().hex[:12]


def logs_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "logs"


def error_file(run_dir: str | Path, rank: int) -> Path:
    return logs_dir(run_dir) / f"error-rank{rank}.json"


def result_file(run_dir: str | Path, launch_id: str) -> Path:
    return logs_dir(run_dir) / f"result-{launch_id}.json"


def clear_errors(run_dir: str | Path) -> None:
    logs = logs_dir(run_dir)
    if logs.is_dir():
        for p in logs.glob("error-rank*.json"):
            p.unlink()


def env_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def capture_output(run_dir: str | Path, rank: int) -> None:
    """Send this process's stdout and stderr (Python's and native code's) to logs/rank-{rank}.log."""
    path = logs_dir(run_dir) / f"rank-{rank}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)


def run_worker(cfg_dict: dict, run_dir: str, launch_id: str, reporter=None, capture: bool = False) -> dict:
    """Train on this rank; record a failure where the driver looks for it, and re-raise it."""
    from torchloom.train.entry import run

    rank = env_rank()
    if capture:
        capture_output(run_dir, rank)
    try:
        marker = logs_dir(run_dir) / f"launch-{launch_id}-rank{rank}"
        marker.parent.mkdir(parents=True, exist_ok=True)
        starts = int(marker.read_text() or 0) if marker.exists() else 0
        marker.write_text(str(starts + 1))
        if starts:
            # The engine (torch elastic, Ray, Spark's own stage retry or torchloom's) restarted this
            # worker after a failure. Whoever restarts, engine.max_restarts bounds how often.
            limit = cfg_dict["engine"]["max_restarts"]
            if starts > limit:
                raise RestartLimit(f"rank {rank} was restarted {starts} times; engine.max_restarts is {limit}")
            if not cfg_dict["train"]["resume"]:
                cfg_dict = {**cfg_dict, "train": {**cfg_dict["train"], "resume": "latest"}}
            print(f"restart {starts}: resuming from the latest checkpoint in {run_dir}/checkpoints", flush=True)
        result = run(cfg_dict, run_dir, reporter, on_error=lambda e: record_error(run_dir, rank, e))
        if rank == 0:
            tmp = result_file(run_dir, launch_id).with_suffix(".tmp")
            tmp.write_text(json.dumps(result))
            os.replace(tmp, result_file(run_dir, launch_id))
        return result
    except BaseException as e:
        record_error(run_dir, rank, e)
        raise
    finally:
        if capture:
            sys.stdout.flush()
            sys.stderr.flush()


def record_error(run_dir: str | Path, rank: int, e: BaseException) -> None:
    """Write this rank's error for the driver; the first one stays (a restarted attempt may fail too)."""
    path = error_file(run_dir, rank)
    if path.exists():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({
        "rank": rank,
        "time": getattr(e, "torchloom_time", time.time()),
        "type": type(e).__name__,
        "user_error": isinstance(e, UserError),
        "message": str(e),
        "traceback": "".join(traceback.format_exception(e)),
    }))
    os.replace(tmp, path)


def read_result(run_dir: str | Path, launch_id: str) -> dict:
    """Rank 0's result of this launch; without one, the first worker error (or a pointer to the logs)."""
    path = result_file(run_dir, launch_id)
    if not path.is_file():
        raise_worker_failure(run_dir, f"training ended without a result from rank 0; see the logs in"
                                      f" {logs_dir(run_dir)}")
    return json.loads(path.read_text())


PEER_LOSS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "gloo/transport",
             "NCCL communicator was aborted", "Socket Timeout")


def is_peer_loss(message: str) -> bool:
    """A collective that failed because another rank went away: a consequence, not a cause."""
    return any(p in message for p in PEER_LOSS)


def raise_worker_failure(run_dir: str | Path, fallback: str) -> None:
    """Turn the first recorded worker error into the error the user sees."""
    logs = logs_dir(run_dir)
    errors = []
    for p in sorted(logs.glob("error-rank*.json")) if logs.is_dir() else []:
        try:
            errors.append(json.loads(p.read_text()))
        except (OSError, json.JSONDecodeError):
            continue
    if not errors:
        raise TrainingFailed(fallback)
    # The root cause is the first error: the other ranks typically fail after it, in a collective
    # whose peer went away.
    first = min(errors, key=lambda e: (e["type"] == "RestartLimit", is_peer_loss(e["message"]), e.get("time", 0.0),
                                       e["rank"]))
    if first.get("user_error"):
        raise UserError(first["message"])
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

    def __init__(self, run_dir: str | Path, stream=None, interval: float = 0.5):
        self.dir = logs_dir(run_dir)
        self.stream = stream or sys.stderr
        self.interval = interval
        self._offsets: dict[Path, int] = {}
        self._partial: dict[Path, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="torchloom-logs")

    def __enter__(self) -> LogTailer:
        # Only what this launch writes: start at the current end of existing logs.
        for p in self.dir.glob("rank-*.log"):
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
        for p in sorted(self.dir.glob("rank-*.log")):
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
