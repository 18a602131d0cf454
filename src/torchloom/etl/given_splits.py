"""Prepare's input as Spark reads it: spread over partitions of bounded size (cleaning runs on every core, no task
holds a whole big file), with the split each row comes with where the user gave splits (a split column, or
data.val_path / data.test_path). etl/prepare.py runs the job."""

from __future__ import annotations

from torchloom.inputs.locate import resolve_format
from torchloom.inputs.read import read_input

# split column values, lower-cased and trimmed, and the split each means
GIVEN_SPLITS = {"train": "train", "training": "train", "val": "val", "valid": "val", "validation": "val",
                "dev": "val", "test": "test", "testing": "test"}


def given_source(job) -> str:
    """Where the given splits come from, for messages (job: prepare's _Job)."""
    cfg = job.cfg
    if cfg.data.split_column:
        return f"column {cfg.data.split_column!r}"
    return ", ".join(f"{name} from {job.name(path)}" for name, path in (("val", cfg.data.val_path),
                                                                          ("test", cfg.data.test_path)) if path)


def with_given(job, raw, width: int):
    """The input with `given`, the split each row comes with: the split column's value (null when it is
    none of GIVEN_SPLITS), or train for data.path and val/test for data.val_path / data.test_path."""
    from functools import reduce

    from pyspark.sql import functions as F

    spark, cfg, say = job.spark, job.cfg, job.say
    if cfg.data.split_column:
        names = F.create_map(*[F.lit(x) for pair in GIVEN_SPLITS.items() for x in pair])
        return raw.withColumn("given", names[F.lower(F.trim(F.col("given")))])
    parts = [raw.withColumn("given", F.lit("train"))]
    for name, path in (("val", cfg.data.val_path), ("test", cfg.data.test_path)):
        if path:
            fmt = resolve_format(cfg.data, path)
            say(f"reading {job.name(path)} ({fmt}) as the {name} split")
            parts.append(spread(read_input(spark, cfg.data, path, fmt, cfg.prepare.input_reader,
                                            job.tables.get(path), say), width, fmt).withColumn("given", F.lit(name)))
    return reduce(lambda a, b: a.unionByName(b), parts)


def leaked_by_split(stats: list[dict]) -> dict[str, int]:
    """Rows set aside as leaked, per split (prepare.leakage drop)."""
    out = {"val": 0, "test": 0}
    for row in stats:
        if row["status"] == "leaked":
            out[row["given"]] += row["n"]
    return out


SPLITTABLE = ("parquet", "delta")  # formats read in bounded splits (128 MB) whatever the file size
TYPED = ("parquet", "delta", "iceberg")  # typed strings: a U+FFFD in them was written, not a decoding error


def spread(raw, cores: int, fmt: str = ""):
    """`raw` over partitions of bounded size, at least `cores` of them, so that cleaning (Python) runs
    on every core and no task holds a whole big file.

    A CSV or JSON read with multiLine (needed for quoted line breaks) is one task per file: one big file
    was cleaned on one core while the others waited, and 10 million rows in one file, spread over
    2 x cores partitions, were 1.3 GB each and ran the 1 GB local JVM out of heap. Hash-partitioning on
    the raw text with no fixed count lets adaptive execution size the partitions (session.py); it costs
    a shuffle of the input but no sort, and gives the same rows to the same partitions on every run.
    """
    try:
        if fmt in SPLITTABLE and raw.rdd.getNumPartitions() >= cores:
            return raw
    except Exception:  # Spark Connect has no RDDs: spread anyway
        pass
    return raw.repartition("text")
