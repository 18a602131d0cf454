"""Conflicting labels, exact duplicates, and the deterministic stratified train/val/test split."""

from __future__ import annotations

import math
from dataclasses import dataclass

from torchloom.errors import UserError

KEPT = "kept"
DUPLICATE = "duplicate"


def mark_duplicates(cleaned):
    """Add `status`: a rejection reason, DUPLICATE (same text and label seen before) or KEPT.

    A text seen with two or more labels is ambiguous, so all of its rows become conflicting_labels.
    """
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    valid = F.col("reason").isNull()
    by_text = Window.partitionBy("text")
    # Which copy of a duplicate stays does not matter (they are equal after cleaning); ordering by
    # source and raw text only makes the rejected/kept bookkeeping repeatable.
    by_text_label = Window.partitionBy("text", "label").orderBy("source", "raw")
    n_labels = F.size(F.collect_set(F.when(valid, F.col("label"))).over(by_text))
    copy = F.row_number().over(by_text_label)
    status = (
        F.when(~valid, F.col("reason"))
        .when(n_labels > 1, F.lit("conflicting_labels"))
        .when(copy > 1, F.lit(DUPLICATE))
        .otherwise(F.lit(KEPT))
    )
    return cleaned.withColumn("status", status)


@dataclass
class ClassSplit:
    label: str
    rows: int
    val: int
    test: int

    @property
    def train(self) -> int:
        return self.rows - self.val - self.test


def _share(n: int, fraction: float) -> int:
    if fraction <= 0:
        return 0
    return max(1, math.floor(n * fraction + 0.5))  # round half up; at least one row per non-empty split


def plan_split(per_label: dict[str, int], val_fraction: float, test_fraction: float,
               where: str) -> list[ClassSplit]:
    """Rows per split for each label (sorted), or a UserError naming a class too small to split."""
    if val_fraction + test_fraction >= 1:
        raise UserError(
            f"prepare.val_fraction {val_fraction} + prepare.test_fraction {test_fraction} leave no training"
            " rows; make their sum less than 1"
        )
    plans = []
    needed = 1 + (val_fraction > 0) + (test_fraction > 0)
    for label in sorted(per_label):
        n = per_label[label]
        plan = ClassSplit(label, n, _share(n, val_fraction), _share(n, test_fraction))
        if plan.train < 1:
            raise UserError(
                f"data.path {where}: class {label!r} has {n} usable row(s), fewer than the {needed} needed for"
                " one row in each of train/val/test; remove the class, add rows, or set"
                " --prepare.val_fraction / --prepare.test_fraction to 0"
            )
        plans.append(plan)
    return plans


# At most this many (label, hash bucket) groups: their row counts are collected on the driver.
MAX_RANK_GROUPS = 1 << 16


def rank_bucket_bits(n_labels: int) -> int:
    """Bits of the row hash that cut each class into buckets, so labels x buckets <= MAX_RANK_GROUPS."""
    return max(0, MAX_RANK_GROUPS.bit_length() - 1 - max(0, n_labels - 1).bit_length())


def assign_splits(kept, plans: list[ClassSplit], seed: int):
    """Add label_id and split to the kept rows; membership depends only on seed, text and label.

    Within each label, rows are ordered by a seeded hash of the cleaned text (the text itself breaks
    ties); the first `test` rows go to test, the next `val` to val, the rest to train.

    Ranking a whole class in one window would put each class on one task: one core sorting 20 million
    rows of a 100-million-row, 5-class input. Instead each class is cut into buckets by the top bits
    of the same hash (a bucket's rows all sort before the next bucket's), the buckets' sizes are
    counted, and a row's rank is its bucket's offset in the class plus its place inside the bucket:
    the same ranks, from windows spread over every task.
    """
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    spark = kept.sparkSession
    bits = rank_bucket_bits(len(plans))
    labels = spark.createDataFrame([(p.label, i) for i, p in enumerate(plans)], "label string, label_id int")
    keyed = (
        kept.select("text", "label")
        .join(F.broadcast(labels), "label")
        .withColumn("h", F.xxhash64(F.lit(seed), F.col("text")))
        # Arithmetic shift of a signed 64-bit hash: the bucket grows with h, so buckets sort like rows.
        .withColumn("bucket", F.shiftright(F.col("h"), 64 - bits) if bits else F.lit(0))
    )
    sizes = sorted((r.label_id, r.bucket, r.n) for r in keyed.groupBy("label_id", "bucket")
                   .agg(F.count(F.lit(1)).alias("n")).collect())
    offsets, before, current = [], 0, None
    for label_id, bucket, n in sizes:
        if label_id != current:
            before, current = 0, label_id
        plan = plans[label_id]
        offsets.append((label_id, bucket, before, plan.test, plan.test + plan.val))
        before += n
    table = spark.createDataFrame(offsets, "label_id int, bucket long, offset long, test_end long, val_end long")
    order = Window.partitionBy("label_id", "bucket").orderBy("h", "text")
    rank = F.col("offset") + F.row_number().over(order)
    split = (
        F.when(rank <= F.col("test_end"), F.lit("test"))
        .when(rank <= F.col("val_end"), F.lit("val"))
        .otherwise(F.lit("train"))
    )
    return (
        keyed.join(F.broadcast(table), ["label_id", "bucket"])
        .withColumn("split", split)
        .select("text", "label", "label_id", "split")
    )
