"""The --input of predict and monitor: a CSV, JSONL or Parquet file, or a directory of them, told by its name and
streamed in record batches (pyarrow), so a file may be larger than memory. CSV columns stay strings and an empty
unquoted field is null, as Spark reads them; any text encoding is read as prepare reads it (inputs/encoding.py)."""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torchloom.errors import UserError, first_line
from torchloom.inputs.encoding import file_codec, read_note
from torchloom.text.formats import SUFFIX_FORMATS, default_separator, separator_in, spreadsheet_hint

CHUNK_ROWS = 4096  # rows read (and predicted, and written) at a time


def input_format(path: str) -> str:
    """csv, jsonl or parquet, from the extension (or the most common one of the files in a directory); a local path
    that is not there is one line."""
    from torchloom.uri import has_scheme

    p = Path(path)
    if not has_scheme(path) and not p.exists():
        raise UserError(f"--input {path}: no such file or directory; check the path (relative paths are from"
                        f" {Path.cwd()})")
    if p.is_dir():
        seen = Counter(SUFFIX_FORMATS[f.suffix.lower()] for f in data_files(p) if f.suffix.lower() in SUFFIX_FORMATS)
        if not seen:
            raise UserError(f"--input {path}: no {', '.join(sorted(SUFFIX_FORMATS))} files in this directory")
        return seen.most_common(1)[0][0]
    fmt = SUFFIX_FORMATS.get(p.suffix.lower())
    if fmt is None and spreadsheet_hint(path):
        raise UserError(f"--input {path}: {spreadsheet_hint(path)}")
    if fmt is None:
        raise UserError(f"--input {path}: cannot tell the format from the name; use a file ending in"
                        f" {', '.join(sorted(SUFFIX_FORMATS))}")
    return fmt


def data_files(root: Path) -> list[Path]:
    """Files under root, skipping hidden and Spark bookkeeping (_SUCCESS, .crc) files, in name order."""
    return sorted(f for f in root.rglob("*") if f.is_file() and not f.name.startswith((".", "_")))


def stream_batches(path: str, fmt: str) -> tuple[Any, Iterator[Any]]:
    """(schema, record batches) of a local file or directory, streamed."""
    import pyarrow.dataset as ds

    p = Path(path)
    if fmt == "parquet":
        # File by file, a row group at a time: Arrow's dataset scanner read a whole file ahead of a slow
        # consumer (64 MB held for a 64 MB file, whatever batch_readahead said), so memory grew with the input.
        dataset = ds.dataset(path, format="parquet", exclude_invalid_files=False, ignore_prefixes=[".", "_"])
        schema = dataset.schema

        def parquet_batches() -> Iterator[Any]:
            import pyarrow.parquet as pq

            for f in dataset.files:
                for batch in pq.ParquetFile(f).iter_batches(batch_size=CHUNK_ROWS, columns=schema.names):
                    yield batch.cast(schema) if batch.schema != schema else batch
        return schema, parquet_batches()
    files = [f for f in data_files(p) if SUFFIX_FORMATS.get(f.suffix.lower()) == fmt] if p.is_dir() else [p]
    if not files:
        raise UserError(f"--input {path}: no {fmt} files there")
    first_schema, first = _open_text_file(files[0], fmt)

    def batches() -> Iterator[Any]:
        yield from first
        for f in files[1:]:
            schema, more = _open_text_file(f, fmt)
            for batch in more:
                try:
                    yield batch.select(first_schema.names).cast(first_schema)
                except (KeyError, ValueError, NotImplementedError) as e:
                    raise UserError(f"--input {f}: its columns differ from {files[0].name}'s ({e});"
                                    " predict the files separately") from None
    return first_schema, batches()


def _open_text_file(path: Path, fmt: str):
    import pyarrow as pa
    import pyarrow.csv as pacsv
    import pyarrow.json as pajson

    codec = file_codec(str(path))  # as prepare's data.encoding auto reads it (inputs/encoding.py)
    note = read_note(f"--input {path}", codec)
    if note:
        print(f"predict: {note}", file=sys.stderr, flush=True)
    encoding = "utf-8" if codec == "utf-8-sig" else codec  # Arrow's own UTF-8 reader; others through Python's
    try:
        if fmt == "csv":
            read = pacsv.ReadOptions(block_size=1 << 20, encoding=encoding)
            parse = pacsv.ParseOptions(newlines_in_values=True, delimiter=_separator(path, codec))
            # Every CSV column stays a string, as Spark reads CSV: no guess that fails on a later block.
            names = pacsv.open_csv(path, read_options=read, parse_options=parse).schema.names
            names = [n.replace("\ufeff", "").strip() for n in names]
            read = pacsv.ReadOptions(block_size=1 << 20, encoding=encoding, column_names=names, skip_rows=1)
            # Empty unquoted fields are null, as in Spark's CSV reader; "NA" and "null" stay text.
            convert = pacsv.ConvertOptions(column_types={n: pa.string() for n in names}, null_values=[""],
                                           strings_can_be_null=True)
            reader = pacsv.open_csv(path, read_options=read, parse_options=parse, convert_options=convert)
        else:
            source = path if codec == "utf-8-sig" else pa.transcoding_input_stream(pa.OSFile(str(path)), codec, "utf-8")
            reader = pajson.open_json(source, read_options=pajson.ReadOptions(block_size=1 << 20))
    except pa.ArrowInvalid as e:
        raise UserError(f"--input {path}: cannot read it as {fmt} ({first_line(e)})") from None
    return reader.schema, _checked(reader, path, fmt)


def _separator(path: Path, codec: str) -> str:
    """The CSV's field separator: the one its name implies, or ";", a tab or "|" where its header line shows
    that instead (an Excel export in much of Europe is a .csv separated by ";")."""
    sep = default_separator(path.name)
    with open(path, encoding=codec, errors="replace", newline="") as f:
        header = f.readline()
    return separator_in(header.split(sep), sep) or sep


def _checked(reader, path: Path, fmt: str) -> Iterator[Any]:
    import pyarrow as pa

    try:
        yield from reader
    except pa.ArrowInvalid as e:
        raise UserError(f"--input {path}: cannot read it as {fmt} ({first_line(e)})") from None
