"""Versioned tables as prepare's input: Delta Lake (deltalake, i.e. delta-rs) and Apache Iceberg (pyiceberg); no JVM.

Pinned on the driver before Spark starts (`pin`): the version data.version names (a Delta version, an Iceberg
snapshot id, or the version current at an ISO timestamp), else the version current then, so that commits made
while prepare runs are not read. A pinned version is a plan: the data files live at that version, with what
deletes rows from them (Delta's deletion vectors, Iceberg's delete files); the Spark tasks read their share of
it (inputs/table_tasks.py) and the rows take the path of every other input from read._select on (clean, dedup,
split, tokenize). A Delta file is cut into byte ranges as Spark cuts a Parquet file (a row group belongs to the
range its first byte is in), so a table of a few big files still spreads over every core.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import zlib
from dataclasses import dataclass, field
from functools import partial
from typing import Any
from urllib.parse import unquote, urlparse

from torchloom.config.schema import DataConfig
from torchloom.errors import UserError, first_line, install_hint
from torchloom.store import clients
from torchloom.text.formats import DELTA_LOG, ICEBERG_SCHEME, column_fix
from torchloom.uri import has_scheme, redact

SPLIT_BYTES = 128 << 20  # Spark's spark.sql.files.maxPartitionBytes
OPEN_COST = 4 << 20  # Spark's spark.sql.files.openCostInBytes: the smallest range worth a task of its own


@dataclass
class Table:
    """One table input pinned at one version."""

    format: str  # delta | iceberg
    shown: str  # the table in lines and the manifest (a URI without userinfo)
    version: int  # a Delta version, an Iceberg snapshot id
    committed: str  # when that version was committed, ISO 8601 UTC
    latest: int  # the table's newest version (Iceberg: snapshot) when it was pinned
    columns: dict[str, Any] = field(default_factory=dict)  # name -> pyarrow type, the table's at that version
    plan: Any = None  # what the tasks read (_DeltaPlan, or _IcebergPlan)

    def record(self) -> dict:
        """What the manifest, the summary and MLflow say of it."""
        return {"format": self.format, "version": self.version, "committed": self.committed}

    def describe(self) -> str:
        kind = "snapshot" if self.format == "iceberg" else "version"
        newest = "" if self.latest == self.version else f"; the newest is {self.latest}"
        return f"{self.format} {kind} {self.version} of {self.committed}{newest}"


def version_spec(text: str, key: str = "data.version") -> int | dt.datetime | None:
    """data.version: "" (the current version), a number (Delta version, Iceberg snapshot id) or an ISO date/time
    (UTC unless it says otherwise)."""
    text = text.strip()
    if not text:
        return None
    if text.lstrip("-").isdigit():
        return int(text)
    try:
        when = dt.datetime.fromisoformat(text.replace("Z", "+00:00") if text.endswith("Z") else text)
    except ValueError:
        raise UserError(f"{key} {text!r}: neither a version number nor an ISO timestamp (2024-05-01T12:00:00Z);"
                        " leave it empty for the current version") from None
    return when if when.tzinfo else when.replace(tzinfo=dt.UTC)


def _iso(ms: int) -> str:
    return dt.datetime.fromtimestamp(ms / 1000, dt.UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def _need(module: str, what: str, path: str, key: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise UserError(f"{key} {redact(path)}: reading {what} needs the tables extra: {install_hint('tables')}"
                        ) from None


def actual(columns, name: str) -> str | None:
    """The table's column that `name` names: itself, else the one that differs only in case (formats.column_named)."""
    from torchloom.text.formats import column_named

    return column_named(list(columns), name)


def pin(data: DataConfig, path: str, fmt: str, key: str = "data.path", version: str | None = None) -> Table:
    """The table at `path` at `version` (data.version when None), with its plan. One line for a path that is
    not a table, a version it does not have, a catalog that does not answer, a table without the columns."""
    spec = version_spec(data.version if version is None else version)
    table = _delta(path, spec, key) if fmt == "delta" else _iceberg(data, path, spec, key)
    missing = [c for c in (data.text_column, *data.label_sources()) if actual(table.columns, c) is None]
    if missing:
        which = " and ".join(f"{c!r}" for c in missing)
        names = list(table.columns)
        label_key = "data.label_columns" if data.label_columns else "data.label_column"
        keys = {key: kind for key, kind, column in (("data.text_column", "text", data.text_column),
                                                    *((label_key, "label", c) for c in data.label_sources()))
                if column in missing}
        shown = ", ".join(names[:8]) + (f" (and {len(names) - 8} more)" if len(names) > 8 else "")
        raise UserError(f"{key} {table.shown}: no column {which} at {table.describe()}; columns found:"
                        f" {shown or 'none'}; {column_fix(names, keys)}")
    if data.split_column and actual(table.columns, data.split_column) is None:
        raise UserError(f"data.split_column {data.split_column!r}: no such column in {table.shown} at"
                        f" {table.describe()}; columns found: {', '.join(table.columns)}")
    return table


def pin_inputs(data: DataConfig, inputs: dict[str, tuple[str, str]]) -> dict[str, Table]:
    """{path: Table} for the inputs ({key: (path, format)}) that are tables. data.version is data.path's; a
    timestamp pins every table input at that time, a number only data.path (val/test tables: their current)."""
    spec = version_spec(data.version)
    tables = {}
    for key, (path, fmt) in inputs.items():
        if fmt not in ("delta", "iceberg"):
            if key == "data.path" and data.version.strip():
                raise UserError(f"data.version {data.version!r}: data.path {redact(path)} is not a table ({fmt});"
                                " a version is read from a Delta or Iceberg table only; leave data.version empty")
            continue
        own = data.version if key == "data.path" or isinstance(spec, dt.datetime) else ""
        tables[path] = pin(data, path, fmt, key, own)
    return tables


# -- Delta Lake ------------------------------------------------------------------------------------


def delta_location(path: str) -> tuple[str, dict[str, str]]:
    """The table's URI as delta-rs opens it, and its storage options: S3's credentials come from the standard
    variables, which delta-rs reads itself (an http:// endpoint, AWS_ENDPOINT_URL, needs saying so); Azure's from
    the variables torchloom's other abfs:// inputs read (store/clients.delta_azure_options); gs:// with
    Application Default Credentials, or an emulator (STORAGE_EMULATOR_HOST) that serves GCS's XML API."""
    parsed = urlparse(path)
    scheme = parsed.scheme.lower()
    if scheme in ("", "file") or (len(scheme) == 1 and os.name == "nt"):
        return os.path.abspath(parsed.path if scheme == "file" else path), {}
    if scheme == "file+store":
        return parsed.path, {}
    options = {}
    if scheme in ("s3", "s3a"):
        path = "s3" + path[len(scheme):]
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint:
            options["AWS_ENDPOINT_URL"] = endpoint
            if endpoint.startswith("http://"):
                options["AWS_ALLOW_HTTP"] = "true"
        if not (os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")):
            options["AWS_REGION"] = "us-east-1"
    elif scheme in ("abfs", "abfss", "az"):
        options = clients.delta_azure_options(path, redact(path))
    elif scheme in ("gs", "gcs"):
        path, options = "gs" + path[len(scheme):], clients.delta_gcs_options()
    return path.rstrip("/"), options


@dataclass
class _DeltaPlan:
    uri: str  # the table's root as delta-rs opened it
    # (file URI, size, {column: partition value}, the rows its deletion vector keeps: zlib of packed bits, or None)
    files: list[tuple[str, int, dict[str, Any], bytes | None]]
    physical: dict[str, str]  # column -> its name in the Parquet files (column mapping)


def _delta(path: str, spec, key: str) -> Table:
    deltalake = _need("deltalake", "a Delta table", path, key)
    from deltalake.exceptions import TableNotFoundError

    uri, options = delta_location(path)
    shown = redact(path)

    def fail(e: BaseException, what: str) -> UserError:
        return UserError(f"{key} {shown}: {what} ({first_line(e)[:300]})")

    try:
        table = deltalake.DeltaTable(uri, storage_options=options or None)
    except TableNotFoundError as e:
        log = "a _delta_log/ without a commit in it" if "log segment" in str(e) else "no Delta log here"
        raise fail(e, f"not a Delta table: {log}; check the path (a Delta table's directory holds {DELTA_LOG}/ with"
                      " its commits)") from None
    except Exception as e:  # a damaged commit, an unreadable log, a store that does not answer
        raise fail(e, "cannot read this Delta table's log") from None
    latest = table.version()
    try:
        if isinstance(spec, int):
            if not 0 <= spec <= latest:
                raise UserError(f"data.version {spec}: {shown} has no version {spec}; its versions run from 0 to"
                                f" {latest} (or name a time: an ISO timestamp)")
            if spec != latest:
                table = deltalake.DeltaTable(uri, version=spec, storage_options=options or None)
        elif spec is not None:
            table.load_as_version(spec)
    except UserError:
        raise
    except Exception as e:
        raise fail(e, f"cannot load version {spec} (data.version)") from None
    committed = _commit_ms(uri, table.version())
    if isinstance(spec, dt.datetime) and committed and committed > round(spec.timestamp() * 1000):
        raise UserError(f"data.version {spec.isoformat()}: {shown} did not exist yet; its first version kept is"
                        f" {table.version()} of {_iso(committed)}")
    return Table("delta", shown, table.version(), _iso(committed) if committed else "", latest,
                 *_delta_plan(table, uri))


def _commit_ms(uri: str, version: int) -> int | None:
    """When a version was committed (its commitInfo's time; delta-rs's history() of a table loaded at an older
    version names the newest commits): one read of that commit's file; None where the log no longer has it."""
    name = f"{uri.rstrip('/')}/{DELTA_LOG}/{version:020d}.json"
    try:
        if has_scheme(uri):
            from torchloom.store import storage

            text = storage.read_bytes(name).decode("utf-8")
        else:
            with open(name, encoding="utf-8") as f:
                text = f.read()
    except (OSError, UserError):
        return None
    for line in text.splitlines():
        info = json.loads(line).get("commitInfo") if line.strip() else None
        if info:
            return int(info.get("inCommitTimestamp") or info.get("timestamp") or 0) or None
    return None


def _delta_plan(table, uri: str) -> tuple[dict[str, Any], _DeltaPlan]:
    import numpy as np
    import pyarrow as pa

    schema = pa.schema(table.schema().to_arrow())
    columns = {f.name: f.type for f in schema}
    physical = {}
    for f in table.schema().fields:
        physical[f.name] = (f.metadata or {}).get("delta.columnMapping.physicalName", f.name)
    actions = pa.table(table.get_add_actions(flatten=True))
    keeps = {}
    for row in pa.table(table.deletion_vectors()).to_pylist():
        keep = np.asarray(row["selection_vector"], dtype=bool)
        keeps[_same(row["filepath"])] = zlib.compress(np.packbits(keep).tobytes()) + len(keep).to_bytes(8, "little")
    parts = [c for c in actions.column_names if c.startswith("partition.")]
    files = []
    for row in actions.to_pylist():
        rel = unquote(row["path"])
        file_uri = rel if has_scheme(rel) or rel.startswith("/") else f"{uri.rstrip('/')}/{rel}"
        values = {c[len("partition."):]: row[c] for c in parts}
        keep = keeps.pop(_same(file_uri), None)
        files.append((file_uri, int(row["size_bytes"]), values, keep))
    if keeps:  # a deletion vector of no file read: its rows would come back
        raise UserError(f"data.path {redact(uri)}: a deletion vector names {redact(next(iter(keeps)))}, which is not"
                        " among the version's files as read here; this table cannot be read exactly")
    return columns, _DeltaPlan(uri, sorted(files, key=lambda f: f[0]), physical)


def _same(location: str) -> str:
    """A data file's location as delta-rs names it in one place or another (a path, a percent-encoded URI)."""
    if not has_scheme(location):
        return location
    parsed = urlparse(location)
    return ("" if parsed.scheme == "file" else parsed.netloc) + unquote(parsed.path)


# -- Apache Iceberg --------------------------------------------------------------------------------


@dataclass
class _IcebergPlan:
    metadata: Any  # the table's metadata (pyiceberg TableMetadata)
    io: Any  # its FileIO
    projection: Any  # the schema of the columns read, at the snapshot
    tasks: list  # pyiceberg FileScanTasks: a data file and its delete files


def iceberg_name(path: str) -> tuple[str, str]:
    """(catalog, namespace.table) of iceberg://catalog/namespace.table."""
    rest = path[len(ICEBERG_SCHEME):].strip("/")
    catalog, _, ident = rest.partition("/")
    if not catalog or "." not in ident.strip(".") or "/" in ident:
        raise UserError(f"data.path {path}: an Iceberg table is named iceberg://CATALOG/NAMESPACE.TABLE"
                        " (its catalog's settings in data.catalogs)")
    return catalog, ident


STORE_FILE_IO = "torchloom.inputs.iceberg_io.StoreFileIO"


def _iceberg(data: DataConfig, path: str, spec, key: str) -> Table:
    _need("pyiceberg.catalog", "an Iceberg table", path, key)
    from pyiceberg.catalog import load_catalog
    from pyiceberg.exceptions import NoSuchNamespaceError, NoSuchTableError

    name, ident = iceberg_name(path)
    settings = {k: str(v) for k, v in (data.catalogs.get(name) or {}).items()}
    # S3 as for every other input: an S3-compatible store's endpoint and the region from the standard variables
    for setting, variables in (("s3.endpoint", ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")),
                               ("s3.region", ("AWS_REGION", "AWS_DEFAULT_REGION"))):
        value = next((os.environ[v] for v in variables if os.environ.get(v)), None)
        if value and setting not in settings:
            settings[setting] = value
    settings.setdefault("py-io-impl", STORE_FILE_IO)  # gs:// and abfs:// as every other input reads them
    try:
        catalog = load_catalog(name, **settings)
        table = catalog.load_table(ident)
    except (NoSuchTableError, NoSuchNamespaceError):
        raise UserError(f"{key} {path}: no table {ident} in the Iceberg catalog {name!r}; check the name") from None
    except Exception as e:  # not configured, not answering, refusing; or a metadata file that is gone
        if _missing_file(e):
            raise UserError(f"{key} {path}: the Iceberg catalog {name!r} answers, but the table's metadata file it"
                            f" names is not there ({first_line(e)[:200]}); the table's files were moved or deleted,"
                            " or the catalog points at an old location: register the table again") from None
        where = settings.get("uri") or os.environ.get(f"PYICEBERG_CATALOG__{name.upper()}__URI", "")
        raise UserError(f"{key} {path}: the Iceberg catalog {name!r}{' at ' + redact(where) if where else ''} does"
                        f" not answer ({first_line(e)[:300]}); check data.catalogs.{name} (uri, warehouse) or"
                        " pyiceberg's own config") from None
    return _iceberg_snapshot(data, table, path, spec)


def _missing_file(e: BaseException) -> bool:
    """A file the reader was told of and did not find (a local one, or a store's object)."""
    while e is not None:
        if isinstance(e, FileNotFoundError) or any(s in str(e) for s in ("No such file", "NoSuchKey", "Not Found",
                                                                           "does not exist")):
            return True
        e = e.__cause__ or e.__context__
    return False


def _iceberg_snapshot(data: DataConfig, table, path: str, spec) -> Table:
    current = table.current_snapshot()
    if current is None:
        raise UserError(f"data.path {path}: the Iceberg table has no snapshot yet (no rows); append rows first")
    if isinstance(spec, int):
        snapshot = table.snapshot_by_id(spec)
        if snapshot is None:
            known = ", ".join(str(s.snapshot_id) for s in table.snapshots()[-5:])
            raise UserError(f"data.version {spec}: {path} has no snapshot {spec}; its newest are {known} (or name a"
                            " time: an ISO timestamp)")
    elif spec is not None:
        snapshot = table.snapshot_as_of_timestamp(int(spec.timestamp() * 1000))
        if snapshot is None:
            first = min(table.snapshots(), key=lambda s: s.timestamp_ms)
            raise UserError(f"data.version {spec.isoformat()}: {path} had no snapshot yet; its first kept is"
                            f" {first.snapshot_id} of {_iso(first.timestamp_ms)}")
    else:
        snapshot = current
    schema = (table.schemas().get(snapshot.schema_id, table.schema()) if snapshot.schema_id is not None
        else table.schema())
    arrow = schema.as_arrow()
    columns = {f.name: f.type for f in arrow}
    wanted = tuple(dict.fromkeys(actual(columns, c) for c in (data.text_column, *data.label_sources(),
                                                              data.split_column) if c and actual(columns, c)))
    scan = table.scan(snapshot_id=snapshot.snapshot_id, selected_fields=wanted or ("*",))
    plan = _IcebergPlan(table.metadata, table.io, scan.projection(), list(scan.plan_files()))
    return Table("iceberg", path, snapshot.snapshot_id, _iso(snapshot.timestamp_ms), current.snapshot_id,
                 columns, plan)


# -- the Spark side ----------------------------------------------------------------------------------


def read(spark, data: DataConfig, table: Table):
    """The pinned table as a DataFrame of its text, label (and split) columns in the table's types and
    store_read.SOURCE (the data file of each row)."""
    import pyarrow as pa

    from torchloom.inputs import table_tasks
    from torchloom.inputs.store_read import SOURCE, _quoted

    # the table's own names: a column given in another case is the table's one column of that name, as Spark and
    # the CSV and Parquet readers take it (the DataFrame's columns resolve the config's names without case)
    wanted = [actual(table.columns, c) or c for c in dict.fromkeys((data.text_column, *data.label_sources(),
                                                                     data.split_column)) if c]
    schema = pa.schema([pa.field(c, _spark_type(table.columns[c])) for c in wanted]
                       + [pa.field(SOURCE, pa.string())])
    from pyspark.sql.pandas.types import from_arrow_schema

    spark_schema = from_arrow_schema(schema)
    if table.format == "iceberg":
        plan = table.plan
        if not plan.tasks:
            return spark.createDataFrame([], spark_schema)
        ids = spark.range(0, len(plan.tasks), 1, numPartitions=min(len(plan.tasks), _tasks(spark, plan.tasks)))
        return ids.mapInArrow(partial(table_tasks.iceberg_task, plan=plan, schema=schema), spark_schema)
    ranges = byte_ranges(table.plan.files, _parallelism(spark))
    if not ranges:
        return spark.createDataFrame([], ", ".join(f"{_quoted(n)} STRING" for n in [*wanted, SOURCE]))
    total = sum(hi - lo for _, lo, hi in ranges)
    tasks = min(len(ranges), max(_parallelism(spark), -(-total // SPLIT_BYTES)))
    ids = spark.range(0, len(ranges), 1, numPartitions=tasks)
    return ids.mapInArrow(partial(table_tasks.delta_task, plan=table.plan, ranges=ranges, schema=schema,
                                  physical={c: table.plan.physical.get(c, c) for c in wanted}), spark_schema)


def byte_ranges(files: list, parallelism: int) -> list[tuple[int, int, int]]:
    """(file index, first byte, end) of each piece of work: Spark's split of Parquet files (ranges of at most
    SPLIT_BYTES, smaller when that gives every core some: the total over the cores, at least OPEN_COST)."""
    total = sum(size for _, size, _, _ in files)
    split = max(OPEN_COST, min(SPLIT_BYTES, total // max(parallelism, 1)))
    return [(i, lo, min(lo + split, size)) for i, (_, size, _, _) in enumerate(files) for lo in range(0, size, split)]


def _tasks(spark, tasks: list) -> int:
    total = sum(t.file.file_size_in_bytes for t in tasks)
    return max(_parallelism(spark), -(-total // SPLIT_BYTES))


def _parallelism(spark) -> int:
    from torchloom.inputs.store_read import _parallelism

    return _parallelism(spark)


def _spark_type(arrow_type):
    """The column's type as the tasks hand it to Spark: the table's own, where Spark has one for it; else text."""
    import pyarrow as pa
    from pyspark.sql.pandas.types import from_arrow_type

    if pa.types.is_large_string(arrow_type) or pa.types.is_string_view(arrow_type):
        return pa.string()
    try:
        from_arrow_type(arrow_type)
        return arrow_type
    except Exception:  # Spark has no type for it: its text
        return pa.string()


def record(tables: dict[str, Table], inputs: dict[str, str | None]) -> dict:
    """The manifest's entries for the inputs ({key: path}) that are tables: data.path's version and commit time
    as `version`, `committed`; val_path's and test_path's as `val_version`, `test_version`."""
    out = {}
    for key, path in inputs.items():
        table = tables.get(path or "")
        if table is None:
            continue
        prefix = "" if key == "data.path" else key.split(".")[1].replace("_path", "_")
        out[f"{prefix}version"] = table.version
        out[f"{prefix}committed"] = table.committed
    return out


def describe(inputs: dict) -> str:
    """A manifest's inputs as one phrase: `delta version 3 of 2024-05-01T12:00:00Z`, or its format."""
    if "version" not in inputs:
        return inputs.get("format", "")
    kind = "snapshot" if inputs.get("format") == "iceberg" else "version"
    return f"{inputs.get('format')} {kind} {inputs['version']} of {inputs.get('committed')}"
