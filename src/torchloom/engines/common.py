"""What every engine shares: the worker wrapper that records failures, and reading them back."""

from __future__ import annotations

import json
import os
import time
import traceback
from pathlib import Path

from torchloom.errors import UserError


class TrainingFailed(Exception):
    """A worker failed; the message carries that rank's traceback."""

    exit_code = 1


def error_file(run_dir: str | Path, rank: int) -> Path:
    return Path(run_dir) / "logs" / f"error-rank{rank}.json"


def clear_errors(run_dir: str | Path) -> None:
    logs = Path(run_dir) / "logs"
    if logs.is_dir():
        for p in logs.glob("error-rank*.json"):
            p.unlink()


def run_worker(cfg_dict: dict, run_dir: str, reporter=None) -> dict:
    """Run training on this rank; on failure write the error where the driver will look, re-raise."""
    from torchloom.train.entry import run

    try:
        return run(cfg_dict, run_dir, reporter)
    except BaseException as e:
        rank = int(os.environ.get("RANK", "0"))
        path = error_file(run_dir, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({
            "rank": rank,
            "time": time.time(),
            "type": type(e).__name__,
            "user_error": isinstance(e, UserError),
            "message": str(e),
            "traceback": traceback.format_exc(),
        }))
        raise


def raise_worker_failure(run_dir: str | Path, fallback: str) -> None:
    """Turn the first recorded worker error into the error the user sees."""
    logs = Path(run_dir) / "logs"
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
    first = min(errors, key=lambda e: (e.get("time", 0.0), e["rank"]))
    if first.get("user_error"):
        raise UserError(first["message"])
    raise TrainingFailed(
        f"training failed on rank {first['rank']}: {first['type']}: {first['message']}\n"
        f"--- traceback of rank {first['rank']} ---\n{first['traceback'].rstrip()}"
    )
