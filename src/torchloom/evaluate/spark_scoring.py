"""A prepared split scored by Spark tasks (eval.score_with; evaluate/run.py decides): the model in memory is sent to
every executor once (a broadcast; on Spark Connect, inside the task's function), each task scores a range of the
split's rows that starts at a multiple of eval.batch_size, and the driver puts the ranges back in order. The ranges'
batches are the batches one process scoring the whole split makes (data/eval_rows.py), so the logits, and every
number computed from them, are the same whoever scored them (tests/test_spark_scoring.py compares them).

What comes back to the driver is the logits (4 bytes a class a row), the labels and the positions: 0.8 GB for 10 M
rows of 20 classes, what the metrics, the calibration and the misclassified rows are computed from."""

from __future__ import annotations

import hashlib
import io
import math
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from typing import Any

import numpy as np

from torchloom.config import Config
from torchloom.errors import UserError
from torchloom.manifest import Manifest
from torchloom.tag_scoring import concat_labels

TASK_ROWS = 65_536  # a task's rows at most: its logits come back as one value (5 MB at 20 classes)
CONNECT_MODEL_BYTES = 100 << 20  # Spark Connect sends the task's function in one gRPC message (128 MB at most)

# One model per executor Python process and model (Spark reuses its Python workers across tasks).
_MODELS: dict[str, Any] = {}


def shares(rows: int, batch_size: int, tasks: int) -> list[tuple[int, int]]:
    """(first row, rows) of each task's range: about `tasks` of them (more where a range would pass TASK_ROWS), each
    a whole number of batches but the last."""
    if rows <= 0:
        return []
    per = min(max(math.ceil(rows / max(1, tasks)), batch_size), max(TASK_ROWS, batch_size))
    per = math.ceil(per / batch_size) * batch_size
    return [(start, min(per, rows - start)) for start in range(0, rows, per)]


def _parallelism(spark) -> int:
    try:
        return int(spark.sparkContext.defaultParallelism)
    except Exception:  # Spark Connect has no SparkContext
        try:
            return int(spark.conf.get("spark.default.parallelism", "2"))
        except Exception:
            return 2


def _classic(spark) -> bool:
    try:
        return spark.sparkContext is not None  # Spark Connect raises here
    except Exception:
        return False


def split_logits(cfg: Config, model, manifest: Manifest, split: str, spark, say: Callable[[str], None]
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(logits, labels, row positions) of every row of `split`, in file order, scored by Spark tasks; manifest: the
    one the executors read (a store's URIs on a cluster); say: where the progress lines go."""
    import torch

    rows = manifest.split(split).rows
    ranges = shares(rows, cfg.eval.batch_size, 2 * _parallelism(spark))
    if not ranges:
        return np.zeros((0, manifest.num_labels), np.float32), np.zeros(0, np.int64), np.zeros(0, np.int64)
    buffer = io.BytesIO()
    torch.save(model.to("cpu").eval(), buffer)
    payload = buffer.getvalue()
    key = hashlib.sha256(payload).hexdigest()[:20]
    if _classic(spark):
        sent: Any = spark.sparkContext.broadcast(payload)
    elif len(payload) > CONNECT_MODEL_BYTES:
        raise UserError(f"eval.score_with spark: the model is {len(payload) >> 20} MB, more than Spark Connect sends"
                        f" with a task ({CONNECT_MODEL_BYTES >> 20} MB); set eval.score_with process")
    else:
        sent = payload
    started = time.perf_counter()
    say(f"scoring {split}'s {rows:,} rows with Spark, {len(ranges)} tasks of up to {ranges[0][1]:,} rows")
    task = partial(_score_tasks, ranges=ranges, sent=sent, key=key, cfg=cfg, manifest=manifest, split=split)
    with warnings.catch_warnings():  # pandas 3: PySpark's own notice, about what mapInArrow does not use
        warnings.filterwarnings("ignore", "PySpark does not yet fully support pandas", FutureWarning)
        frame = spark.range(len(ranges), numPartitions=len(ranges)).mapInArrow(task, "share long, arrays binary")
    done = frame.collect()
    got = {int(r["share"]): np.load(io.BytesIO(r["arrays"])) for r in done}
    if sorted(got) != list(range(len(ranges))):
        raise RuntimeError(f"Spark scoring of {split}: {len(got)} of {len(ranges)} ranges came back")
    parts = [got[i] for i in range(len(ranges))]
    if not isinstance(sent, bytes):
        sent.unpersist()
    seconds = time.perf_counter() - started
    say(f"{split} scored with Spark in {seconds:.1f} s ({rows / max(seconds, 1e-9):,.0f} rows/s)")
    return (np.concatenate([p["logits"] for p in parts]), concat_labels([p["labels"] for p in parts]),
            np.concatenate([p["index"] for p in parts]))


def _executor_model(key: str, sent):
    model = _MODELS.get(key)
    if model is None:
        import torch

        payload = sent if isinstance(sent, bytes) else sent.value
        model = _MODELS[key] = torch.load(io.BytesIO(payload), weights_only=False)
    return model


def _task_device(setting: str):
    """The task's device: the GPU Spark gave the task (batch/spark.py's task_device), else engine.device's rule."""
    import torch
    from pyspark import TaskContext

    from torchloom.batch.spark import task_device

    where = task_device(setting, TaskContext.get())
    if where in ("auto", "cuda"):
        where = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(where)


def _score_tasks(batches: Iterable[Any], ranges: list[tuple[int, int]], sent, key: str, cfg: Config,
                 manifest: Manifest, split: str) -> Iterator[Any]:
    import pyarrow as pa
    import torch
    from pyspark import TaskContext

    from torchloom.evaluate.logits import range_logits

    context = TaskContext.get()
    torch.set_num_threads(max(1, context.cpus() if context is not None else 1))
    device = _task_device(cfg.engine.device)
    model = _executor_model(key, sent).to(device).eval()
    schema = pa.schema([("share", pa.int64()), ("arrays", pa.binary())])
    for batch in batches:
        for share in batch.column(0).to_pylist():
            start, count = ranges[share]
            logits, labels, index = range_logits(cfg, model, manifest, split, start, count, device)
            out = io.BytesIO()
            np.savez(out, logits=logits, labels=labels, index=index)
            yield pa.RecordBatch.from_pydict({"share": [share], "arrays": [out.getvalue()]}, schema=schema)
