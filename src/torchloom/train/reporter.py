"""The one place engine- and tool-specific calls enter the loop: Ray's report, an Optuna pruner.

The loop calls, on every rank:
  report(eval_record, checkpoint_dir) at every evaluation, the same number of times on each rank;
    a true result asks training to stop (only rank 0's answer counts, and only when may_stop);
and on rank 0 only:
  log(record) for every line written to metrics.jsonl (train and eval records).
close() is called once when the rank's training ends, successfully or not.

Driver-side tools reach the workers through `hooks.json` in the run directory (see worker_reporter),
so they work the same whichever engine started the workers.
"""

from __future__ import annotations

import json
from pathlib import Path


class Reporter:
    may_stop = False  # True: report() may ask to stop, and every rank joins one collective per eval
    stop_reason = ""

    def report(self, metrics: dict, checkpoint_dir: str | None) -> bool | None:
        return None

    def log(self, record: dict) -> None:
        return None

    def close(self) -> None:
        return None


NullReporter = Reporter


class Reporters(Reporter):
    """Several reporters as one: each sees every call; any one of them may ask to stop."""

    def __init__(self, reporters: list[Reporter]):
        self.reporters = reporters
        self.may_stop = any(r.may_stop for r in reporters)
        self.stop_reason = ""

    def report(self, metrics: dict, checkpoint_dir: str | None) -> bool:
        stop = False
        for r in self.reporters:
            if r.report(metrics, checkpoint_dir) and r.may_stop:
                stop = True
                self.stop_reason = self.stop_reason or r.stop_reason
        return stop

    def log(self, record: dict) -> None:
        for r in self.reporters:
            r.log(record)

    def close(self) -> None:
        for r in self.reporters:
            r.close()


HOOKS_FILE = "hooks.json"


def read_hooks(run_dir: str | Path) -> dict:
    path = Path(run_dir) / HOOKS_FILE
    if not path.is_file():
        return {}
    return json.loads(path.read_text())


def worker_reporter(run_dir: str | Path, rank: int, engine_reporter: Reporter | None = None) -> Reporter:
    """The engine's reporter plus what the driver asked for in hooks.json (the same on every rank)."""
    hooks = read_hooks(run_dir)
    reporters = [engine_reporter] if engine_reporter is not None else []
    if "optuna" in hooks:
        from torchloom.tune.optuna_backend import PruningReporter

        reporters.append(PruningReporter(rank=rank, **hooks["optuna"]))
    if len(reporters) == 1:
        return reporters[0]
    return Reporters(reporters) if reporters else Reporter()
