"""What a Spark task does with its share of an input's objects on a store (inputs/store_read.py plans it): stream
each object's text (decompressed, decoded by text_encoding's rule), cut CSV into records where Spark's multiLine
reader would, read Parquet row group by row group, and name the object in any error it raises."""

from __future__ import annotations

import contextlib
import io
import os

from torchloom.errors import UserError
from torchloom.inputs.encoding import STRICT, Undecodable, detect, name, skip, undecodable_line
from torchloom.store import storage
from torchloom.store.errors import reason

SOURCE = "__torchloom_source"  # the column with each row's object URI
CODEC = "__torchloom_codec"  # the encoding inputs/encoding.py read each row's file in (null: data.encoding strict)
SPOOL_BYTES = 64 << 20  # an object is held in memory up to this size (beyond: local disk) while its encoding is decided
MARK = "torchloom-input-error: "  # begins the message of a task's failure to read an object (input_error)
CODECS = {".gz": "gzip", ".bz2": "bz2", ".zst": "zstd"}
READ_BYTES = 8 << 20  # per request to the store when streaming an object's text


def is_gone(e: BaseException) -> bool:
    """A file or object that is not there (a local file's errno 2, a store's NoSuchKey or 404)."""
    text = str(e)
    return (isinstance(e, FileNotFoundError) or "[errno 2]" in text.lower() or "NoSuchKey" in text
        or "No such file or directory" in text)


def cannot_read(uri: str, e: BaseException) -> str:
    if isinstance(e, UserError):
        return str(e)
    if isinstance(e, Undecodable):
        return undecodable_line(storage.redact(uri), e.codec, e)
    if is_gone(e):  # named by a listing or a table's log, and not there when read: the file, whole, and why
        return (f"data.path: {storage.redact(uri)} is gone (vacuumed, deleted by hand, or changed while read);"
                " read a table version whose files are all there (data.version), repair the table, or read again")
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


# -- in the tasks: objects streamed from the store ---------------------------------------------------


@contextlib.contextmanager
def text_stream(uri: str, encoding: str = STRICT):
    """An object on the store as text: decompressed by its extension, line endings kept; read READ_BYTES per
    request (each read of a store's file is a request, and the text layer asks for 8 KB at a time). Decoded as
    inputs/encoding.py decides from all its bytes (held meanwhile in memory, or on local disk past SPOOL_BYTES),
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
