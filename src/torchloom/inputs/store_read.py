"""The input of prepare on an object store, read by a Spark cluster that has no Hadoop connector for it.

Spark reads `s3a://` or `gs://` only with the connector jars of that file system, which are not on PyPI and
which a plain standalone cluster (or a Ray head's local Spark) lacks. Here the driver lists the objects with
pyarrow (store/storage.py), and each task streams its share of them from the store itself, with pyarrow as well:

- CSV: the task splits the text into records where Spark's multiLine reader does (a line break outside a
  quoted field; the header record of each file skipped) and Spark parses each record with `from_csv`, the
  same parser with the same options as `spark.read.csv`: the same nulls, the same handling of short, long
  and badly quoted rows.
- JSON lines: one record per non-blank line, parsed by Spark's `from_json` (a number or an object in a
  string column comes out as its JSON text, as with `spark.read.json` and a cast).
- Parquet: the columns asked for, row group by row group (ranged reads), in the first file's types.
- a folder of label directories: every `*.txt` below the prefix, whole, its directory's name the label.

gzip, bz2 and zstd files (by their extension) are decompressed as they stream. Every row keeps the object's
URI as its source. `read.read_input` chooses this reader for a URI whose scheme Spark has no file system
for (`prepare.input_reader auto`), or always (`pyarrow`); see docs/engines.md.
"""

from __future__ import annotations

import io
import json
import os
from functools import partial

from torchloom.errors import UserError
from torchloom.inputs.encoding import STRICT, Undecodable, decode, local_path, undecodable_line
from torchloom.inputs.store_tasks import (
    CODEC,
    MARK,
    SOURCE,
    _batches,
    csv_records,
    csv_task,
    folder_task,
    header_names,
    lines_task,
    parquet_task,
    reading,
    text_stream,
)
from torchloom.store import storage
from torchloom.text.formats import FORMATS, column_named

UNREAD_CODECS = (".snappy", ".lz4", ".deflate")
BYTES_PER_TASK = 128 << 20
JSON_SAMPLE_LINES = 1000  # the lines of the first file looked at for the column names



def files(path: str, fmt: str) -> list[tuple[str, int]]:
    """(URI, size) of the objects to read, sorted: the object itself, or those under the prefix whose names
    fit the format (a folder: *.txt; hidden and _-prefixed names skipped, as Spark does)."""
    storage.check_readable(path, "data.path")
    listing = storage.list_files(path)
    if not listing:
        return [(path, 0)]
    keep = [(storage.join(path, rel), size) for rel, size in listing.items()
            if not hidden(rel) and (fmt != "folder" or rel.endswith(".txt"))]
    if not keep:
        raise UserError(f"data.path {storage.redact(path)}: no {fmt} files under this prefix; point --data.path at"
                        " your data files")
    return sorted(keep)


def hidden(rel: str) -> bool:
    """An object Spark's readers skip: a name, at any level, starting with . or _ (_SUCCESS, .crc files)."""
    return any(p.startswith((".", "_")) for p in rel.split("/"))


def read(spark, cfg, path: str, fmt: str, sep: str = ","):
    """`path` on the store as a DataFrame: the input's own columns, SOURCE and CODEC (folder: text, label,
    SOURCE, CODEC)."""
    objects = files(path, fmt)
    for uri, _ in objects:
        if uri.endswith(UNREAD_CODECS):
            raise UserError(f"data.path {storage.redact(uri)}: compressed as {os.path.splitext(uri)[1]}, which this"
                            " reader does not decompress; use gzip, bz2 or zstd, or an uncompressed file")
    uris = [u for u, _ in objects]
    wanted = [c for c in dict.fromkeys((cfg.text_column, *cfg.label_sources(), cfg.split_column)) if c]
    tasks = min(len(uris), max(_parallelism(spark), sum(s for _, s in objects) // BYTES_PER_TASK + 1))
    ids = spark.range(0, len(uris), 1, numPartitions=tasks)
    encoding = getattr(cfg, "encoding", STRICT)
    if fmt == "csv":
        with reading(uris[0]), text_stream(uris[0], encoding) as stream:
            names = csv_header(stream, storage.redact(uris[0]), sep)
        records = ids.mapInArrow(partial(csv_task, uris=uris, sep=sep, encoding=encoding, names=names), RECORDS)
        return _parse_csv(records, names, sep)
    if fmt == "jsonl":
        with reading(uris[0]), text_stream(uris[0], encoding) as stream:
            found = json_columns(stream)
        wanted = [column_named(sorted(found), c) or c for c in wanted]  # "Text" for text, as Spark's reader
        if found and not set(wanted) <= found:  # a column in none of the first lines: name what is there
            return spark.createDataFrame([], ", ".join(f"{_quoted(n)} STRING" for n in sorted(found)))
        records = ids.mapInArrow(partial(lines_task, uris=uris, encoding=encoding), RECORDS)
        return _parse_json(records, wanted)
    if fmt == "parquet":
        arrow = parquet_schema(uris[0])
        wanted = [column_named(arrow.names, c) or c for c in wanted]
        if not set(wanted) <= set(arrow.names):  # a missing column: the names there, for read._select's line
            return spark.createDataFrame([], ", ".join(f"{_quoted(n)} STRING" for n in arrow.names))
        return _parquet(ids, uris, arrow, wanted)
    if fmt == "folder":
        return ids.mapInArrow(partial(folder_task, uris=uris, encoding=encoding),
                              f"text STRING, label STRING, {SOURCE} STRING, {CODEC} STRING")
    raise UserError(f"data.format {fmt!r}: unknown; use one of auto, {', '.join(FORMATS)}")


RECORDS = f"record STRING, {SOURCE} STRING, {CODEC} STRING"


def _parse_csv(records, names: list[str], sep: str):
    """CSV records (RECORDS) parsed by Spark's from_csv into the header's columns, with the options of
    read.read_input's spark.read.csv: the same nulls and the same handling of short, long and badly
    quoted rows."""
    from pyspark.sql import functions as F

    schema = ", ".join(f"{_quoted(n)} STRING" for n in names)
    parsed = F.from_csv("record", schema, {"sep": sep, "escape": '"'})
    return records.select(parsed.alias("r"), SOURCE, CODEC).select("r.*", SOURCE, CODEC)


def _parse_json(records, wanted: list[str]):
    from pyspark.sql import functions as F

    schema = ", ".join(f"{_quoted(n)} STRING" for n in wanted)
    return records.select(F.from_json("record", schema).alias("r"), SOURCE, CODEC).select("r.*", SOURCE, CODEC)


def decoded_frame(spark, cfg, files: list[str], fmt: str, sep: str):
    """CSV or JSON lines files that Spark's UTF-8 reader must not read (read._by_encoding): each read whole
    by Spark's text source (which leaves the bytes undecoded), decoded in the tasks as inputs/encoding.py
    decides, split into records and parsed as `read` parses a store's objects. Each file is one row of the
    text source, so one file must fit a task's memory (and 2 GB); the driver fetches one to learn the
    columns."""
    from pyspark.sql import functions as F

    raw = spark.read.text(files, wholetext=True).select(F.col("value").cast("binary").alias("raw"),
                                                       F.col("_metadata.file_path").alias(SOURCE))
    records = raw.mapInArrow(partial(decode_task, fmt=fmt, sep=sep, encoding=cfg.encoding), RECORDS)
    one = raw.limit(1).collect()
    if not one:
        raise UserError(f"data.path {files[0]}: no {fmt} data found there; check the path and --data.format")
    first = io.StringIO(_decode(bytes(one[0].raw), cfg.encoding, local_path(one[0][SOURCE]))[0], newline="")
    if fmt == "csv":
        return _parse_csv(records, csv_header(first, local_path(one[0][SOURCE]), sep), sep)
    wanted = [c for c in dict.fromkeys((cfg.text_column, *cfg.label_sources(), cfg.split_column)) if c]
    found = json_columns(first)
    wanted = [column_named(sorted(found), c) or c for c in wanted]
    if found and not set(wanted) <= found:
        return spark.createDataFrame([], ", ".join(f"{_quoted(n)} STRING" for n in sorted(found)))
    return _parse_json(records, wanted)


def _decode(raw: bytes, encoding: str, shown: str) -> tuple[str, str]:
    """text_encoding.decode, a forced codec's failure as a UserError naming the file."""
    try:
        return decode(raw, encoding)
    except Undecodable as e:
        raise UserError(undecodable_line(shown, encoding, e)) from None


def decode_task(batches, fmt: str, sep: str, encoding: str):
    """mapInArrow over whole files (raw, SOURCE): their records (CSV: but the header; JSON lines: non-blank
    lines), each with its file and the codec it was decoded from."""
    def rows():
        for batch in batches:
            for raw, source in zip(batch.column("raw").to_pylist(), batch.column(SOURCE).to_pylist()):
                try:
                    text, codec = _decode(raw, encoding, local_path(source))
                except UserError as e:
                    raise RuntimeError(MARK + str(e)) from None
                stream = io.StringIO(text, newline="")
                records = csv_records(stream, sep) if fmt == "csv" else (x for x in stream if x.strip())
                if fmt == "csv":
                    next(records, None)  # the header
                for record in records:
                    yield record, source, codec

    yield from _batches(rows(), ["record", SOURCE, CODEC])


def parquet_frame(spark, uris: list[str], columns: list[str]):
    """Parquet objects on the store as one DataFrame of `columns`, read by the tasks with pyarrow (one task
    per object, row group by row group): prepared shards for the Spark baseline on a cluster without a
    connector for the run's store."""
    ids = spark.range(0, len(uris), 1, numPartitions=len(uris))
    return _parquet(ids, uris, parquet_schema(uris[0]), columns).drop(SOURCE)


def _parquet(ids, uris: list[str], arrow, columns: list[str]):
    """mapInArrow of parquet_task over object indices `ids`: `columns` in the types of `arrow` (the first
    object's schema), and SOURCE."""
    import pyarrow as pa
    from pyspark.sql.pandas.types import from_arrow_schema

    schema = pa.schema([arrow.field(c) for c in columns] + [pa.field(SOURCE, pa.string())])
    return ids.mapInArrow(partial(parquet_task, uris=uris, schema=schema), from_arrow_schema(schema))


def _parallelism(spark) -> int:
    try:
        return max(1, int(spark.sparkContext.defaultParallelism))
    except Exception:  # Spark Connect
        return 2


def _quoted(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


def input_error(e: BaseException) -> UserError | None:
    """The line a task of this module failed with, from the Spark error that carries it; None for any other."""
    text = str(e)
    java = getattr(e, "java_exception", None)
    if MARK not in text and java is not None:
        try:
            text = java.toString()
        except Exception:
            return None
    at = text.find(MARK)
    if at < 0:
        return None
    return UserError(text[at + len(MARK):].splitlines()[0])


# -- on the driver: what the first object says ----------------------------------------------------


def csv_header(stream, shown: str, sep: str) -> list[str]:
    """The column names of the header record of a CSV file's text, as Spark names them: an empty name is
    _c<i>, a repeated one gets its position appended."""
    first = next(csv_records(stream, sep), None)
    if first is None:
        raise UserError(f"data.path {shown}: the file is empty; a CSV input needs a header line")
    return header_names(first, sep)


def json_columns(stream) -> set[str]:
    """The keys of the first JSON_SAMPLE_LINES objects of a JSON lines file's text."""
    keys: set[str] = set()
    for i, line in enumerate(stream):
        if i >= JSON_SAMPLE_LINES:
            break
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict):
            keys.update(value)
    return keys


def parquet_schema(uri: str):
    import pyarrow.parquet as pq

    with reading(uri), storage.open_input(uri) as f:
        return pq.ParquetFile(f).schema_arrow
