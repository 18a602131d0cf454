"""Batch prediction over files: CSV, JSONL or Parquet in, Parquet out with every input column plus
label, score and probabilities (a map label -> probability).

Local: pyarrow streams the input in record batches through one model, so the file can be larger than
memory. Spark (batch/spark.py): `mapInArrow` over the input, the model loaded once per executor Python process
and reused by every task that process runs. Rows whose text is null get null predictions. This module holds what
both share (the input's format, the paths' checks, the Arrow columns of the predictions) and the local engine.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

from torchloom.errors import UserError
from torchloom.inputs.text_files import input_format, stream_batches
from torchloom.runs.outputs import check_output, record_output
from torchloom.text.formats import (
    column_named,
    text_column_hint,
)
from torchloom.uri import has_scheme, is_uri

PREDICTION_COLUMNS = ("label", "score", "probabilities")


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
def _is_text(arrow_type) -> bool:
    import pyarrow as pa

    return pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type)


def predict_local(model_dir: str, input_path: str, output_path: str, text_column: str = "text",
                  batch_size: int = 32, device: str = "cpu", overwrite: bool = False,
                  progress: bool = True, runtime: str = "torch") -> dict[str, Any]:
    """Predict every row of `input_path` into one Parquet file `output_path`; returns rows and seconds."""
    import pyarrow.parquet as pq

    from torchloom.machine import usable_cores
    from torchloom.model.served import ServedModel

    _check_paths(input_path, output_path, overwrite, local_only=True)
    fmt = input_format(input_path)
    schema, batches = stream_batches(input_path, fmt)
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
