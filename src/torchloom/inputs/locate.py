"""Where an input is and what it is, before anything reads it: its format (from its name, a directory's files, or
a table's log), whether it exists and can be reached, which of its files are UTF-8, a table's version pinned, a
store's input staged for a local reader. inputs/read.py reads it."""

from __future__ import annotations

import functools
import glob
import os
from collections import Counter
from pathlib import Path
from urllib.parse import urlparse

from torchloom.config.schema import DataConfig
from torchloom.errors import UserError
from torchloom.text.formats import (
    COMPRESSED_SUFFIXES,
    DELTA_LOG,
    FORMATS,
    SUFFIX_FORMATS,
    TABLE_FORMATS,
    is_iceberg,
    spreadsheet_hint,
)

_GLOB_CHARS = set("*?[{")
# Local inputs up to this size are checked for UTF-8 on the driver before Spark reads them (~1 GB/s).
UTF8_CHECK_BUDGET = 8 << 30


def is_local(path: str) -> bool:
    scheme = urlparse(path).scheme
    return scheme in ("", "file") or (len(scheme) == 1 and os.name == "nt")


def _local(path: str) -> str:
    return urlparse(path).path if path.startswith("file:") else path


def _ext(name: str) -> str:
    for suffix in COMPRESSED_SUFFIXES:
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    return os.path.splitext(name)[1].lower()


def _dir_format(root: str) -> str | None:
    """folder when root's subdirectories hold .txt files, else the most common known extension inside."""
    seen: Counter[str] = Counter()
    has_txt_subdir = False
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith((".", "_"))]
        files = [f for f in filenames if not f.startswith((".", "_"))]
        if dirpath != root and any(f.endswith(".txt") for f in files):
            has_txt_subdir = True
        seen.update(SUFFIX_FORMATS[_ext(f)] for f in files if _ext(f) in SUFFIX_FORMATS)
    if has_txt_subdir:
        return "folder"
    return seen.most_common(1)[0][0] if seen else None


def resolve_format(cfg: DataConfig, path: str) -> str:
    """The input format: cfg.format, or for auto decided by the extension or a directory's contents."""
    if is_iceberg(path) or cfg.format == "iceberg":
        if not (is_iceberg(path) and cfg.format in ("auto", "iceberg")):
            raise UserError(f"data.path {path}: data.format iceberg reads an Iceberg table named"
                            " iceberg://CATALOG/NAMESPACE.TABLE, and such a name is read as one; set both so")
        return "iceberg"
    if cfg.format != "auto":
        return cfg.format
    fix = f"set --data.format to one of {', '.join(FORMATS)}"
    local = is_local(path) and not set(path) & _GLOB_CHARS
    if local and os.path.isdir(os.path.join(_local(path), DELTA_LOG)):
        return "delta"  # its Parquet files are of every version; the log says which are live
    if local and os.path.isdir(_local(path)):
        fmt = _dir_format(_local(path))
        if fmt is None:
            raise UserError(f"data.path {path}: cannot tell the format from the files in this directory; {fix}")
        return fmt
    fmt = SUFFIX_FORMATS.get(_ext(path.rstrip("/")))
    if fmt is None and not is_local(path) and not set(path) & _GLOB_CHARS:
        fmt = _store_format(path)
    if fmt is None and spreadsheet_hint(path):
        raise UserError(f"data.path {path}: {spreadsheet_hint(path)}")
    if fmt is None and _ext(path) == ".txt":
        fix = ("a text file holds no labels: give a CSV or JSON lines file with a text and a label column, or a folder"
               " with one directory of .txt files per label (root/<label>/*.txt)")
    if fmt is None:
        raise UserError(f"data.path {path}: cannot tell the format from the name; {fix}")
    return fmt


def _store_format(path: str) -> str | None:
    """The format of a prefix on an object store, from its listing as _dir_format decides it for a directory
    (None when it is not a URI pyarrow opens, or nothing there tells)."""
    if not pyarrow_opens(path):
        return None
    from torchloom.inputs.store_read import hidden
    from torchloom.store import storage

    seen: Counter[str] = Counter()
    txt_in_subdir = False
    for rel in storage.list_files(path):
        if rel.startswith(DELTA_LOG + "/"):
            return "delta"
        if hidden(rel):
            continue
        parts = rel.split("/")
        txt_in_subdir |= len(parts) > 1 and parts[-1].endswith(".txt")
        if _ext(parts[-1]) in SUFFIX_FORMATS:
            seen[SUFFIX_FORMATS[_ext(parts[-1])]] += 1
    if txt_in_subdir:
        return "folder"
    return seen.most_common(1)[0][0] if seen else None


def check_exists(path: str, key: str = "data.path") -> None:
    """Fail early, with the fix, when a local path or glob matches nothing (Spark's own error is long).

    `key` is the config key the path came from, so the line names the option the user set."""
    if not is_local(path):
        return
    local = _local(path)
    if set(local) & _GLOB_CHARS:
        matches = glob.glob(local, recursive=True)
    else:
        matches = [local] if os.path.exists(local) else []
    if not matches:
        raise UserError(f"{key} {path}: no such file or directory (nothing matched); check the path")
    if all(os.path.isdir(m) and not any(os.scandir(m)) for m in matches):
        raise UserError(f"{key} {path}: the directory is empty; point --{key} at your data files")


def check_inputs(data: DataConfig, data_path: str) -> None:
    """check_exists for the input (data_path: data.path, or the embedded corpus's) and data.val_path/test_path."""
    for key, path in (("data.path", data_path), ("data.val_path", data.val_path), ("data.test_path", data.test_path)):
        if path:
            check_exists(path, key)


def is_table(cfg: DataConfig, path: str) -> bool:
    """A Delta or Iceberg table (data.format, an iceberg:// name, or a _delta_log/ there)."""
    return is_iceberg(path) or resolve_format(cfg, path) in TABLE_FORMATS


def pin_tables(cfg: DataConfig, data_path: str, fmt: str | None = None, local_only: bool = False) -> dict:
    """{path: inputs.tables.Table} of the inputs (data_path: data.path or the embedded corpus's; val_path, test_path)
    that are tables, each pinned at its version (tables.pin_inputs); local_only: no store listed."""
    from torchloom.inputs import tables

    inputs = {key: (path, fmt if key == "data.path" and fmt else resolve_format(cfg, path))
              for key, path in (("data.path", data_path), ("data.val_path", cfg.val_path),
                                ("data.test_path", cfg.test_path))
              if path and (not local_only or is_local(path) or is_iceberg(path))}
    return tables.pin_inputs(cfg, inputs)


def utf8_files(path: str) -> frozenset[str]:
    """The local files under `path` (a file, directory or glob) whose bytes are valid UTF-8.

    Spark's text readers put U+FFFD where they meet bytes that are not UTF-8, so cleaning takes a
    U+FFFD in a text for a decoding error; a file known to be valid UTF-8 holds only U+FFFD characters
    someone wrote, and its rows are not set aside for them. Remote, compressed or (together) larger
    than UTF8_CHECK_BUDGET inputs are not checked: there the U+FFFD rule stands.
    """
    if not is_local(path):
        return frozenset()
    files = [f for f in local_files(path) if not f.endswith(COMPRESSED_SUFFIXES)]
    stats = [os.stat(f) for f in files]
    if sum(st.st_size for st in stats) > UTF8_CHECK_BUDGET:
        return frozenset()
    return _valid_utf8(tuple((f, st.st_size, st.st_mtime_ns) for f, st in zip(files, stats)))


@functools.lru_cache(maxsize=8)
def _valid_utf8(files: tuple[tuple[str, int, int], ...]) -> frozenset[str]:
    """Of (file, size, mtime) entries, the files that are valid UTF-8: remembered, as prepare asks twice for
    a CSV or JSON lines input (which files Spark's UTF-8 reader reads, and which rows to trust)."""
    import codecs

    valid = set()
    for f, _, _ in files:
        decoder = codecs.getincrementaldecoder("utf-8")()
        try:
            with open(f, "rb") as stream:
                while chunk := stream.read(1 << 23):
                    decoder.decode(chunk)
                decoder.decode(b"", final=True)
        except (UnicodeDecodeError, OSError):
            continue
        valid.add(f)
    return frozenset(valid)


def local_files(path: str) -> list[str]:
    """The files, absolute, of a local file, directory (walked; hidden and _-prefixed names skipped, as Spark
    skips them) or glob."""
    local = _local(path)
    roots = glob.glob(local, recursive=True) if set(local) & _GLOB_CHARS else [local]
    files = []
    for root in roots:
        if os.path.isfile(root):
            files.append(root)
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if not d.startswith((".", "_"))]
            files += [os.path.join(dirpath, f) for f in filenames if not f.startswith((".", "_"))]
    return sorted(os.path.abspath(f) for f in files)


def pyarrow_opens(path: str) -> bool:
    """A store URI whose scheme store/storage.py knows (s3://, s3a://, gs://, abfs://, hdfs://, ...)."""
    from torchloom.store import storage

    try:
        storage.scheme(path)
        return True
    except UserError:
        return False


def check_reachable(uri: str, key: str) -> None:
    """Before any stage: the data at `uri` is on the store and these credentials may read it (one line otherwise).
    An Iceberg table's catalog is asked when prepare pins its version."""
    from torchloom.store import storage

    if is_iceberg(uri):
        return
    storage.check_readable(uri, key)


def stage_input(path: str, into: Path, key: str) -> str:
    """A data path on a store, for the embedded local Spark (which has no Hadoop S3 connector): the object,
    or every object under the prefix, streamed to local disk under `into`; returns the local path to read.
    The same listing gives the same copy, so a re-run downloads only what changed (by size and modification
    time: an object edited in place at the same size is downloaded again)."""
    from torchloom.store import storage

    storage.check_readable(path, key)
    listing = storage.list_files(path)
    name = path.rstrip("/").rsplit("/", 1)[-1] or "input"
    target = into / name
    if listing:  # a prefix: a folder of files
        storage.pull_tree(path, target, by_time=True)
    else:
        storage.download(path, target)
    return str(target)
