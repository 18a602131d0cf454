"""Object storage: the client for a storage URI (s3://, gs://, abfs://, hdfs://, file+store://).

What lives on a store and when it moves is RunFiles' (runs/runfiles.py) for a run's files; this module is the client
below it, and the one the input readers (inputs/store_read.py) and the model fetch (model_cache.py: predict, serve) use
for URIs a user gave.

The client is pyarrow.fs, in every pyarrow wheel: no Hadoop jars, no extra package. Its S3, GCS and Azure clients
take credentials and endpoints from the places each cloud's own tools read (store/clients.py: AWS_* and
AWS_ENDPOINT_URL; Application Default Credentials and STORAGE_EMULATOR_HOST; AZURE_STORAGE_CONNECTION_STRING or
AZURE_STORAGE_ACCOUNT/KEY/SAS_TOKEN or DefaultAzureCredential); nothing of them is written anywhere by torchloom.
`s3a://` (Spark's name) is read as `s3://`, `gcs://` as `gs://`, `abfss://` and `az://` as `abfs://`.

A store that does not answer for a moment (a reset connection, a timeout, HTTP 5xx, SlowDown) is asked again
with backoff for a bounded window (retry_window), with one warning line per operation; an error that a retry
cannot mend (no bucket, access denied, unknown keys) is one line at once.

What readers may rely on: an object appears whole or not at all (a PUT and a multipart upload both
become visible only when complete; file+store:// writes beside and renames), and a directory uploaded with
`push_tree` has its `last` file (a checkpoint's meta.json, prepared data's manifest.json) written after every
other: a reader that waits for that file never takes a half-uploaded directory for a finished one.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Container
from pathlib import Path

from torchloom.errors import UserError
from torchloom.store import clients as store_clients
from torchloom.store.clients import LOCAL_STORE, SCHEMES
from torchloom.store.errors import CHECK_RETRY_S, NoBucket, attempts, reason, what_to_check
from torchloom.uri import URI, has_credentials, redact

CHUNK = 8 << 20  # bytes per read or write when streaming a file between the store and local disk
# Streams are opened with compression=None: objects hold the bytes of the files, as they are. pyarrow's default
# ("detect", by the name's extension) gzipped a .gz file a second time on its way up and unpacked it on the
# way down, so the store held what no other client reads and a staged .gz input was plain text.


def scheme(uri: str) -> str:
    m = URI.match(uri)
    if not m:
        raise UserError(f"{redact(uri)}: not a storage URI; use s3://bucket/prefix, gs://..., abfs://... or a local"
                        " path")
    name = m.group(1).lower()
    if name not in SCHEMES:
        raise UserError(f"{redact(uri)}: unknown storage scheme {name}://; use one of "
                        f"{', '.join(sorted(set(SCHEMES)))} or a local path")
    return SCHEMES[name]


def join(uri: str, *parts: str) -> str:
    return "/".join([uri.rstrip("/"), *(p.strip("/") for p in parts if p)])


@functools.lru_cache(maxsize=16)
def _filesystem(canonical_root: str, account: str | None = None, suffix: str | None = None):
    """The client of one store (store/clients.py: configured from the places each cloud's own tools read)."""
    from pyarrow import fs as pafs

    kind = canonical_root.split("://", 1)[0]
    if kind == LOCAL_STORE:
        return pafs.LocalFileSystem()
    if kind in ("s3", "gs", "abfs"):
        return {"s3": store_clients.s3, "gs": store_clients.gcs,
                "abfs": lambda: store_clients.azure(account, suffix)}[kind]()
    return pafs.FileSystem.from_uri(canonical_root)[0]


def resolve(uri: str):
    """(pyarrow filesystem, path inside it) for a store URI."""
    kind = scheme(uri)
    rest = URI.sub("", uri, count=1)
    if has_credentials(uri):  # it would travel into every record, manifest and line that names the place
        raise UserError(f"{redact(uri)}: credentials in a store URI are not used; give {what_to_check(uri)} in the"
                        " environment and drop the user:password@ part")
    if kind == LOCAL_STORE:
        if not rest.startswith("/"):
            raise UserError(f"{redact(uri)}: a {LOCAL_STORE}:// URI names an absolute directory; use"
                            f" {LOCAL_STORE}:///abs/path")
        return _filesystem(f"{LOCAL_STORE}://"), rest.rstrip("/") or "/"
    if kind == "abfs":
        where = store_clients.azure_path(redact(uri), rest)
        return _client(uri, kind, f"abfs://{where.account or ''}", where.account, where.suffix), where.path
    bucket = rest.split("/", 1)[0]
    if not bucket:
        raise UserError(f"{redact(uri)}: no bucket in the URI; use {kind}://BUCKET/prefix")
    return _client(uri, kind, f"{kind}://{bucket}"), rest.rstrip("/")


def _client(uri: str, kind: str, *key):
    try:
        return _filesystem(*key)
    except UserError as e:  # the environment names no account, or a connection string pyarrow cannot use
        raise UserError(f"{redact(uri)}: {e}") from None
    except Exception as e:  # e.g. no libhdfs for hdfs://, no Azure support in this pyarrow build
        raise UserError(f"{redact(uri)}: cannot open a {kind}:// client here ({reason(e, uri)});"
                        " install what pyarrow needs for it, or use a local path") from None


@contextlib.contextmanager
def _output(fs, path: str):
    """A stream that writes one object. An object store shows it once it is whole; a local directory used as a
    store (file+store://) is made to do the same: the parent directories made, the bytes written to a temporary
    name beside it and renamed when complete."""
    from pyarrow import fs as pafs

    if not isinstance(fs, pafs.LocalFileSystem):
        try:
            stream = fs.open_output_stream(path, compression=None)
        except FileNotFoundError as e:  # a store's 404 on a write (GCS's): the bucket is not there
            raise NoBucket(str(e)) from None
        with stream:
            yield stream
        return
    parent, _, name = path.rpartition("/")
    fs.create_dir(parent or "/", recursive=True)
    tmp = f"{parent}/.{name}.{os.getpid()}.{threading.get_ident()}.part"
    try:
        with fs.open_output_stream(tmp, compression=None) as stream:
            yield stream
        fs.move(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            fs.delete_file(tmp)


def check_writable(uri: str, key: str) -> None:
    """Before any work: the store answers, the bucket exists and these credentials may write and delete
    under `uri`. One line naming `key`, the URI and the fix otherwise."""
    fs, path = resolve(uri)
    probe = f"{path}/.torchloom-probe-{os.getpid()}"

    def write_and_delete() -> None:
        with _output(fs, probe) as f:
            f.write(b"torchloom")
        fs.delete_file(probe)

    def fail(e: BaseException, waited: float) -> UserError:
        return UserError(f"{key} {redact(uri)}: the store refused a test write ({reason(e, uri)}); check the bucket,"
                         f" {what_to_check(uri)}")

    attempts(uri, "write a test object", write_and_delete, window=CHECK_RETRY_S, fail=fail)


def check_readable(uri: str, key: str) -> None:
    """Before any work: `uri` exists on the store and these credentials may read it."""
    if set(uri) & set("*?[{"):
        raise UserError(f"{key} {redact(uri)}: a pattern is not looked up on an object store; give the object, or"
                        " the prefix (folder) whose objects to read")
    fs, path = resolve(uri)

    def fail(e: BaseException, waited: float) -> UserError:
        return UserError(f"{key} {redact(uri)}: cannot read it ({reason(e, uri)}); check the URI, {what_to_check(uri)}")

    info = attempts(uri, "look it up", lambda: fs.get_file_info(path), window=CHECK_RETRY_S, fail=fail)
    from pyarrow import fs as pafs

    if info.type == pafs.FileType.NotFound:
        raise UserError(f"{key} {redact(uri)}: no such object or prefix on the store; check the path")


# -- objects ----------------------------------------------------------------------------------------


def exists(uri: str) -> bool:
    from pyarrow import fs as pafs

    fs, path = resolve(uri)
    return attempts(uri, "look it up", lambda: fs.get_file_info(path).type != pafs.FileType.NotFound)


def _missing(e: OSError) -> bool:
    return isinstance(e, FileNotFoundError) or any(t in str(e) for t in ("NotFound", "NO_SUCH_KEY", "does not exist"))


def read_bytes(uri: str) -> bytes:
    fs, path = resolve(uri)

    def read() -> bytes:
        try:
            with fs.open_input_stream(path, compression=None) as f:
                return f.read()
        except OSError as e:
            if _missing(e):
                raise FileNotFoundError(redact(uri)) from None
            raise

    return attempts(uri, "read it", read)


def write_bytes(uri: str, data: bytes) -> None:
    """One object, whole: readers see the old one or the new, never a part."""
    fs, path = resolve(uri)

    def write() -> None:
        with _output(fs, path) as f:
            f.write(data)

    attempts(uri, "write it", write)


def list_files(uri: str) -> dict[str, int]:
    """{path relative to uri: size} of every object under the prefix ({} when there is none)."""
    return {rel: size for rel, (size, _) in list_objects(uri).items()}


def list_objects(uri: str) -> dict[str, tuple[int, int | None]]:
    """{path relative to uri: (size, modification time in ns)} of every object under the prefix. A key that would
    leave the prefix once joined to a local directory (`..`, an absolute part) is refused in one line."""
    from pyarrow import fs as pafs

    fs, path = resolve(uri)
    if isinstance(fs, pafs.LocalFileSystem) and fs.get_file_info(path).type != pafs.FileType.Directory:
        return {}  # a file, or nothing: as an object store lists no objects under an object's key
    infos = attempts(uri, "list it",
                      lambda: fs.get_file_info(pafs.FileSelector(path, recursive=True, allow_not_found=True)))
    out = {}
    for i in infos:
        if i.type != pafs.FileType.File:
            continue
        rel = i.path[len(path) + 1:]
        if rel.startswith("/") or ".." in rel.split("/"):
            raise UserError(f"{redact(uri)}: the store holds an object named {rel!r}, which would be written outside"
                            " this host's copy; remove or rename it on the store")
        out[rel] = (i.size, i.mtime_ns)
    return out


def delete_tree(uri: str) -> None:
    """Every object under the prefix (nothing there is fine)."""
    fs, path = resolve(uri)
    attempts(uri, "delete it", lambda: fs.delete_dir_contents(path, missing_dir_ok=True))
    from pyarrow import fs as pafs

    if "/" not in path.strip("/") and not isinstance(fs, pafs.LocalFileSystem):
        return  # the bucket (container) itself, which pyarrow's delete_dir would delete
    try:
        fs.delete_dir(path)  # a directory marker some stores keep
    except OSError:
        pass


def open_input(uri: str):
    """A random-access file on the store: reads are ranged GETs (Parquet reads only the footer and the
    row groups asked for)."""
    fs, path = resolve(uri)
    return attempts(uri, "open it", lambda: fs.open_input_file(path))


# -- files and directories between the store and local disk ---------------------------------------


def upload(local: str | Path, uri: str) -> None:
    """One file to one object; a retry sends the whole file again (the store never shows a part of it)."""
    fs, path = resolve(uri)

    def send() -> None:
        with open(local, "rb") as src, _output(fs, path) as dst:
            while chunk := src.read(CHUNK):
                dst.write(chunk)

    attempts(uri, "upload to it", send)


def download(uri: str, local: str | Path) -> Path:
    """Stream one object to a local file, written under a temporary name and renamed when complete."""
    fs, path = resolve(uri)
    local = Path(local)
    local.parent.mkdir(parents=True, exist_ok=True)
    tmp = local.with_name(f".{local.name}.{os.getpid()}.part")

    def fetch() -> None:  # from the first byte on each try
        try:
            with fs.open_input_stream(path, compression=None) as src, open(tmp, "wb") as dst:
                while chunk := src.read(CHUNK):
                    dst.write(chunk)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            if _missing(e):
                raise FileNotFoundError(redact(uri)) from None
            raise

    attempts(uri, "download it", fetch)
    os.replace(tmp, local)
    return local


def push_tree(local_dir: str | Path, uri: str, last: tuple[str, ...] = (), skip: Container[str] = ()) -> int:
    """Upload every file under local_dir to uri/<same relative path>, the names in `last` after all the
    others (the file whose presence says the directory is complete), none of the relative paths in `skip`.
    Returns the bytes uploaded."""
    local_dir = Path(local_dir)
    files = sorted(p for p in local_dir.rglob("*") if p.is_file() and not p.name.endswith((".tmp", ".part", ".lock"))
                   and p.relative_to(local_dir).as_posix() not in skip)
    files.sort(key=lambda p: p.name in last)  # stable: the `last` files go at the end
    total = 0
    for p in files:
        upload(p, join(uri, p.relative_to(local_dir).as_posix()))
        total += p.stat().st_size
    return total


def pull_tree(uri: str, local_dir: str | Path, only_if_changed: bool = True, by_time: bool = False,
              skip: Container[str] = ()) -> int:
    """Download every object under uri into local_dir (those whose local copy has the same size are kept
    when only_if_changed), none of the relative paths in `skip`. by_time: a copy made by this function is kept only
    while the object also has the modification time it had then (a same-size edit is downloaded again; a store
    that lists no time: always). Returns the number of files downloaded."""
    local_dir = Path(local_dir)
    n = 0
    for rel, (size, mtime) in list_objects(uri).items():
        if rel in skip:
            continue
        target = local_dir / rel
        if (only_if_changed and target.is_file() and target.stat().st_size == size
                and (not by_time or (mtime is not None and target.stat().st_mtime_ns == mtime))):
            continue
        download(join(uri, rel), target)
        if by_time and mtime is not None:
            os.utime(target, ns=(mtime, mtime))  # the object's time: what the next pull compares with
        n += 1
    return n


def delete(uri: str) -> None:
    """One object (none there is fine)."""
    fs, path = resolve(uri)

    def remove() -> None:
        try:
            fs.delete_file(path)
        except FileNotFoundError:
            pass

    attempts(uri, "delete it", remove)
