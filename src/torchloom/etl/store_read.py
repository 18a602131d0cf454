"""The input of prepare on an object store, read by a Spark cluster that has no Hadoop connector for it.

Spark reads `s3a://` or `gs://` only with the connector jars of that file system, which are not on PyPI and
which a plain standalone cluster (or a Ray head's local Spark) lacks. Here the driver lists the objects with
pyarrow (storage.py), and each task streams its share of them from the store itself, with pyarrow as well:

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

import contextlib
import io
import json
import os
from functools import partial

from torchloom import storage
from torchloom.errors import UserError
from torchloom.input_formats import FORMATS, column_named
from torchloom.store_errors import reason
from torchloom.text_encoding import STRICT, Undecodable, decode, detect, local_path, name, skip, undecodable_line

SOURCE = "__torchloom_source"  # the column with each row's object URI
CODEC = "__torchloom_codec"  # the encoding text_encoding.py read each row's file in (null: data.encoding strict)
SPOOL_BYTES = 64 << 20  # an object is held in memory up to this size (beyond: local disk) while its encoding is decided
MARK = "torchloom-input-error: "  # begins the message of a task's failure to read an object (input_error)
CODECS = {".gz": "gzip", ".bz2": "bz2", ".zst": "zstd"}
UNREAD_CODECS = (".snappy", ".lz4", ".deflate")
BYTES_PER_TASK = 128 << 20
READ_BYTES = 8 << 20  # per request to the store when streaming an object's text
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
    wanted = [c for c in dict.fromkeys((cfg.text_column, cfg.label_column, cfg.split_column)) if c]
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
    by Spark's text source (which leaves the bytes undecoded), decoded in the tasks as text_encoding.py
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
    wanted = [c for c in dict.fromkeys((cfg.text_column, cfg.label_column, cfg.split_column)) if c]
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


def cannot_read(uri: str, e: BaseException) -> str:
    if isinstance(e, UserError):
        return str(e)
    if isinstance(e, Undecodable):
        return undecodable_line(storage.redact(uri), e.codec, e)
    return (f"data.path {storage.redact(uri)}: cannot be read ({reason(e)}); check that the object is"
            " whole and what its name says (a .gz is gzip, a .parquet Parquet), and that every host has the"
            " store's credentials")


@contextlib.contextmanager
def reading(uri: str, in_task: bool = False):
    """An object's read: a failure is one line naming it, as a UserError on the driver, or in a task as a
    RuntimeError whose message starts with MARK (prepare turns it back into that line: input_error)."""
    try:
        yield
    except Exception as e:
        if in_task:
            raise RuntimeError(MARK + cannot_read(uri, e)) from None
        if isinstance(e, UserError):
            raise
        raise UserError(cannot_read(uri, e)) from None


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


def header_names(record: str, sep: str) -> list[str]:
    """A CSV header record's column names as Spark names them (see csv_header)."""
    import csv

    names = [n.replace("\ufeff", "").strip() for n in next(csv.reader([record], delimiter=sep), [])]
    counts = {n.lower(): sum(m.lower() == n.lower() for m in names) for n in names}
    out = []
    for i, n in enumerate(names):
        if not n:
            n = f"_c{i}"
        elif counts[n.lower()] > 1:
            n = f"{n}{i}"
        out.append(n)
    return out


def same_header(names: list[str], expected: list[str], shown: str, first: str) -> None:
    """A CSV file of a multi-file input whose header names other columns, or the same in another order, than
    the first file's: one line (Spark's readers would take its columns by position: text for label)."""
    if [n.lower() for n in names] != [n.lower() for n in expected]:
        raise UserError(f"data.path {shown}: its header ({', '.join(names)[:200]}) differs from that of {first}"
                        f" ({', '.join(expected)[:200]}), and columns are read by position; give every file of"
                        " one input the same header, in the same order")


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


# -- in the tasks: objects streamed from the store ---------------------------------------------------


@contextlib.contextmanager
def text_stream(uri: str, encoding: str = STRICT):
    """An object on the store as text: decompressed by its extension, line endings kept; read READ_BYTES per
    request (each read of a store's file is a request, and the text layer asks for 8 KB at a time). Decoded as
    text_encoding.py decides from all its bytes (held meanwhile in memory, or on local disk past SPOOL_BYTES),
    the codec's name in the stream's `codec`; with strict as Spark decodes: UTF-8, a BOM dropped, bytes that
    are not UTF-8 as U+FFFD, `codec` None."""
    import tempfile

    import pyarrow as pa

    with storage.open_input(uri) as raw:
        compression = CODECS.get(os.path.splitext(uri)[1].lower())
        stream = pa.BufferedInputStream(pa.CompressedInputStream(raw, compression) if compression else raw,
                                        READ_BYTES)
        if encoding == STRICT:
            text = io.TextIOWrapper(stream, encoding="utf-8-sig", errors="replace", newline="")
            text.codec = None
            yield text
            return
        with tempfile.SpooledTemporaryFile(SPOOL_BYTES) as spool:
            def chunks():
                while chunk := stream.read(READ_BYTES):
                    spool.write(chunk)
                    yield chunk

            codec = detect(chunks(), encoding)
            spool.seek(0)
            spool.seek(skip(spool.read(3), codec, encoding))
            text = io.TextIOWrapper(spool, encoding=codec, newline="")
            text.codec = name(codec)
            yield text


def csv_records(lines, sep: str, quote: str = '"'):
    """The records of CSV text given line by line (line endings kept): a record ends at a line break outside
    a quoted field, as in Spark's multiLine reader. A quote opens a quoted field only at the field's start; in
    one, two quotes are a quote. Line breaks inside a record become \\n (as Spark's parser makes them), the
    record's own is dropped, empty lines are skipped."""
    pending: list[str] = []
    in_quotes = False
    body = ""
    for line in lines:
        body = line.rstrip("\r\n")
        if not in_quotes and quote not in body:
            if body:
                yield body
            continue
        in_quotes = _ends_quoted(body, in_quotes, sep, quote)
        pending.append(body)
        if not in_quotes:
            yield "\n".join(pending)
            pending = []
    if pending:  # a quoted field never closed: the rest of the file is its record, as Spark reads it
        yield "\n".join(pending) + ("\n" if body != line else "")


def _ends_quoted(line: str, in_quotes: bool, sep: str, quote: str) -> bool:
    """Whether a quoted field is still open at the end of `line`, given whether one was at its start."""
    n, pos = len(line), 0
    field_start = not in_quotes
    while True:
        if in_quotes:
            j = line.find(quote, pos)
            if j < 0:
                return True
            if j + 1 < n and line[j + 1] == quote:
                pos = j + 2
                continue
            in_quotes, field_start, pos = False, False, j + 1
        else:
            if field_start and pos < n and line[pos] == quote:
                in_quotes, pos = True, pos + 1
                continue
            j = line.find(sep, pos)
            if j < 0:
                return False
            pos, field_start = j + len(sep), True


def _batches(rows, names, size: int = 4096):
    """(values per column) tuples -> Arrow record batches of `size` rows."""
    import pyarrow as pa

    chunk: list = []
    for row in rows:
        chunk.append(row)
        if len(chunk) == size:
            yield pa.RecordBatch.from_arrays([pa.array(c, pa.string()) for c in zip(*chunk)], names)
            chunk = []
    if chunk:
        yield pa.RecordBatch.from_arrays([pa.array(c, pa.string()) for c in zip(*chunk)], names)


def _my_uris(batches, uris: list[str]):
    for batch in batches:
        for i in batch.column(0).to_pylist():
            yield uris[i]


def csv_task(batches, uris: list[str], sep: str, encoding: str = STRICT, names: list[str] | None = None):
    """mapInArrow over object indices: each object's records but its header (which must name `names`, the
    first object's), with the object's URI and the codec it was decoded from."""
    def rows():
        for uri in _my_uris(batches, uris):
            source = storage.redact(uri)
            with reading(uri, in_task=True), text_stream(uri, encoding) as stream:
                records = csv_records(stream, sep)
                header = next(records, None)
                if names is not None and header is not None:
                    same_header(header_names(header, sep), names, source, storage.redact(uris[0]))
                for record in records:
                    yield record, source, stream.codec

    yield from _batches(rows(), ["record", SOURCE, CODEC])


def lines_task(batches, uris: list[str], encoding: str = STRICT):
    """mapInArrow over object indices: each object's non-blank lines, with the object's URI and codec."""
    def rows():
        for uri in _my_uris(batches, uris):
            source = storage.redact(uri)
            with reading(uri, in_task=True), text_stream(uri, encoding) as stream:
                for line in stream:
                    if line.strip():
                        yield line, source, stream.codec

    yield from _batches(rows(), ["record", SOURCE, CODEC])


def parquet_task(batches, uris: list[str], schema):
    """mapInArrow over object indices: the schema's columns of each object, row group by row group, cast to
    the first object's types, with the object's URI."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns = [n for n in schema.names if n != SOURCE]
    for uri in _my_uris(batches, uris):
        source = storage.redact(uri)
        with reading(uri, in_task=True), storage.open_input(uri) as f:
            pf = pq.ParquetFile(f)
            for g in range(pf.num_row_groups):
                table = pf.read_row_group(g, columns=columns)
                table = table.append_column(SOURCE, pa.array([source] * table.num_rows, pa.string()))
                yield from table.select(schema.names).cast(schema).to_batches()


def folder_task(batches, uris: list[str], encoding: str = STRICT):
    """mapInArrow over object indices: each *.txt object whole, its directory's name the label, and the codec
    it was decoded from."""
    def rows():
        for uri in _my_uris(batches, uris):
            with reading(uri, in_task=True), text_stream(uri, encoding) as stream:
                text = stream.read()
            yield text, uri.rsplit("/", 2)[-2], storage.redact(uri), stream.codec

    yield from _batches(rows(), ["text", "label", SOURCE, CODEC], size=256)
