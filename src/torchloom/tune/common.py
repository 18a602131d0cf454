"""What every part of a study shares: its name, the optimisation direction, messages, trial configs."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from torchloom.config import Config
from torchloom.runs.rundir import StudyDir


def say(msg: str) -> None:
    print(f"torchloom: tune: {msg}", file=sys.stderr, flush=True)


def mode_of(cfg: Config) -> str:
    if cfg.tune.mode != "auto":
        return cfg.tune.mode
    return "min" if cfg.tune.metric == "loss" else "max"


def study_name(cfg: Config) -> str:
    return cfg.tune.study_name or Path(cfg.output.dir).resolve().name


def with_output(cfg: Config, out: Path, **train_changes) -> Config:
    new = dataclasses.replace(cfg, output=dataclasses.replace(cfg.output, dir=str(out), overwrite=False))
    if train_changes:
        new = dataclasses.replace(new, train=dataclasses.replace(new.train, **train_changes))
    return new


def study_dir(cfg: Config) -> StudyDir:
    return StudyDir(cfg.output.dir)
