"""prepare's writes: into a temporary sibling of the output, swapped in at the end (make_tmp, publish); the
rejected rows; and the kept rows split, tokenized and written as the shards of train/, val/ and test/, each
split's files renamed part-NNNNN.parquet and counted for the manifest."""

from __future__ import annotations

import contextlib
import math
import os
import secrets
import shutil
from pathlib import Path

from torchloom.config.schema import PrepareConfig
from torchloom.errors import UserError
from torchloom.etl.clean import REASONS
from torchloom.etl.session import default_partitions
from torchloom.etl.split import KEPT, assign_splits
from torchloom.etl.tag_split import with_masks
from torchloom.etl.tokenize import TOKENIZED_SCHEMA, tokenize_batches
from torchloom.manifest import SPLITS, Shard, Split

REJECTED_ROWS_PER_FILE = 1_000_000
SHARD_ROWS = 500_000  # with prepare.partitions 0, at least one output task (and shard) per this many rows


def make_tmp(out: Path) -> Path:
    """The temporary sibling of `out` that prepare writes into (its parents made as needed)."""
    tmp = out.parent / f"{out.name}.tmp-{secrets.token_hex(4)}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    except OSError as e:
        raise UserError(f"output {out}: cannot be created ({e.strerror}); choose another --output.dir") from None
    return tmp


def publish(tmp: Path, out: Path) -> None:
    """Swap the finished temp dir in for `out` (the old one is moved aside first, then removed)."""
    old = None
    if out.exists():
        old = out.parent / f"{out.name}.old-{secrets.token_hex(4)}"
        os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def write_rejected(marked, out: Path, rows: int, store: str | None = None) -> None:
    """Rejected rows, with the original text and the reason, as Parquet under `out` (through `store`: see
    prepare)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from pyspark.sql import functions as F

    rejected = marked.filter(F.col("status").isin(*REASONS)).select(
        F.coalesce("raw", "text").alias("text"), "label", F.col("status").alias("reason"), "source"
    )
    if rows == 0:  # nothing to find: an empty file with the schema, without a Spark job over every row
        out.mkdir()
        schema = pa.schema([(name, pa.string()) for name in rejected.columns])
        pq.write_table(schema.empty_table(), out / "part-00000.parquet")
        return
    if rows <= REJECTED_ROWS_PER_FILE // 10:
        # A few rows: fetched and written by the driver (one scan of the cached rows; a Spark write
        # job with its shuffle and commit took 1.1 s for BBC News's one rejected file).
        out.mkdir()
        pq.write_table(rejected.toArrow(), out / "part-00000.parquet")
        return
    # repartition, not coalesce: coalesce(1) would scan every input row in one task to find the few
    # rejected ones; this scans on every core and moves only the rejected rows.
    spread = rejected.repartition(max(1, math.ceil(rows / REJECTED_ROWS_PER_FILE)))
    if store:
        from torchloom.etl.store_write import write_parquet

        write_parquet(spread, out, store, REJECTED_ROWS_PER_FILE)
    else:
        spread.write.parquet(str(out))
    _tidy(out)


def write_splits(spark, marked, plans, p: PrepareConfig, info: dict, tokenizer_json: str, tmp: Path, *,
                 rows: int, sizes: dict[tuple[str, int], int], given: dict[tuple[str, str], int] | None,
                 store: str | None = None, tags: list[str] | None = None) -> dict[str, Split]:
    """Split + tokenize + write the kept rows of `marked` into tmp/train, val and test: one job.

    The split's window shuffle makes the `parts` partitions (one shard per split each); inside a partition
    rows are put in a seeded pseudo-random order, so shards are not runs of one class (the loader shuffles
    within bounded windows) and the same input and seed give the same shards. Up to 3 concurrent writers per
    task (one per split) spare the writer's sort by split, which would also undo that order.

    rows: the kept rows; sizes: the train rows the plans carve, per (label, split-rank bucket); given: the kept
    rows per (split, label) that the input gives as val or test (None: the input gives no split); info: the
    tokenizer's record (lengths.choose_length); store: see prepare; tags: a multi-label run's labels (the plans
    are then its strata, and label_id each row's tag set: etl/tag_split.py).
    """
    from pyspark.sql import functions as F

    # shards per split: 2 x cores, or one per SHARD_ROWS kept rows when that is more
    wide = p.partitions or max(default_partitions(p), math.ceil(rows / SHARD_ROWS))
    parts = max(1, min(wide, math.ceil(rows / p.rows_per_group)))
    keep = ("tags",) if tags is not None else ()
    assigned = _assigned(marked.filter(F.col("status") == KEPT), plans, p.seed, sizes, given, parts, keep)
    schema = TOKENIZED_SCHEMA
    if tags is not None:
        assigned = with_masks(assigned, tags)
        schema = TOKENIZED_SCHEMA.replace("label_id int", "label_id array<int>")
    order = F.xxhash64(F.lit("order"), F.lit(p.seed), "text")
    spark_out = tmp / "_spark"
    shipped = _broadcast(spark, tokenizer_json)
    try:
        tokenized = assigned.sortWithinPartitions(order, "text").mapInArrow(
            tokenize_batches(shipped, info["hash"], info["max_length"], p.truncation, info.get("stride", 0),
                             p.max_chunks), schema
        )
        _write(spark, tokenized, spark_out, p.rows_per_group, store)
    finally:
        shipped.destroy()
    given = given or {}
    expected = {
        "train": {plan.label: plan.train for plan in plans},
        "val": {plan.label: plan.val + given.get(("val", plan.label), 0) for plan in plans},
        "test": {plan.label: plan.test + given.get(("test", plan.label), 0) for plan in plans},
    }
    chunked = p.truncation == "chunks"
    splits = {name: _collect_split(spark_out / f"split={name}", tmp / name, tmp, expected[name], chunked)
              for name in SPLITS}
    shutil.rmtree(spark_out)
    return splits


def _assigned(kept, plans, seed: int, sizes: dict, given: dict | None, parts: int, keep: tuple[str, ...] = ()):
    """The kept rows with their split and label id, over `parts` partitions: the plans carve the train rows
    (all of them when the input gives no split; else the user's val/test rows keep their split and train
    rows are carved only for a missing val)."""
    from pyspark.sql import functions as F

    if given is None:
        return assign_splits(kept, plans, seed, sizes=sizes, partitions=parts, keep=keep)
    labels = [plan.label for plan in plans]
    assigned = assign_splits(kept.filter(F.col("given") == "train"), plans, seed, sizes=sizes, partitions=parts,
                             keep=keep)
    label_map = F.create_map(*[F.lit(x) for i, label in enumerate(labels) for x in (label, i)])
    return assigned.unionByName(
        kept.filter(F.col("given") != "train")
        .select("text", "label", label_map[F.col("label")].cast("int").alias("label_id"),
                F.col("given").alias("split"), *keep))


def _write(spark, tokenized, out: Path, rows_per_group: int, store: str | None) -> None:
    """The tokenized rows as Parquet under out/split=NAME/ (through `store`: see prepare)."""
    if store:
        from torchloom.etl.store_write import write_parquet

        write_parquet(tokenized, out, store, rows_per_group, partition_by="split")
    else:
        with _sql_conf(spark, {"spark.sql.maxConcurrentOutputFileWriters": str(len(SPLITS))}):
            (tokenized.write.option("parquet.block.row.count.limit", rows_per_group)
             .partitionBy("split").parquet(str(out)))


@contextlib.contextmanager
def _sql_conf(spark, values: dict[str, str]):
    """Set session SQL conf for the block, then restore what was there."""
    before = {key: spark.conf.get(key, None) for key in values}
    for key, value in values.items():
        spark.conf.set(key, value)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                spark.conf.unset(key)
            else:
                spark.conf.set(key, value)


class _Shipped:
    """A value shipped inside the task closure: what a broadcast is under Spark Connect, which has none."""

    def __init__(self, value):
        self.value = value

    def destroy(self) -> None:
        pass


def _broadcast(spark, value):
    try:
        return spark.sparkContext.broadcast(value)
    except Exception:
        return _Shipped(value)


def _tidy(directory: Path) -> list[Path]:
    """Remove Spark's _SUCCESS and .crc files; returns the Parquet files, sorted."""
    files = []
    for f in sorted(directory.iterdir()):
        if f.name.startswith(("_", ".")):
            f.unlink()
        elif f.suffix == ".parquet":
            files.append(f)
    return files


def _collect_split(src: Path, dest: Path, root: Path, expected: dict[str, int], chunked: bool = False) -> Split:
    """Move one split's files to `dest` as part-NNNNN.parquet, reading rows per row group from footers.

    chunked: rows are windows of texts; the texts (rows with chunk 0) are counted per class and checked
    against `expected`, and per_class holds the windows."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    dest.mkdir()
    shards = []
    files = _tidy(src) if src.is_dir() else []
    texts: dict[str, int] = {}
    windows: dict[str, int] = {}
    for f in files:
        meta = pq.ParquetFile(f).metadata
        if meta.num_rows == 0:
            f.unlink()
            continue
        if chunked:
            table = pq.read_table(f, columns=["label", "chunk"])
            for label, n in zip(*_value_counts(table.column("label"))):
                windows[label] = windows.get(label, 0) + n
            for label, n in zip(*_value_counts(table.filter(pc.equal(table.column("chunk"), 0)).column("label"))):
                texts[label] = texts.get(label, 0) + n
        target = dest / f"part-{len(shards):05d}.parquet"
        os.replace(f, target)
        groups = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
        shards.append(Shard(path=str(target.relative_to(root)), rows=meta.num_rows, row_groups=groups))
    rows = sum(s.rows for s in shards)
    per_class = {label: n for label, n in expected.items() if n}
    documents = sum(texts.values()) if chunked else rows
    if documents != sum(per_class.values()) or (chunked and texts != per_class):  # an internal error, not the user's
        raise RuntimeError(f"{dest}: wrote {documents} texts, expected {sum(per_class.values())}")
    if chunked:
        per_class = {label: windows[label] for label in per_class}
    return Split(rows=rows, shards=shards, per_class=per_class, documents=documents if chunked else 0)


def _value_counts(column) -> tuple[list[str], list[int]]:
    counts = column.value_counts()
    return counts.field("values").to_pylist(), counts.field("counts").to_pylist()
