"""The stages as functions over a run directory, one module each:

    prepare.py   prepare_stage; prepare_with_baseline (the `prepare` command: the baseline in prepare's SparkSession)
    baseline.py  baseline_stage (the classical baseline, baseline.json), stored_baseline
    train.py     train_stage: the workers launched on the configured engine
    export.py    export_stage: the chosen checkpoint as a model (and export.combine's mix with the baseline)
    evaluate.py  evaluate_stage: the exported model scored, the report written
    run.py       run_all (the `run` command): all of them into one run directory, then a summary

The checks before a stage are preflight.py's, what a stage prints is console.py's. Here: what every stage shares.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

from torchloom import config as config_mod
from torchloom.config import Config
from torchloom.errors import UserError
from torchloom.preflight import check_foreign_config
from torchloom.rundir import RunDir
from torchloom.runfiles import RunFiles

T = TypeVar("T")


def run_dir(cfg: Config) -> RunDir:
    return RunDir(cfg.output.dir)


def recorded(stage: Callable[..., T]) -> Callable[..., T]:
    """A stage over cfg's run: what it writes there goes into the run's ledger (ledger.py), whoever calls it (the
    command line, tune's trials, a notebook); a stage inside another stage's call records once, at the outermost."""

    @functools.wraps(stage)
    def call(cfg: Config, *args, **kwargs) -> T:
        with RunFiles(run_dir(cfg)).recording():
            return stage(cfg, *args, **kwargs)

    return call


def save_config(cfg: Config, rd: RunDir) -> None:
    check_foreign_config(rd)
    try:
        rd.root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"output.dir {rd.where}: cannot be created ({e.strerror}); pass another --output.dir") \
            from None
    config_mod.save(cfg, rd.config)
    RunFiles(rd).push(rd.config)
