"""The contract of one run directory: every path in it, and who writes it (files are written whole with
jsonio.write_atomic; URIs are uri.py's).

    runs/<name>/
      torchloom-run.json    prepare, fresh train     the run's identity and the names it owns (--overwrite)
      config.toml           driver, each stage       the resolved config, exactly what ran
      data/                 prepare                  manifest.json, train/ val/ test/ shards, rejected/
      checkpoints/step-N/   train workers            see train/checkpoint.py (meta.json is written last)
      metrics.jsonl         train rank 0             one line per log step and per evaluation
      train_result.json     driver                   rank 0's TrainResult plus the wall time
      model/                export                   the Hugging Face model directory
      report.md report.json misclassified.jsonl plots/     evaluate
      summary.json          run                      what `torchloom run` printed at the end
      baseline.json baseline/  baseline stage          the classical baseline's scores, and its arrays (lexical.py)
    and the driver <-> worker protocol (shared storage on a cluster; see engines/common.py):
      hooks.json            driver, before a launch  what workers must call out to (an Optuna pruner)
      progress.json         train rank 0             the live progress the driver draws
      logs/rank-R.log       engines                  a rank's stdout and stderr (Spark, Ray)
      logs/workers/         local engine             torch elastic's per-attempt logs
      logs/error-rankR.json a failed rank            its error and traceback; the driver raises the first
      logs/result-L.json    rank 0                   the TrainResult of launch L
      logs/rows-rankR.jsonl every rank (trace_rows)  the row ids rank R trained on at each step
      logs/placement-L-rankR-startN.json  every rank  host and pid of rank R's Nth start in launch L
                                                     (a second start is a restart; who was lost)
      ray/                  ray engine               Ray Train's own storage
      trial.json trial_result.json   tune                 a trial's parameters, and how it ended
      lease.json            driver (a run on a store)  which driver writes the run now, until when (runs/lease.py)

Nothing heavy is imported here: every layer may use it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from torchloom.jsonio import append_text, read_json, read_jsonl, write_atomic, write_json
from torchloom.uri import is_uri, redact

MANIFEST_FILE = "manifest.json"  # in a prepared data dir: what it holds (manifest.py)
CONFIG_FILE = "config.toml"  # in a run dir: the resolved config (config/load.save)
STUDY_FILE = "study.json"  # in a tune study: what ran and which trial won (tune/study.py, tune/results.py)
RUN_RECORD = "torchloom-run.json"  # at the top of every run and study directory (runrecord.write_record)
STEP_DIR = re.compile(r"^step-(\d+)$")  # a checkpoint's directory: step_name(N), the only spelling of the rule
LEASE_FILE = "lease.json"  # a run on a store: which driver writes it now (lease.py); --overwrite leaves it to its owner


def step_name(step: int) -> str:
    """The directory name of the checkpoint at `step` (STEP_DIR reads it back)."""
    return f"step-{step}"


class _In:
    """A path inside the run directory, named on the class: `metrics = _In("metrics.jsonl")` reads as
    `run.metrics`, the root joined with those parts."""

    def __init__(self, *parts: str):
        self.parts = parts

    def __get__(self, run: RunDir | None, owner: type | None = None) -> Any:
        return self if run is None else run.root.joinpath(*self.parts)


def cache_root() -> Path:
    """torchloom's private cache on this host: staging copies of runs on a store, downloaded models."""
    return Path(os.environ.get("TORCHLOOM_CACHE") or Path.home() / ".cache" / "torchloom")


def staging_dir(uri: str) -> Path:
    """This host's working copy of a run that lives on a store (the same URI, the same directory)."""
    digest = hashlib.sha256(redact(uri).rstrip("/").encode()).hexdigest()[:16]
    # resolved once: a home or cache behind a symbolic link (/gpfs, /lustre) is one path, whoever resolves it later
    return Path(os.path.realpath(cache_root() / "staging" / digest))


class RunDir:
    """Named paths of one run directory (it need not exist yet). Every path below is local; RunFiles
    (runs/runfiles.py) moves them to and from a store, and is the only reader of `remote`.

    The names for where a run lives, each with one meaning:
      root      this host's directory of the run: the run itself, or for a run on a store this host's working
                copy (a staging directory under the private cache, rundir.staging_dir)
      remote    the run's URI on a store (credentials and all), None for a local run: RunFiles' business only
      location  what names the run to another process or host: `remote`, else `root` (RunDir(location) again)
      where     the run as a user names it in a message: the URI without credentials, else `root`
      home(p)   the same for one of its paths: p's URI on the store, else p"""

    def __init__(self, root: str | os.PathLike):
        if isinstance(root, RunDir):
            root = root.location
        if is_uri(root):
            self.remote: str | None = str(root).rstrip("/")
            self.root = staging_dir(self.remote)
        else:
            self.remote = None
            self.root = Path(os.fspath(root).removeprefix("file://")).resolve()

    @property
    def location(self) -> str:
        """What names this run to another process or host: the URI on the store, or the local directory."""
        return self.remote or str(self.root)

    @property
    def where(self) -> str:
        """The run's home as a user names it: the URI (without credentials) or the local directory."""
        return redact(self.remote) if self.remote else str(self.root)

    def __repr__(self) -> str:
        return f"RunDir({self.where!r})"

    def home(self, path: str | Path) -> str:
        """Where a file of the run lives, as a user names it: its URI on the store, or its local path."""
        if not self.remote:
            return str(path)
        return f"{redact(self.remote)}/{Path(path).resolve().relative_to(self.root).as_posix()}"

    def __fspath__(self) -> str:
        return str(self.root)

    # -- what the stages write ------------------------------------------------------------------
    record = _In(RUN_RECORD)
    lease = _In(LEASE_FILE)  # a run on a store: the driver that writes it now (runs/lease.py)
    config = _In(CONFIG_FILE)
    data = _In("data")
    manifest = _In("data", MANIFEST_FILE)
    checkpoints = _In("checkpoints")

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / step_name(step)

    metrics = _In("metrics.jsonl")
    train_result = _In("train_result.json")
    model = _In("model")
    report_md = _In("report.md")
    report_json = _In("report.json")
    misclassified = _In("misclassified.jsonl")
    plots = _In("plots")
    summary = _In("summary.json")
    baseline = _In("baseline.json")  # the classical baseline's scores on the prepared splits (baseline/__init__.py)
    baseline_model = _In("baseline")  # its fitted arrays (lexical.py), where the driver fitted it

    # -- the driver <-> worker protocol ---------------------------------------------------------
    hooks = _In("hooks.json")
    progress = _In("progress.json")
    logs = _In("logs")
    worker_logs = _In("logs", "workers")  # torch elastic's per-attempt logs (local engine)
    ray_storage = _In("ray")  # Ray Train's own storage
    staged_inputs = _In("input")  # a run on a store: prepare's local copies of inputs given on a store

    def row_trace(self, rank: int) -> Path:
        return self.logs / f"rows-rank{rank}.jsonl"

    def rank_log(self, rank: int) -> Path:
        return self.logs / f"rank-{rank}.log"

    def rank_logs(self) -> list[Path]:
        return sorted(self.logs.glob("rank-*.log")) if self.logs.is_dir() else []

    def error_file(self, rank: int) -> Path:
        return self.logs / f"error-rank{rank}.json"

    def error_files(self) -> list[Path]:
        return sorted(self.logs.glob("error-rank*.json")) if self.logs.is_dir() else []

    def result_file(self, launch_id: str) -> Path:
        return self.logs / f"result-{launch_id}.json"

    def notice_file(self, launch_id: str, attempt: int) -> Path:
        """A notice of preemption the driver got for an attempt's workers (Spark's executor decommission)."""
        return self.logs / f"notice-{launch_id}-attempt{attempt}.json"

    def placement_file(self, launch_id: str, rank: int, start: int) -> Path:
        return self.logs / f"placement-{launch_id}-rank{rank}-start{start}.json"

    def placements(self, launch_id: str, start: int | str = "*", rank: int | str = "*") -> list[Path]:
        """Placement files of this launch; `start` or `rank` narrow them down."""
        pattern = f"placement-{launch_id}-rank{rank}-start{start}.json"
        return sorted(self.logs.glob(pattern)) if self.logs.is_dir() else []

    def fault_marker(self, rank: int, step: int) -> Path:
        return self.logs / f"fault-fired-rank{rank}-step{step}"

    # -- a tune trial's run dir --------------------------------------------------------------
    trial_info = _In("trial.json")  # the trial's parameters and MLflow run
    trial_result = _In("trial_result.json")  # how the trial ended

    # -- operations on the protocol files -------------------------------------------------------
    def write_hooks(self, hooks: dict) -> None:
        """What the workers of the next launch must call out to; {} removes it."""
        if hooks:
            write_json(self.hooks, hooks, indent=None)
        else:
            self.hooks.unlink(missing_ok=True)

    def read_hooks(self) -> dict:
        return read_json(self.hooks) if self.hooks.is_file() else {}

    def clear_errors(self) -> None:
        for p in self.error_files():
            p.unlink(missing_ok=True)

    def reset_metrics(self, resume_step: int | None, keep_driver: bool = False) -> None:
        """A fresh run (resume_step None) starts a fresh metrics.jsonl; a resumed one keeps the lines up to
        its checkpoint, since the interrupted run's later lines are about to be logged again. keep_driver:
        rank 0's fresh start keeps the driver's start-up record of this launch, written just before it."""
        path = self.metrics
        if not path.exists():
            return
        records = []
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                record = json.loads(line) if line.strip() else None
            except ValueError:  # cut short (a full disk, a killed writer): the rest of the history is kept
                print(f"torchloom: warning: {path}: skipped a line that is not whole JSON ({line[:60]!r})",
                      file=sys.stderr, flush=True)
                continue
            if isinstance(record, dict):
                records.append((line, record))
        if resume_step is None:
            kept = [line for line, r in records if keep_driver and r.get("side") == "driver"]
        else:
            kept = [line for line, r in records if (r.get("step") or 0) <= resume_step]
        if not kept:
            path.unlink()
            return
        write_atomic(path, "".join(line + "\n" for line in kept))

    def append_metrics(self, record: dict) -> None:
        """One line at the end of metrics.jsonl (the driver's; rank 0 appends its own while training)."""
        self.root.mkdir(parents=True, exist_ok=True)
        append_text(self.metrics, json.dumps(record) + "\n")

    def metric_records(self, kind: str | None = None) -> list[dict]:
        """The lines of metrics.jsonl (of one kind: train or eval)."""
        return [r for r in read_jsonl(self.metrics) if kind is None or r.get("kind") == kind]


class StudyDir(RunDir):
    """A `torchloom tune` study: the prepared data once, and one ordinary run directory per trial."""

    marker = _In(STUDY_FILE)
    trials = _In("trials")

    def trial(self, name: str) -> RunDir:
        return RunDir(self.trials / name)

    results_csv = _In("results.csv")
    results_png = _In("results.png")
    best_config = _In("best_config.toml")
    prepare_key = _In("data", "prepare_key.txt")
    optuna_db = _In("optuna.db")
    ray_tune = _In("ray", "tune")

    def lock(self, name: str) -> Path:
        """A lock file that processes sharing the study take turns on (prepare, report, storage)."""
        return self.root / f".{name}.lock"


def top_names() -> tuple[str, ...]:
    """Every name at the top of a run or study directory, as the classes above spell them (runrecord.RUN_ENTRIES)."""
    names: dict[str, None] = {}
    for cls in (RunDir, StudyDir):
        for value in vars(cls).values():
            if isinstance(value, _In):
                names[value.parts[0]] = None
    return tuple(names)
