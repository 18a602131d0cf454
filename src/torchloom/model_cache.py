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

    def fill(tmp: Path) -> None:
        storage.pull_tree(uri, tmp, only_if_changed=False)
        (tmp / ".torchloom-digests").write_text(_digests(tmp, listing))

    def whole(target: Path) -> bool:
        stamp = target / ".torchloom-digests"
        return stamp.is_file() and stamp.read_text() == _digests(target, listing)

    return fill_once("models", key, whole, fill)


def fill_once(kind: str, key: str, whole, fill) -> Path:
    """The cache entry <cache>/<kind>/<key>: as it is where `whole(entry)` says so, else made anew by `fill(tmp)` in
    a temporary directory beside it and put in its place. One fill per host at a time (Spark's executors on one
    host ask together); the others wait, then find it whole. It deletes only in torchloom's private cache: its
    own temporary directory, and the entry it replaces (a hex key under <cache>/<kind>/), never anything else."""
    root = cache_root() / kind
    if not key or not all(ch in "0123456789abcdef" for ch in key):
        raise ValueError(f"a cache key is hex digits, not {key!r}")
    target = root / key
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if whole(target):
            return target
        tmp = root / f".{key}.{os.getpid()}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            fill(tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
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
