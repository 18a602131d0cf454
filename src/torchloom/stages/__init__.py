"""The stages as functions over a run directory, one module each:

    prepare.py   prepare_stage; prepare_with_baseline (the `prepare` command: the baseline in prepare's SparkSession)
    baseline.py  baseline_stage (the classical baseline, baseline.json), stored_baseline
    train.py     train_stage: the workers launched on the configured engine
    export.py    export_stage: the chosen checkpoint as a model (and export.combine's mix with the baseline)
    evaluate.py  evaluate_stage: the exported model scored, the report written
    run.py       run_all (the `run` command): all of them into one run directory, then a summary

Each stage takes the command's Run (runs/run.py: the config, the run's files, the tracker, a SparkSession), built once
by the CLI (preflight.open_run); a stage called from Python with a Config opens one (as_run). The checks before
a stage are preflight.py's, what a stage prints is console.py's. Here: what every stage shares.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

from torchloom import config as config_mod
from torchloom.config import Config
from torchloom.errors import UserError
from torchloom.preflight import check_foreign_config, open_run
from torchloom.runs.run import Run

T = TypeVar("T")


def as_run(given: Run | Config) -> Run:
    """The command's Run as it is; a Config (a stage called from Python, a trial) opened as one, checked."""
    return given if isinstance(given, Run) else open_run(given)


def recorded(stage: Callable[..., T]) -> Callable[..., T]:
    """A stage over a run (a Run, or a Config opened as one): what it writes there goes into the run's ledger
    (runs/ledger.py), whoever calls it (the command line, tune's trials, a notebook); a stage inside another stage's
    call records once, at the outermost."""

    @functools.wraps(stage)
    def call(given: Run | Config, *args, tracker=None, spark=None, **kwargs) -> T:
        run = as_run(given)  # tracker=, spark=: a Python caller's, for this call
        run = run.but(tracker=tracker or run.tracker, spark=spark or run.spark)
        with run.files.place.recording():
            return stage(run, *args, **kwargs)

    return call


def save_config(run: Run) -> None:
    """The run's config.toml (never over one torchloom did not write), here and on the run's store."""
    cfg, rd = run.cfg, run.rd
    check_foreign_config(run)
    try:
        rd.root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"output.dir {rd.where}: cannot be created ({e.strerror});"
                        " pass another --output.dir") from None
    config_mod.save(cfg, rd.config)
    run.files.push(rd.config)
