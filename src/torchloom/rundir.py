"""The contract of one run directory: every path in it, who writes it, and one `write_atomic`.

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
      lease.json            driver (a run on a store)  which driver writes the run now, until when (lease.py)

Nothing heavy is imported here: every layer may use it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

MANIFEST_FILE = "manifest.json"  # in a prepared data dir: what it holds (manifest.py)
# The keys manifest.py's Manifest writes (its fields but `root`; tests/test_overwrite.py holds them equal).
MANIFEST_KEYS = frozenset({"counts", "fingerprint", "format_version", "inputs", "labels", "splits", "timings",
                           "tokenizer"})
CONFIG_FILE = "config.toml"  # in a run dir: the resolved config (config/load.save)
STUDY_FILE = "study.json"  # in a tune study: what ran and which trial won (tune/study.py, tune/results.py)
# What may make a directory torchloom's own, so that --overwrite may replace it: a run's config, prepared data's
# manifest, a study's marker. A name alone proves nothing (a Hugo site has a config.toml, a web app a
# manifest.json, a Lightning project checkpoints/): each counts only when its content is torchloom's (is_own_file).
OWN_MARKERS = (CONFIG_FILE, f"data/{MANIFEST_FILE}", MANIFEST_FILE, STUDY_FILE)
STUDY_FORMAT = "torchloom-study/1"  # study.json's "format"
# The sections of every config.toml torchloom has written (later versions add more, never fewer).
CONFIG_SECTIONS = ("data", "prepare", "model", "train", "eval", "engine", "output")
# study.json before it carried "format": what open_study_dir wrote, and what the report added.
LEGACY_STUDY_KEYS = {"backend", "study_name", "created", "metric", "mode"}
LEGACY_STUDY_REPORT_KEYS = {"trials", "stopped_early", "seconds", "results_csv", "best_trial", "best_value",
                            "best_params", "best_config", "model_dir", "test"}


def _is_own_config(text: str) -> bool:
    """A config.toml that torchloom's own loader reads back: only torchloom's sections, each a table, the
    sections every saved config has, and nothing the loader refuses (an unknown key, a bad value)."""
    import tomllib

    from torchloom.config import from_dict
    from torchloom.errors import UserError

    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        return False
    if not all(isinstance(v, dict) for v in data.values()) or not all(s in data for s in CONFIG_SECTIONS):
        return False
    try:
        from_dict(data)
    except (UserError, TypeError, ValueError):
        return False
    return True


def _is_own_manifest(data: Any) -> bool:
    """A manifest.json as manifest.py writes it: every required key, no key of anyone else's."""
    known = MANIFEST_KEYS
    required = {"labels", "splits", "tokenizer", "fingerprint", "format_version"}
    if not isinstance(data, dict) or not required <= data.keys() <= known:
        return False
    splits = data["splits"]
    return (isinstance(data["format_version"], int) and isinstance(data["labels"], list)
            and isinstance(data["tokenizer"], dict) and isinstance(data["fingerprint"], str)
            and isinstance(splits, dict)
            and all(isinstance(s, dict) and {"rows", "shards"} <= s.keys() for s in splits.values()))


def _is_own_study(data: Any) -> bool:
    """A study.json with torchloom's format marker, or an older one with exactly torchloom's keys."""
    if not isinstance(data, dict):
        return False
    if data.get("format") == STUDY_FORMAT:
        return True
    return (LEGACY_STUDY_KEYS <= data.keys() <= LEGACY_STUDY_KEYS | LEGACY_STUDY_REPORT_KEYS
            and data["backend"] in ("optuna", "ray") and data["mode"] in ("min", "max"))


def is_own_file(rel: str, content: bytes) -> bool:
    """Did torchloom write this marker file (`rel`, one of OWN_MARKERS), judged by its content?"""
    name = rel.rsplit("/", 1)[-1]
    try:
        text = content.decode("utf-8")
        if name == CONFIG_FILE:
            return _is_own_config(text)
        data = json.loads(text)
    except ValueError:  # not UTF-8, not JSON
        return False
    if name == MANIFEST_FILE:
        return _is_own_manifest(data)
    return name == STUDY_FILE and _is_own_study(data)


def is_own(read: Callable[[str], bytes | None]) -> bool:
    """Is a directory torchloom's own (a run, prepared data, a study)? `read(rel)` gives the content of a file
    in it, or None when there is none: the same decision for a local directory and a prefix on a store."""
    for rel in OWN_MARKERS:
        content = read(rel)
        if content is not None and is_own_file(rel, content):
            return True
    return False


def _read_local(path: Path) -> bytes | None:
    try:
        return path.read_bytes() if path.is_file() else None
    except OSError:
        return None


# -- the run's record: who it is, and what it owns --------------------------------------------------
RUN_RECORD = "torchloom-run.json"  # at the top of every run and study directory (write_record)
RUN_FORMAT = "torchloom-run/1"
# What torchloom writes at the top of a run or study directory, and in prepared data: --overwrite deletes these
# names and nothing else. The record lists the run's (a later version may own more; the record says which).
RUN_ENTRIES = (RUN_RECORD, CONFIG_FILE, "data", "checkpoints", "metrics.jsonl", "train_result.json", "model",
               "report.md", "report.json", "misclassified.jsonl", "plots", "summary.json", "baseline.json", "baseline",
               "hooks.json", "progress.json", "logs", "ray", "input", "trial.json", "trial_result.json", STUDY_FILE,
               "trials", "results.csv", "results.png", "best_config.toml", "optuna.db", "lease.json")
LEASE_FILE = "lease.json"  # a run on a store: which driver writes it now (lease.py); --overwrite leaves it to its owner
DATA_ENTRIES = (MANIFEST_FILE, "train", "val", "test", "rejected", "prepare_key.txt")
# torchloom's own temporary names: `.NAME.<pid>...tmp|part|pending|pull`, a study's `.NAME.lock`, the store's
# write probe, prepare's `data.tmp-XXXXXXXX` and `data.old-XXXXXXXX` beside the data it replaces.
TEMP_NAME = re.compile(r"^\..+\.(tmp|part|pending|pull|lock)$|^\.torchloom-probe-\d+$|^[\w.-]+\.(tmp|old)-[0-9a-f]{8}$")


def new_record() -> dict:
    """A run's identity, made anew by every prepare, --overwrite and fresh train: a host's copy of a run on a
    store counts only while its record equals the store's (storage.sync_copy)."""
    import time
    import uuid

    return {"format": RUN_FORMAT, "id": uuid.uuid4().hex, "created": round(time.time(), 3),
            "owns": list(RUN_ENTRIES)}


def parse_record(content: bytes | None) -> dict | None:
    """A run record as write_record wrote it, or None (missing, damaged, someone else's)."""
    try:
        data = json.loads(content) if content is not None else None
    except ValueError:
        return None
    if not isinstance(data, dict) or data.get("format") != RUN_FORMAT or not isinstance(data.get("id"), str):
        return None
    owns = data.get("owns")
    return data if isinstance(owns, list) and all(isinstance(n, str) and "/" not in n for n in owns) else None


def owned_entries(names: list[str], read: Callable[[str], bytes | None], where: str,
                  key: str = "output.dir") -> list[str]:
    """The top-level `names` of a directory (or a prefix on a store) that --overwrite may delete: every one, or a
    one-line refusal. A directory is torchloom's by its record (the names it lists), or, made before records, by a
    marker of torchloom's content (is_own: then the names of RUN_ENTRIES and DATA_ENTRIES); anything else in it
    (a thesis beside a `torchloom config` output, a bucket's other prefixes) refuses the whole replacement."""
    from torchloom.errors import UserError

    if not names:
        return []
    record = parse_record(read(RUN_RECORD))
    if record is not None:
        owns = {RUN_RECORD, *record["owns"]}
    elif is_own(read):
        owns = {*RUN_ENTRIES, *DATA_ENTRIES}
    else:
        raise UserError(f"{key} {where}: not replaced: it is neither empty nor a torchloom run, prepared data or"
                        " study (no config.toml, manifest.json or study.json that torchloom wrote); pass another"
                        " --output.dir")
    foreign = sorted(n for n in names if n not in owns and not TEMP_NAME.match(n))
    if foreign:
        more = f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
        raise UserError(f"{key} {where}: not replaced: it holds {', '.join(foreign[:3])}{more}, which torchloom did"
                        " not write; --overwrite deletes only a run's own files: move those away, or pass another"
                        " --output.dir")
    return sorted(names)


def holds_cwd(path: str | Path) -> bool:
    """Is `path` the working directory or one of its parents (deleting it would delete where we stand)?"""
    resolved, cwd = Path(path).resolve(), Path.cwd().resolve()
    return resolved == cwd or resolved in cwd.parents


def check_replaceable(path: str | Path, key: str = "output.dir") -> list[str]:
    """The entries of `path` that --overwrite deletes (owned_entries), or a one-line refusal: never the working
    directory or one holding it, a home directory or a file system's root."""
    from torchloom.errors import UserError

    path = Path(path)
    if not path.exists():
        return []
    if not path.is_dir():
        raise UserError(f"{key} {path}: exists and is not a directory; --overwrite replaces only torchloom runs")
    resolved = path.resolve()
    if holds_cwd(path) or resolved == Path.home().resolve() or resolved.parent == resolved:
        raise UserError(f"{key} {path}: is the working directory, a home directory or a root, or holds the working"
                        " directory; --overwrite would delete it; pass another --output.dir")
    return owned_entries(sorted(p.name for p in path.iterdir()), lambda rel: _read_local(path / rel), str(path), key)


def replace_local(path: str | Path, key: str = "output.dir") -> None:
    """--overwrite of a local directory: delete what check_replaceable allows, nothing else; the directory stays."""
    import shutil

    path = Path(path)
    for name in check_replaceable(path, key):
        entry = path / name
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink(missing_ok=True)


def write_record(root: str | Path) -> Path:
    """A new identity for the run at `root` (a local directory or a store's working copy), written atomically."""
    Path(root).mkdir(parents=True, exist_ok=True)
    return write_json(Path(root) / RUN_RECORD, new_record())


def write_atomic(path: str | Path, data: str | bytes) -> Path:
    """Write to a temporary name beside `path`, then rename: readers see the old file or the new, never half."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        if isinstance(data, bytes):
            tmp.write_bytes(data)
        else:
            tmp.write_text(data, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_json(path: str | Path, data: Any, indent: int | None = 2) -> Path:
    return write_atomic(path, json.dumps(data, indent=indent, default=str))


def read_json(path: str | Path) -> Any:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The JSON objects of a JSON-lines file; [] when it is missing. Unparsable lines (a line still being
    written by a live run) are skipped."""
    p = Path(path)
    if not p.is_file():
        return []
    rows = []
    for line in p.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


class _In:
    """A path inside the run directory, named on the class: `metrics = _In("metrics.jsonl")` reads as
    `run.metrics`, the root joined with those parts."""

    def __init__(self, *parts: str):
        self.parts = parts

    def __get__(self, run: RunDir | None, owner: type | None = None) -> Any:
        return self if run is None else run.root.joinpath(*self.parts)


URI = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")  # a storage URI's scheme


def is_uri(path: str | os.PathLike | None) -> bool:
    """A storage URI (s3://bucket/prefix, gs://, abfs://, hdfs://), not a local path (file:// is local)."""
    m = URI.match(str(path or ""))
    return bool(m) and m.group(1).lower() != "file"


def redact(uri: str) -> str:
    """A URI fit for a log line: no user:password@ part, no query string (presigned URLs carry keys)."""
    return re.sub(r"^([A-Za-z][A-Za-z0-9+.-]*://)[^/@]*@", r"\1", str(uri)).split("?", 1)[0]


def cache_root() -> Path:
    """torchloom's private cache on this host: staging copies of runs on a store, downloaded models."""
    return Path(os.environ.get("TORCHLOOM_CACHE") or Path.home() / ".cache" / "torchloom")


def staging_dir(uri: str) -> Path:
    """This host's working copy of a run that lives on a store (the same URI, the same directory)."""
    digest = hashlib.sha256(redact(uri).rstrip("/").encode()).hexdigest()[:16]
    return cache_root() / "staging" / digest


class RunDir:
    """Named paths of one run directory (it need not exist yet).

    A run on object storage (`root` a URI such as s3://bucket/runs/x) has its home on the store
    (`remote`) and this host's working copy at `root`, a staging directory; storage.py moves files
    between them. Every path below is local either way."""

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
    config = _In(CONFIG_FILE)
    data = _In("data")
    manifest = _In("data", MANIFEST_FILE)
    checkpoints = _In("checkpoints")

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / f"step-{step}"

    metrics = _In("metrics.jsonl")
    train_result = _In("train_result.json")
    model = _In("model")
    report_md = _In("report.md")
    report_json = _In("report.json")
    misclassified = _In("misclassified.jsonl")
    plots = _In("plots")
    summary = _In("summary.json")
    baseline = _In("baseline.json")  # the classical baseline's scores on the prepared splits (etl/baseline.py)
    baseline_model = _In("baseline")  # its fitted arrays (lexical.py), where the driver fitted it

    # -- the driver <-> worker protocol ---------------------------------------------------------
    hooks = _In("hooks.json")
    progress = _In("progress.json")
    logs = _In("logs")
    worker_logs = _In("logs", "workers")  # torch elastic's per-attempt logs (local engine)
    ray_storage = _In("ray")  # Ray Train's own storage

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
        with open(self.metrics, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

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

