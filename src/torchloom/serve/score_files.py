"""Batch prediction over files: CSV, JSONL or Parquet in, Parquet out with every input column plus
label, score and probabilities (a map label -> probability).

Local: pyarrow streams the input in record batches through one model, so the file can be larger than
memory. Spark (score_spark.py): `mapInArrow` over the input, the model loaded once per executor Python process
and reused by every task that process runs. Rows whose text is null get null predictions. This module holds what
both share (the input's format, the paths' checks, the Arrow columns of the predictions) and the local engine.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torchloom.errors import UserError, first_line
from torchloom.inputs.encoding import file_codec, read_note
from torchloom.inputs.formats import (
    SUFFIX_FORMATS,
    column_named,
    default_separator,
    separator_in,
    spreadsheet_hint,
    text_column_hint,
)
from torchloom.runs.outputs import check_output, record_output
from torchloom.uri import has_scheme, is_uri

PREDICTION_COLUMNS = ("label", "score", "probabilities")
CHUNK_ROWS = 4096  # rows read, predicted and written at a time by the local engine


def input_format(path: str) -> str:
    """csv, jsonl or parquet, from the extension (or the most common one of the files in a directory)."""
    p = Path(path)
    if p.is_dir():
        seen = Counter(SUFFIX_FORMATS[f.suffix.lower()] for f in _data_files(p) if f.suffix.lower() in SUFFIX_FORMATS)
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


def _data_files(root: Path) -> list[Path]:
    """Files under root, skipping hidden and Spark bookkeeping (_SUCCESS, .crc) files, in name order."""
    return sorted(f for f in root.rglob("*") if f.is_file() and not f.name.startswith((".", "_")))


def _check_paths(input_path: str, output_path: str, overwrite: bool, local_only: bool) -> None:
    remote = is_uri(input_path)
    if local_only and remote:
        raise UserError(f"--input {input_path}: the local engine reads local files; use --score-with spark for"
                        " HDFS or object stores")
    if not remote and not os.path.exists(_local(input_path)):
        raise UserError(f"--input {input_path}: no such file or directory")
    out = _local(output_path)
    if out is None:  # a store or HDFS: Spark's own errorifexists says whether anything is there
        if overwrite:
            raise UserError(f"--output {output_path}: --overwrite is only for a local --output (torchloom cannot see"
                            " there what Spark's overwrite would delete); delete the earlier predictions yourself, or"
                            " pass a new --output")
        return
    if os.path.lexists(out) and not overwrite:
        raise UserError(f"--output {output_path}: already exists; remove it or pass --overwrite")
    if not remote and os.path.abspath(out) == os.path.abspath(_local(input_path)):
        raise UserError(f"--output {output_path}: is the input; write the predictions elsewhere")
    if overwrite:
        check_output(out, [] if remote else [_local(input_path)])


def _local(path: str) -> str | None:
    """A local path (`file:` URIs too), or None for a store or HDFS."""
    if path.startswith("file://"):
        return path[len("file://"):] or "/"
    if path.startswith("file:"):
        return path[len("file:"):]
    return None if has_scheme(path) else path


def _check_schema(names: list[str], text_is_string: bool, text_column: str, input_path: str) -> None:
    if text_column not in names:
        raise UserError(f"--input {input_path}: no column {text_column!r} (columns: {', '.join(names) or 'none'});"
                        " name the text column with --text-column" + text_column_hint(names))
    taken = [c for c in PREDICTION_COLUMNS if c in names]
    if taken:
        raise UserError(f"--input {input_path}: already has a column named {taken[0]!r}, and the output adds"
                        f" {', '.join(PREDICTION_COLUMNS)}; rename that column in the input")
    if not text_is_string:
        raise UserError(f"--input {input_path}: column {text_column!r} does not hold text; pass the text column"
                        " with --text-column")


# --- the Arrow part shared by both engines ---------------------------------------------------------------


def prediction_fields(tags: bool = False):
    """The columns predictions add; tags: a multi-label model's, with `labels` (its tags over their thresholds)."""
    import pyarrow as pa

    return [pa.field("label", pa.string()), pa.field("score", pa.float64()),
            pa.field("probabilities", pa.map_(pa.string(), pa.float64())),
            *([pa.field("labels", pa.list_(pa.string()))] if tags else [])]


def predict_record_batch(model, batch, text_column: str):
    """`batch` with label, score and probabilities appended (nulls where the text is null)."""
    import pyarrow as pa

    texts = batch.column(text_column).to_pylist()
    present = [i for i, t in enumerate(texts) if t is not None]
    predictions: list[dict[str, Any] | None] = [None] * len(texts)
    for i, prediction in zip(present, model.predict([texts[i] for i in present])):
        predictions[i] = prediction
    tags = bool(getattr(model, "multi_label", False))
    label_f, score_f, probs_f, *tags_f = prediction_fields(tags)
    columns = [
        pa.array([p and p["label"] for p in predictions], label_f.type),
        pa.array([p and p["score"] for p in predictions], score_f.type),
        pa.array([p and list(p["probabilities"].items()) for p in predictions], probs_f.type),
        *([pa.array([p and p["labels"] for p in predictions], tags_f[0].type)] if tags else []),
    ]
    return pa.RecordBatch.from_arrays([*batch.columns, *columns],
                                      schema=_with_predictions(batch.schema, tags))


def _with_predictions(schema, tags: bool = False):
    import pyarrow as pa

    return pa.schema([*schema, *prediction_fields(tags)])


# --- local engine ----------------------------------------------------------------------------------------


def _local_batches(path: str, fmt: str) -> tuple[Any, Iterator[Any]]:
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
    files = [f for f in _data_files(p) if SUFFIX_FORMATS.get(f.suffix.lower()) == fmt] if p.is_dir() else [p]
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


def _is_text(arrow_type) -> bool:
    import pyarrow as pa

    return pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type)


def predict_local(model_dir: str, input_path: str, output_path: str, text_column: str = "text",
                  batch_size: int = 32, device: str = "cpu", overwrite: bool = False,
                  progress: bool = True, runtime: str = "torch") -> dict[str, Any]:
    """Predict every row of `input_path` into one Parquet file `output_path`; returns rows and seconds."""
    import pyarrow.parquet as pq

    from torchloom.machine import usable_cores
    from torchloom.serve.model import ServedModel

    _check_paths(input_path, output_path, overwrite, local_only=True)
    fmt = input_format(input_path)
    schema, batches = _local_batches(input_path, fmt)
    text_column = column_named(schema.names, text_column) or text_column  # "Text" for text
    text_is_string = text_column in schema.names and _is_text(schema.field(text_column).type)
    _check_schema(schema.names, text_is_string, text_column, input_path)
    out = Path(output_path)
    tmp = _writable_tmp(out)
    model = ServedModel(model_dir, device=device, batch_size=batch_size, threads=usable_cores(), runtime=runtime)
    if model.multi_label and "labels" in schema.names:
        raise UserError(f"--input {input_path}: has a column 'labels', which a multi-label model's predictions add;"
                        " rename that column in the input")

    started = last_report = time.perf_counter()
    rows = 0
    try:
        with pq.ParquetWriter(tmp, _with_predictions(schema, model.multi_label)) as writer:
            for batch in batches:
                if batch.num_rows:
                    writer.write_batch(predict_record_batch(model, batch, text_column))
                rows += batch.num_rows
                if progress and time.perf_counter() - last_report > 10:
                    last_report = time.perf_counter()
                    print(f"predict: {rows} rows ({rows / (last_report - started):.0f}/s)", flush=True)
        _replace(tmp, out)
        record_output(out)
    finally:
        tmp.unlink(missing_ok=True)
    return {"rows": rows, "seconds": round(time.perf_counter() - started, 2), "output": str(out)}


def _writable_tmp(out: Path) -> Path:
    """The temporary file beside `out` the local engine writes, once its directory has taken (and given back) a
    file: an --output that cannot be written is one line before the model loads."""
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        open(tmp, "wb").close()
        tmp.unlink()
    except OSError as e:
        why = ("a part of its path is a file, not a directory" if isinstance(e, FileExistsError | NotADirectoryError)
               else e.strerror)
        raise UserError(f"--output {out}: cannot write there ({why}); choose an --output whose parent is a"
                        " directory you may write") from None
    return tmp


def _replace(tmp: Path, out: Path) -> None:
    if out.is_dir() and not out.is_symlink():  # --overwrite of an earlier Spark output (check_output: all ours)
        shutil.rmtree(out)
    os.replace(tmp, out)
