"""A stage run on its own follows what the run recorded: `train`, `export` and `evaluate` start from the run's
own config.toml (what its prepare or training wrote) for the keys that describe the model it trained, instead of
the defaults, so `torchloom export --output.dir RUN` after `torchloom train --model.path /models/mine` exports
that model.

- model.path: taken from the run unless given; given and different, `export`, `evaluate` and `train --resume`
  refuse in one line naming both (the checkpoints hold the recorded model's weights); a fresh `train` takes it
  only when its tokenizer is the one the data was tokenized with (the manifest's hash), and says so.
- `run --resume` follows the run as `train --resume` does (checked on the driver, before config.toml is written).
- train.*: `train --resume` goes on with the recorded training settings (epochs, batch size, learning rate and
  schedule, strategy, precision...), each one a flag names is applied and said in one line.
Keys a user gives win where that is safe; nothing else of the record is taken (data.*, engine.* and output.*
describe where and how to run, not what was trained).
"""

from __future__ import annotations

import sys
import tomllib
from dataclasses import fields, replace
from pathlib import Path

from torchloom.config import Config, from_dict
from torchloom.errors import UserError
from torchloom.runs.rundir import CONFIG_FILE
from torchloom.runs.runfiles import RunFiles
from torchloom.runs.runrecord import is_own_file

STAGES = ("train", "export", "evaluate", "run")  # `run` only with --resume: a fresh one prepares and trains anew


def say(msg: str) -> None:
    print(f"torchloom: {msg}", file=sys.stderr, flush=True)


def given_keys(config_file: str | None, overrides: list[str]) -> set[str]:
    """section.key of every value the user gave: in the --config file, or as --section.key flags."""
    keys = {arg[2:].split("=", 1)[0] for arg in overrides if arg.startswith("--") and "." in arg.split("=", 1)[0]}
    if config_file and Path(config_file).is_file():
        try:
            data = tomllib.loads(Path(config_file).read_text(encoding="utf-8"))
        except (OSError, tomllib.TOMLDecodeError):
            data = {}
        keys |= {f"{section}.{key}" for section, table in data.items() if isinstance(table, dict) for key in table}
    return keys


def recorded_config(files: RunFiles) -> Config | None:
    """The config.toml the run holds (on its store for a run on one), when torchloom wrote it."""
    content = files.read(files.rd.config)
    if content is None or not is_own_file(CONFIG_FILE, content):
        return None
    return from_dict(tomllib.loads(content.decode("utf-8")))


def follow(cfg: Config, command: str, given: set[str], files: RunFiles) -> Config:
    """`cfg` with what the run (`files`: cfg's run) recorded where the user gave nothing, and the one-line refusals
    where a given value contradicts the model the run trained."""
    if command not in STAGES:
        return cfg
    if command == "run" and not cfg.train.resume:
        return cfg
    recorded = recorded_config(files)
    if recorded is None:
        return cfg
    cfg = _model(cfg, recorded, command, given, files)
    if command in ("train", "run") and cfg.train.resume:
        cfg = _training(cfg, recorded, given)
    return cfg


def _model(cfg: Config, recorded: Config, command: str, given: set[str], files: RunFiles) -> Config:
    rd = files.rd
    mine, theirs = cfg.model.path, recorded.model.path
    if "model.path" not in given or mine == theirs:
        if mine != theirs:
            say(f"{command}: model.path {theirs or 'the embedded all-MiniLM-L6-v2'}, as the run in {rd.where}"
                " recorded")
        return replace(cfg, model=replace(cfg.model, path=theirs))
    shown = theirs or '"" (the embedded all-MiniLM-L6-v2)'
    if command not in ("train", "run") or cfg.train.resume:
        raise UserError(f"model.path {mine}: the run in {rd.where} trained from model.path {shown}, whose weights"
                        f" its checkpoints hold; leave --model.path out (or pass {shown}), or train afresh into"
                        " another --output.dir")
    _check_tokenizer(cfg, files)
    say(f"train: model.path {mine} instead of the recorded {shown}: a fresh training, its tokenizer the one the"
        " data was prepared with")
    return cfg


def _check_tokenizer(cfg: Config, files: RunFiles) -> None:
    """A fresh train on another model: only where the prepared token ids mean the same words to it."""
    from torchloom import manifest as manifest_mod
    from torchloom.embedded import model_path
    from torchloom.etl.tokenize import read_tokenizer_json, tokenizer_hash

    rd = files.rd
    files.ensure(rd.manifest)
    m = manifest_mod.read(rd.data)
    want = m.tokenizer.get("hash")
    try:
        have = tokenizer_hash(read_tokenizer_json(model_path(cfg.model.path)))
    except (OSError, UserError):
        return  # the model dir's own check says what is wrong with it, in the stage
    if want and have != want:
        raise UserError(f"model.path {cfg.model.path}: its tokenizer is not the one the data in {rd.home(rd.data)}"
                        " was prepared with; prepare again with this model (torchloom prepare --model.path ..."
                        " --overwrite), or train into another --output.dir")


def _training(cfg: Config, recorded: Config, given: set[str]) -> Config:
    """train --resume: the recorded training settings, but for the ones the user gave (said, one line each)."""
    values = {}
    for f in fields(recorded.train):
        key = f"train.{f.name}"
        if f.name in ("resume", "preemption_url", "preemption_grace_s"):
            continue
        old, new = getattr(recorded.train, f.name), getattr(cfg.train, f.name)
        if key in given:
            if old != new:
                say(f"train --resume: {key} {new} instead of the recorded {old}")
            continue
        values[f.name] = old
    return replace(cfg, train=replace(cfg.train, **values))
