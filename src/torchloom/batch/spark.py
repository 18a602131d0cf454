"""Batch prediction on Spark: `mapInArrow` over the input, the model loaded once per executor Python process and
reused by every task that process runs; the input read as prepare reads it (its encoding, its headers), the
output written whole. What both engines share is batch/files.py's."""

from __future__ import annotations

import os
import shutil
import sys
import time
import warnings
from collections.abc import Iterable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

from torchloom.batch.files import (
    _check_paths,
    _check_schema,
    _local,
    predict_record_batch,
)
from torchloom.errors import UserError, first_line
from torchloom.inputs.encoding import decoded_as, file_codec, head_text, read_note
from torchloom.inputs.text_files import data_files, input_format
from torchloom.runs.outputs import record_output
from torchloom.text.formats import SUFFIX_FORMATS, column_named, default_separator, separator_in
from torchloom.uri import has_scheme, is_uri

# One model per (executor) Python process, kept across tasks: Spark reuses its Python workers.
_MODELS: dict[tuple[str, str, int, str], Any] = {}


def _executor_model(model_dir: str, device: str, batch_size: int, runtime: str = "torch"):
    key = (model_dir, device, batch_size, runtime)
    model = _MODELS.get(key)
    if model is None:
        from pyspark import TaskContext

        from torchloom.model.served import ServedModel

        if is_uri(model_dir):  # a model on a store: this executor's host fetches it once into its own cache
            from torchloom.model_cache import fetch_dir

            model_dir = str(fetch_dir(model_dir, "--model"))

        context = TaskContext.get()
        # Each concurrent task gets its own Python worker; give each the cores its task was granted.
        threads = context.cpus() if context is not None else 1
        model = _MODELS[key] = ServedModel(model_dir, device=task_device(device, context), batch_size=batch_size,
                                           threads=threads, runtime=runtime)
    return model


def task_device(device: str, context) -> str:
    """The device of a Spark task's model: --device auto or cuda becomes the GPU Spark assigned the task
    (spark.task.resource.gpu.amount: `resources()["gpu"]`), so the tasks of a multi-GPU executor spread over its
    GPUs instead of all taking cuda:0; cpu, a pinned cuda:N, or a task Spark gave no GPU keeps what it was."""
    gpu = (context.resources().get("gpu") if context is not None else None) if device in ("auto", "cuda") else None
    return f"cuda:{gpu.addresses[0]}" if gpu is not None and gpu.addresses else device


def _predict_partition(batches: Iterable[Any], model_dir: str, text_column: str, device: str,
                       batch_size: int, runtime: str = "torch") -> Iterator[Any]:
    model = _executor_model(model_dir, device, batch_size, runtime)
    for batch in batches:
        if batch.num_rows:
            yield predict_record_batch(model, batch, text_column)


# Java's names for the codecs inputs/encoding.py may choose; a file with stray bytes reads as UTF-8 (Spark puts U+FFFD)
JAVA_CHARSETS = {"utf-8-sig": "UTF-8", "utf-8-replaced": "UTF-8", "cp1252": "windows-1252",
                 "latin-1": "ISO-8859-1", "utf-16": "UTF-16"}


CHARSET_CHECK_BYTES = 8 << 30  # a larger local input is read as UTF-8 unchecked, as prepare's (inputs/locate.py)


def _local_inputs(path: str, fmt: str) -> list[Path] | None:
    """The `fmt` files of a local --input (a file, or a directory's files with that suffix); None for a URI."""
    if is_uri(path):
        return None
    p = Path(path.removeprefix("file:"))
    return [f for f in data_files(p) if SUFFIX_FORMATS.get(f.suffix.lower()) == fmt] if p.is_dir() else [p]


def _spark_charset(path: str, fmt: str) -> str:
    """The charset Spark reads a local CSV or JSON lines input in: its files' codec as prepare's data.encoding
    auto decides it (one line says so where it is not UTF-8); a local input whose files differ, or JSON lines
    that are not UTF-8, is one line with the fix. A URI, or local files over 8 GB together: UTF-8 (unchecked)."""
    files = _local_inputs(path, fmt) if fmt in ("csv", "jsonl") else None
    if files is None or sum(f.stat().st_size for f in files) > CHARSET_CHECK_BYTES:
        return "UTF-8"
    codecs = {f: file_codec(str(f)) for f in files}
    charsets = {JAVA_CHARSETS.get(codec, codec) for codec in codecs.values()}
    odd = next((f for f, codec in codecs.items() if JAVA_CHARSETS.get(codec) != "UTF-8"), None)
    if odd is None:
        return "UTF-8"
    if len(charsets) > 1 or fmt == "jsonl":
        raise UserError(f"--input {path}: {odd} is {decoded_as(codecs[odd])}"
                        + (", unlike the other files" if len(charsets) > 1 else "")
                        + "; predict it with --score-with local, or re-encode it as UTF-8 for Spark")
    print(f"predict: {read_note(f'--input {path}', codecs[odd])}", file=sys.stderr, flush=True)
    return charsets.pop()


def _same_headers(path: str, sep: str) -> None:
    """The CSV files of a local input directory name one set of columns in one order: Spark takes each file's
    columns by position (the local engine selects them by name)."""
    import csv
    import io

    first: tuple[list[str], Path] | None = None
    for f in _local_inputs(path, "csv") or []:
        try:
            text = io.StringIO(head_text(str(f)), newline="")  # the header in the file's own encoding
        except ValueError:  # a compression only Spark reads: not checked
            continue
        names = [n.replace("\ufeff", "").strip().lower() for n in next(csv.reader(text, delimiter=sep), [])]
        if first is None:
            first = (names, f)
        elif names != first[0]:
            raise UserError(f"--input {f}: its header ({', '.join(names)[:200]}) differs from that of {first[1]}"
                            f" ({', '.join(first[0])[:200]}), and Spark reads columns by position; give every"
                            " file the same header, or predict with --score-with local (which reads by name)")


def spark_read(spark, path: str, fmt: str):
    reader = spark.read
    if fmt == "csv":
        charset = _spark_charset(path, fmt)
        if charset == "windows-1252":  # Spark 4 takes only a few charsets unless this legacy switch allows Java's
            spark.conf.set("spark.sql.legacy.javaCharsets", "true")

        def csv(sep: str):
            return (reader.option("header", True).option("multiLine", True).option("escape", '"')
                    .option("encoding", charset).option("sep", sep).csv(path))

        df = csv(default_separator(path))
        other = separator_in(df.columns, default_separator(path))  # a ";" or tab export: its header says so
        df = csv(other) if other else df
        _same_headers(path, other or default_separator(path))
        renamed = [c.replace("\ufeff", "").strip() for c in df.columns]
        return df.toDF(*renamed) if renamed != df.columns else df
    if fmt == "jsonl":
        _spark_charset(path, fmt)
        return reader.json(path)
    return reader.parquet(path)


def predict_spark(spark, model_dir: str, input_path: str, output_path: str, text_column: str = "text",
                  batch_size: int = 32, device: str = "cpu", overwrite: bool = False,
                  runtime: str = "torch", model_uri: str | None = None) -> dict[str, Any]:
    """Predict every row of `input_path` with Spark into the Parquet directory `output_path`.

    model_uri: where `model_dir` (the driver's checked copy) came from on a store; the executors then fetch
    the model from there into their own hosts' caches (hosts that share no directory with the driver's)."""
    from pyspark.errors import AnalysisException
    from pyspark.sql.types import ArrayType, DoubleType, MapType, StringType, StructField, StructType

    from torchloom.model.export import check_exported

    check_exported(model_dir)
    from torchloom.model.export import read_export_info

    tagged = read_export_info(model_dir).get("task") == "multi_label"  # its predictions add `labels`
    if runtime == "onnx":
        from torchloom.model.onnx import onnx_file

        onnx_file(model_dir)  # here, before a job whose every task would fail on it
    _check_paths(input_path, output_path, overwrite, local_only=False)
    # executors may run elsewhere: in the same file system, or fetching from the store themselves
    model_dir = model_uri or os.path.abspath(model_dir)
    fmt = (input_format(input_path) if not has_scheme(input_path)
           else SUFFIX_FORMATS.get(Path(input_path).suffix, "parquet"))
    started = time.perf_counter()
    try:
        df = spark_read(spark, input_path, fmt)
    except AnalysisException as e:
        raise UserError(f"--input {input_path}: Spark cannot read it as {fmt} ({first_line(e)})") from None
    fields = {f.name: f.dataType for f in df.schema.fields}
    text_column = column_named(list(fields), text_column) or text_column  # "Text" for text
    _check_schema(list(fields), isinstance(fields.get(text_column), StringType), text_column, input_path)
    if tagged and "labels" in fields:
        raise UserError(f"--input {input_path}: has a column 'labels', which a multi-label model's predictions add;"
                        " rename that column in the input")
    out_schema = StructType([*df.schema.fields, StructField("label", StringType()),
                             StructField("score", DoubleType()),
                             StructField("probabilities", MapType(StringType(), DoubleType())),
                             *([StructField("labels", ArrayType(StringType()))] if tagged else [])])
    predict = partial(_predict_partition, model_dir=model_dir, text_column=text_column, device=device,
                      batch_size=batch_size, runtime=runtime)
    with warnings.catch_warnings():  # mapInArrow warns of pandas 3 on every call; nothing here uses pandas
        warnings.filterwarnings("ignore", "PySpark does not yet fully support pandas", FutureWarning)
        result = df.mapInArrow(predict, out_schema)
    _spark_write(spark, result, input_path, output_path, overwrite)
    rows = spark.read.parquet(output_path).count()
    return {"rows": rows, "seconds": round(time.perf_counter() - started, 2), "output": output_path}


def _spark_write(spark, result, input_path: str, output_path: str, overwrite: bool) -> None:
    """Write the predictions; the output's own file-system error (its parent a file, no permission, no
    space) is one line naming --output, a file of the input that a task cannot read (a damaged Parquet
    file) one line naming --input and that file, and a directory this write began is removed again."""
    from py4j.protocol import Py4JJavaError

    from torchloom.java_errors import unreadable_input

    local = _local(output_path)
    existed = local is not None and os.path.lexists(local)
    try:
        result.write.mode("overwrite" if overwrite else "errorifexists").parquet(output_path)
    except Py4JJavaError as e:
        unreadable = unreadable_input(f"--input {input_path}", e)
        if not unreadable and not _is_io_error(spark, e):  # a task's failure (the model): Spark's own error says it
            raise
        if local is not None and not existed and os.path.isdir(local):
            shutil.rmtree(local, ignore_errors=True)
        if unreadable:
            raise unreadable from None
        raise UserError(f"--output {output_path}: Spark cannot write there ({_java_line(e)}); choose an --output"
                        " whose parent is a directory you may write") from None
    if local is not None:
        record_output(local)  # a later --overwrite may replace these, and only these


def _is_io_error(spark, e) -> bool:
    """Is the Java exception itself (not a failed task's, which Spark wraps) a java.io.IOException?"""
    from py4j.protocol import Py4JError

    try:
        io_error = spark._jvm.java.lang.Class.forName("java.io.IOException")
        return bool(io_error.isInstance(e.java_exception))
    except (Py4JError, AttributeError):  # no gateway (gone, or Spark Connect): not the output path
        return False


def _java_line(e) -> str:
    """The Java exception as `SimpleName: message`, first line only, at most 150 characters."""
    from py4j.protocol import Py4JError

    try:
        java = e.java_exception
        line = f"{java.getClass().getSimpleName()}: {java.getMessage()}"
    except Py4JError:
        line = first_line(e)
    line = line.strip().splitlines()[0] if line.strip() else type(e).__name__
    return line if len(line) <= 150 else line[:147] + "..."
