"""`torchloom tune`: a study of training trials over `tune.space`, with early stopping of bad trials.

The study directory (output.dir; rundir.StudyDir names its paths) holds:
  data/               the prepared data, once for all trials (each trial's data/ links to it)
  trials/<name>/      one ordinary run directory per trial: config, metrics.jsonl, checkpoints, logs
  results.csv/.png    one row per trial: parameters, metric, steps, stopped early or not; the plot
  best_config.toml    the best trial's config, ready for `torchloom run --config`
  model/, report.md   the best trial's model exported (ready for `torchloom serve`) and its test report
  study.json          what ran and which trial won
Running the same command again resumes an interrupted study (--overwrite starts afresh).

This module opens the study and runs it; trial.py runs one trial, results.py reports, and the
backends (ray_backend, optuna_backend) decide which trials run when.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import threading
import time
from pathlib import Path

from torchloom import config as config_mod
from torchloom import tracking
from torchloom.config import Config, to_dict
from torchloom.config.engines import engine_of
from torchloom.errors import UserError, install_hint, missing_extra
from torchloom.jsonio import read_json, write_json
from torchloom.runs.ledger import check_replaceable, is_content, replace_local
from torchloom.runs.run import Run
from torchloom.runs.rundir import StudyDir
from torchloom.runs.runfiles import RunFiles
from torchloom.runs.runrecord import STUDY_FORMAT
from torchloom.stages import recorded
from torchloom.stages.prepare import prepare_with_baseline
from torchloom.tune import space as space_mod
from torchloom.tune.common import mode_of, say, study_dir, study_name, with_output
from torchloom.uri import has_scheme


def choose_backend(cfg: Config) -> str:
    if cfg.tune.backend == "optuna" or cfg.tune.backend == "auto":
        try:
            import optuna  # noqa: F401
        except ImportError:
            if cfg.tune.backend == "optuna":
                raise missing_extra("optuna", "tune") from None
            optuna = None
    if cfg.tune.backend == "auto":
        try:
            import ray.tune  # noqa: F401

            return "ray"
        except ImportError:
            if optuna is None:
                raise UserError(f"torchloom tune needs Ray Tune or Optuna; {install_hint('ray')}, or for Optuna"
                                f" alone {install_hint('tune')}") from None
            return "optuna"
    if cfg.tune.backend == "ray":
        try:
            import optuna  # noqa: F401
            import ray.tune  # noqa: F401
        except ImportError:
            raise missing_extra("ray[tune] and optuna", "ray") from None
    if cfg.tune.backend == "optuna" and not engine_of(cfg.engine).optuna_trials:
        raise UserError("tune.backend optuna runs trials on engine.name local or spark; with Ray use"
                        " tune.backend ray")
    return cfg.tune.backend




PUSH_EVERY_S = 60.0  # a study on a store: how often its finished trials and its Optuna database go up meanwhile


def to_store(files: RunFiles, sd: StudyDir):
    """A study on a store: what it has finished goes up as it goes (every PUSH_EVERY_S: each finished trial once,
    the study's marker, a consistent copy of optuna.db), so a driver lost mid-study loses at most the trials then
    running; everything the study wrote here (its record, prepared data, optuna.db, the trials' run directories,
    results and the best model) goes up when it ends, whether it finished or not (RunFiles.pushing; a local
    study is its own copy: nothing moves)."""
    pushed: dict[str, int] = {}
    return files.pushing(lambda: float(os.environ.get("TORCHLOOM_STUDY_PUSH_S") or PUSH_EVERY_S),
                         lambda: push_finished(files, sd, pushed),
                         lambda: say(f"the study is on the store: {sd.where}"))


def push_finished(files: RunFiles, sd: StudyDir, pushed: dict[str, int]) -> None:
    """One round of the study's pushes as it goes: each trial that has ended since (its trial_result.json, by its
    modification time), the marker, and optuna.db through SQLite's own backup (never a half-written copy).
    Failures are warnings: the push at the end, and the next round, try again."""
    import sqlite3

    for result in sorted(sd.trials.glob("*/trial_result.json")) if sd.trials.is_dir() else []:
        stamp = result.stat().st_mtime_ns
        if pushed.get(result.parent.name) != stamp:
            files.push(result.parent, quiet=True)
            pushed[result.parent.name] = stamp
    files.push(sd.marker, quiet=True)
    if sd.optuna_db.is_file():
        copy = sd.root / f".optuna.db.{os.getpid()}.push.tmp"
        try:
            with (contextlib.closing(sqlite3.connect(sd.optuna_db)) as src,
                    contextlib.closing(sqlite3.connect(copy)) as dst):
                src.backup(dst)
            files.push_as(copy, sd.optuna_db)
        except Exception as e:  # noqa: BLE001 - the end's push tries again
            say(f"warning: could not push {sd.home(sd.optuna_db)} meanwhile ({e})")
        finally:
            copy.unlink(missing_ok=True)


def open_study_dir(cfg: Config, backend: str) -> tuple[StudyDir, bool]:
    """(study dir, resuming?) after checking what is there.

    Several `torchloom tune` processes may open one study at the same moment: the marker is created
    exclusively (the first one wins, the others join its study), and a directory counts as someone
    else's only if one listing of it shows files but neither the marker nor the prepared data.
    """
    sd = study_dir(cfg)
    marker = sd.marker
    if sd.root.exists() and cfg.output.overwrite:
        check_replaceable(sd.root, inputs=cfg.inputs())
        with open(sd.lock("running"), "a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise UserError(f"output.dir {sd.where}: another torchloom tune process is running this study;"
                                " wait for it to finish, or stop it, before --overwrite") from None
            replace_local(sd.root, inputs=cfg.inputs())
    resuming = True
    if not marker.is_file():
        names = ({p.name for p in sd.root.iterdir() if not p.name.startswith(".") and is_content(p.name)}
            if sd.root.exists() else set())
        if names and marker.name not in names and sd.data.name not in names:
            raise UserError(f"output.dir {sd.where}: exists and is not a tune study;"
                            " pass another --output.dir or --overwrite")
    sd.root.mkdir(parents=True, exist_ok=True)
    _hold(sd)
    if not marker.is_file():
        tmp = sd.root / f".{marker.name}.{os.getpid()}.{threading.get_ident()}.tmp"
        write_json(tmp, {"format": STUDY_FORMAT, "backend": backend, "study_name": study_name(cfg),
                         "created": time.time(), "metric": cfg.tune.metric, "mode": mode_of(cfg),
                         "space": cfg.tune.space})
        try:
            os.link(tmp, marker)  # fails if another process made the marker first
            resuming = False
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    old = read_json(marker)
    if old.get("backend") != backend:
        raise UserError(f"output.dir {sd.where}: holds a {old.get('backend')} study; use tune.backend"
                        f" {old.get('backend')} to resume it, or --overwrite to start afresh")
    check_same_study(sd, old, cfg)
    return sd, resuming


def check_same_study(sd: StudyDir, old: dict, cfg: Config) -> None:
    """A resumed study searches what it searched (its space, metric and direction): trials of two searches in one
    study would be compared as one. One line naming what differs; a study.json from before this was recorded
    says nothing of its space, and resumes."""
    now = {"space": cfg.tune.space, "metric": cfg.tune.metric, "mode": mode_of(cfg)}
    for key, value in now.items():
        if key in old and old[key] != value:
            raise UserError(f"output.dir {sd.where}: the study there was started with tune.{key} {old[key]!r}, not"
                            f" {value!r}; resume it with the same settings, pass another --output.dir, or --overwrite"
                            " to start afresh")


def prepare_key(cfg: Config) -> str:
    d = to_dict(cfg)
    key = {"data": d["data"], "prepare": {k: v for k, v in d["prepare"].items() if k not in ("spark_master",
                                                                                         "spark_conf")},
           "model": d["model"]["path"]}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def prepare_once(cfg: Config, sd: StudyDir, tracker) -> None:
    """Prepare the data for all trials; concurrent `torchloom tune` processes on one study wait for it."""
    import fcntl

    with open(sd.lock("prepare"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        key_file = sd.prepare_key
        if sd.manifest.is_file():
            if key_file.is_file() and key_file.read_text() != prepare_key(cfg):
                raise UserError(f"output.dir {sd.where}: the study's data was prepared with other data, prepare or"
                                " model settings; use another --output.dir or --overwrite")
            say(f"reusing the prepared data in {sd.data}")
            return
        study_cfg = config_mod.build(base=with_output(cfg, sd.root))
        prepare_with_baseline(study_cfg, tracker=tracker)
        key_file.write_text(prepare_key(cfg))


def absolute_paths(cfg: Config) -> Config:
    def absolute(path: str) -> str:
        if not path or has_scheme(path) or Path(path).is_absolute():
            return path
        return str(Path(path).resolve())

    return dataclasses.replace(
        cfg, data=dataclasses.replace(cfg.data, path=absolute(cfg.data.path)),
        model=dataclasses.replace(cfg.model, path=absolute(cfg.model.path)),
        output=dataclasses.replace(cfg.output, dir=str(study_dir(cfg).root)),
    )


_HELD: list = []  # the studies this process runs: a shared lock on each, held until it exits


def _hold(sd: StudyDir) -> None:
    """Hold the study's "running" lock (shared) from before its marker exists, so that another
    process's --overwrite refuses to delete it while this one runs it."""
    lock = open(sd.lock("running"), "a")  # noqa: SIM115 (held for the life of the process)
    fcntl.flock(lock, fcntl.LOCK_SH)
    _HELD.append(lock)


@recorded
def run(study: Run) -> dict:
    """Check the space, prepare once, run the trials on the chosen backend, then report and export. The study's
    trials are runs of their own in its directory (on a store: in this host's copy of it)."""
    cfg = study.cfg
    params = space_mod.parse(cfg)  # a bad space fails here, before anything starts
    backend = choose_backend(cfg)
    if backend == "optuna":
        from torchloom.tune.storage import check

        check(cfg.tune.storage)  # a shared database answers, before anything is prepared or run
    mode = mode_of(cfg)
    # a study on a store: its trials run in this host's copy, which first takes the store's study; --overwrite
    # replaces the store's own objects of it (RunFiles.adopt)
    study.files.adopt(cfg.output.overwrite, cfg.inputs())
    sd, resuming = open_study_dir(cfg, backend)
    say(f"{'resuming' if resuming else 'starting'} study {study_name(cfg)!r} in {sd.where}: {cfg.tune.trials} trials,"
        f" {backend} backend, {cfg.engine.workers} workers per trial on the "
        f"{'ray' if backend == 'ray' else cfg.engine.name} engine, {mode}imise validation {cfg.tune.metric}")
    started = time.perf_counter()
    cfg = absolute_paths(cfg)  # trials run in other processes, in other working directories
    with tracking.start(cfg, "tune", run_name=study_name(cfg)) as tracker, to_store(study.files, sd):
        if tracker.enabled:
            cfg = dataclasses.replace(cfg, tracking=dataclasses.replace(cfg.tracking, uri=tracker.uri))
        prepare_once(cfg, sd, tracker)
        if backend == "ray":
            from torchloom.tune import ray_backend

            ray_backend.run(cfg, sd, params, tracker.run_id)
        else:
            from torchloom.tune import optuna_backend

            optuna_backend.run(cfg, sd, params, tracker.run_id)
        from torchloom.tune.results import report

        return report(cfg, sd, params, tracker, backend, time.perf_counter() - started)
