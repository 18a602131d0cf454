"""A model on a store (s3://.../model, a run's exported model) as a local directory: `torchloom predict` and
`serve` (and Spark batch scoring's executors) load what they fetch here. Downloaded once per host into a private
cache, keyed by what the store lists and checked by the files' hashes."""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import sys
from pathlib import Path

from torchloom.errors import UserError
from torchloom.jsonio import sha256_file
from torchloom.runs.rundir import cache_root
from torchloom.store import storage
from torchloom.uri import redact


def fetch_model(uri: str, what: str) -> Path:
    """An exported model on a store, or a run on a store given for its model (its exported model/, said in one
    line), as a local directory (fetch_dir)."""
    exported = storage.join(uri, "model")
    if not storage.exists(storage.join(uri, "config.json")) and storage.exists(storage.join(exported, "config.json")):
        print(f"torchloom: {what} {redact(uri)}: a run on the store; using its exported model,"
              f" {redact(exported)}", file=sys.stderr, flush=True)
        uri = exported
    return fetch_dir(uri, what)


def fetch_dir(uri: str, what: str) -> Path:
    """A directory on the store (an exported model) as a local directory, downloaded once into a private
    cache keyed by the objects as the store lists them (names, sizes and modification times: a re-export
    of the same sizes is another key) plus the sha256 of each file once downloaded; a copy whose hashes no
    longer match is downloaded again."""
    objects = storage.list_objects(uri)
    if not objects:
        raise UserError(f"{what} {redact(uri)}: nothing on the store there; check the URI (an exported model"
                        " directory, e.g. s3://bucket/run/model)")
    listing = {rel: size for rel, (size, _) in objects.items()}
    key = hashlib.sha256(repr(sorted(objects.items())).encode() + redact(uri).encode()).hexdigest()[:20]
    target = cache_root() / "models" / key
    stamp = target / ".torchloom-digests"
    target.parent.mkdir(parents=True, exist_ok=True)
    # One fetch per host at a time (Spark's executors on one host ask together); the others wait, then
    # find the copy whole.
    with open(target.with_name(f".{key}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if stamp.is_file() and stamp.read_text() == _digests(target, listing):
            return target
        tmp = target.with_name(f".{key}.{os.getpid()}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        storage.pull_tree(uri, tmp, only_if_changed=False)
        (tmp / ".torchloom-digests").write_text(_digests(tmp, listing))
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
    return target


def _digests(directory: Path, listing: dict[str, int]) -> str:
    lines = []
    for rel in sorted(listing):
        p = directory / rel
        if not p.is_file() or p.stat().st_size != listing[rel]:
            return "missing"
        lines.append(f"{rel} {listing[rel]} {sha256_file(p)}")
    return "\n".join(lines)
