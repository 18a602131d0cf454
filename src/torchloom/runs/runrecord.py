"""What a run owns, and how torchloom knows a directory is its own: the run's record (`torchloom-run.json`,
its identity), and the content markers of runs made before records (what --overwrite deletes is the run's ledger's:
runs/ledger.py). The same rules for a local directory and a prefix on a store (RunFiles reads the store's side).

Nothing heavy is imported here: every layer may use it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torchloom.jsonio import write_json
from torchloom.runs.rundir import CONFIG_FILE, MANIFEST_FILE, RUN_RECORD, STUDY_FILE, top_names

# The keys manifest.py's Manifest writes (its fields but `root`; tests/test_overwrite.py holds them equal).
MANIFEST_KEYS = frozenset({"counts", "fingerprint", "format_version", "inputs", "labels", "splits", "tags", "task",
                           "timings", "tokenizer"})
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


# -- the run's record: who it is, and what it owns --------------------------------------------------
RUN_FORMAT = "torchloom-run/1"
# The names a run's record lists (for versions that read them; what --overwrite deletes is the ledger's: ledger.py).
RUN_ENTRIES = top_names()
# torchloom's own temporary names: `.NAME.<pid>...tmp|part|pending|pull`, a study's `.NAME.lock`, the store's
# write probe, prepare's `data.tmp-XXXXXXXX` and `data.old-XXXXXXXX` beside the data it replaces.
TEMP_NAME = re.compile(r"^\..+\.(tmp|part|pending|pull|lock)$|^\.torchloom-probe-\d+$|^[\w.-]+\.(tmp|old)-[0-9a-f]{8}$")


def new_record() -> dict:
    """A run's identity, made anew by every prepare, --overwrite and fresh train: a host's copy of a run on a
    store counts only while its record equals the store's (RunFiles.sync_copy)."""
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


def holds_cwd(path: str | Path) -> bool:
    """Is `path` the working directory or one of its parents (deleting it would delete where we stand)?"""
    resolved, cwd = Path(path).resolve(), Path.cwd().resolve()
    return resolved == cwd or resolved in cwd.parents


def write_record(root: str | Path) -> Path:
    """A new identity for the run at `root` (a local directory or a store's working copy), written atomically."""
    Path(root).mkdir(parents=True, exist_ok=True)
    return write_json(Path(root) / RUN_RECORD, new_record())
