"""Conflicting labels, exact duplicates, and the deterministic stratified train/val/test split."""

from __future__ import annotations

import math
from dataclasses import dataclass

from torchloom.errors import UserError
from torchloom.etl.heldout import (  # noqa: F401  (the held-out sizes: prepare and tests read them here too)
    CLASS_FLOOR,
    DEFAULT_FRACTION,
    HELDOUT_ROWS,
    capped_shares,
    heldout_cap,
)

KEPT = "kept"
DUPLICATE = "duplicate"


LEAKED = "leaked"


def mark_duplicates(cleaned, drop_leaked: bool = False):
    """Add `status`: a rejection reason, DUPLICATE (same text and label seen before) or KEPT.

    A text seen with two or more labels is ambiguous, so all of its rows become conflicting_labels.
    With the user's own split (a `given` column), copies count within a split, and a val or test row
    whose text is also in train gets `leaked` True (status LEAKED instead of KEPT with drop_leaked).
    """
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    valid = F.col("reason").isNull()
    by_text = Window.partitionBy("text")
    given = "given" in cleaned.columns
    # Which copy of a duplicate stays does not matter (they are equal after cleaning); ordering by
    # source and raw text only makes the rejected/kept bookkeeping repeatable.
    keys = ["text", "label", "given"] if given else ["text", "label"]
    by_text_label = Window.partitionBy(*keys).orderBy("source", "raw")  # raw: null if == text
    n_labels = F.size(F.collect_set(F.when(valid, F.col("label"))).over(by_text))
    copy = F.row_number().over(by_text_label)
    leaked = F.lit(False)
    if given:
        in_train = F.max(F.when(valid & (F.col("given") == "train"), 1).otherwise(0)).over(by_text) == 1
        leaked = valid & (F.col("given") != "train") & in_train
    status = (
        F.when(~valid, F.col("reason"))
        .when(n_labels > 1, F.lit("conflicting_labels"))
        .when(copy > 1, F.lit(DUPLICATE))
    )
    if drop_leaked:
        status = status.when(leaked, F.lit(LEAKED))
    marked = cleaned.withColumn("status", status.otherwise(F.lit(KEPT)))
    return marked.withColumn("leaked", leaked) if given else marked


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
               where: str, heldout_rows: int | str = 0) -> tuple[list[ClassSplit], dict[str, int]]:
    """Rows per split for each label big enough for one row in every split (sorted), and the classes
    too small for that (label -> rows), which prepare sets aside as class_too_small. A UserError when
    fewer than 2 classes would be left: a classifier needs two. heldout_rows: prepare.heldout_rows, val and test
    capped at heldout_cap's rows (capped_shares; 0: the fractions as they are), the rest trains."""
    if val_fraction + test_fraction >= 1:
        raise UserError(
            f"prepare.val_fraction {val_fraction} + prepare.test_fraction {test_fraction} leave no training"
            " rows; make their sum less than 1"
        )
    if len(per_label) == 1:
        (label, n), = per_label.items()
        raise UserError(f"data.path {where}: every usable row ({n}) has the label {label!r}; a classifier needs at"
                        " least 2 classes: check --data.label_column")
    plans, small = [], {}
    needed = 1 + (val_fraction > 0) + (test_fraction > 0)
    for label in sorted(per_label):
        n = per_label[label]
        plan = ClassSplit(label, n, _share(n, val_fraction), _share(n, test_fraction))
        if plan.train < 1:
            small[label] = n
        else:
            plans.append(plan)
    if len(plans) < 2 and small:
        tiny = ", ".join(f"{label!r} ({n})" for label, n in sorted(small.items(), key=lambda kv: kv[1]))
        left = f"only {plans[0].label!r} has" if plans else "no class has"
        raise UserError(
            f"data.path {where}: {left} the {needed} usable rows needed for one in each of train/val/test;"
            f" too small: {tiny}; add rows, or set --prepare.val_fraction / --prepare.test_fraction to 0"
        )
    val = capped_shares({p.label: p.val for p in plans}, heldout_cap(heldout_rows, val_fraction))
    test = capped_shares({p.label: p.test for p in plans}, heldout_cap(heldout_rows, test_fraction))
    return [ClassSplit(p.label, p.rows, val[p.label], test[p.label]) for p in plans], small


def heldout_record(plans: list[ClassSplit], val_fraction: float, test_fraction: float,
                   heldout_rows: int | str) -> dict | None:
    """What the manifest says of held-out splits that were capped (None: none was): each one's rows, its
    fraction's rows, and why."""
    val_cap, test_cap = heldout_cap(heldout_rows, val_fraction), heldout_cap(heldout_rows, test_fraction)
    out = {}
    for name, fraction, cap in (("val", val_fraction, val_cap), ("test", test_fraction, test_cap)):
        rows = sum(getattr(p, name) for p in plans)
        by_fraction = sum(_share(p.rows, fraction) for p in plans)
        if cap and rows < by_fraction:
            out[name] = {"rows": rows, "by_fraction": by_fraction, "cap": cap}
    if not out:
        return None
    out["why"] = (f"prepare.heldout_rows: a held-out split is capped near {max(val_cap, test_cap):,} rows"
                  + (" (accuracy's 95% interval within +-0.25 points; every class at least"
                     f" {CLASS_FLOOR} rows or all of its fraction)" if max(val_cap, test_cap) == HELDOUT_ROWS else "")
                  + "; the rest trains; --prepare.heldout_rows 0 keeps the fractions")
    return out


# Each class is cut into 2**RANK_BUCKET_BITS buckets by the top bits of the split hash. The bucket
# sizes travel to the driver (at most classes x 256 rows); 100 M rows in 5 classes make buckets of
# ~80,000 rows, each ranked by one task.
RANK_BUCKET_BITS = 8


def rank_hash(seed: int):
    """The seeded 64-bit hash of the cleaned text that orders the rows of a class for the split."""
    from pyspark.sql import functions as F

    return F.xxhash64(F.lit(seed), F.col("text"))


def rank_bucket(h):
    """The bucket of a row with split hash `h`: its top bits, so a bucket's rows all sort before the next's."""
    from pyspark.sql import functions as F

    # Arithmetic shift of a signed 64-bit hash: the bucket grows with h.
    return F.shiftright(h, 64 - RANK_BUCKET_BITS) if RANK_BUCKET_BITS else F.lit(0).cast("long")


def bucket_sizes(kept, seed: int) -> dict[tuple[str, int], int]:
    """Rows per (label, bucket) of `kept`: what assign_splits needs when no earlier job counted them."""
    from pyspark.sql import functions as F

    counted = kept.groupBy("label", rank_bucket(rank_hash(seed)).alias("bucket")).agg(F.count(F.lit(1)).alias("n"))
    return {(r.label, r.bucket): r.n for r in counted.collect()}


def assign_splits(kept, plans: list[ClassSplit], seed: int, sizes: dict[tuple[str, int], int] | None = None,
                  partitions: int | None = None, keep: tuple[str, ...] = ()):
    """Add label_id and split to the kept rows; membership depends only on seed, text and label.

    Within each label, rows are ordered by a seeded hash of the cleaned text (the text itself breaks
    ties); the first `test` rows go to test, the next `val` to val, the rest to train.

    Ranking a whole class in one window would put each class on one task: one core sorting 20 million
    rows of a 100-million-row, 5-class input. Instead each class is cut into buckets by the top bits
    of the same hash, and a row's rank is its bucket's offset in the class (from `sizes`, the rows
    per (label, bucket), counted by the caller's statistics job or here) plus its place inside the
    bucket: the same ranks, from windows spread over every task. With `partitions`, the rows come
    out in that many partitions, hashed on (label, bucket): the window's own shuffle, so a caller
    that wants a given number of output partitions needs no second one. keep: more columns carried along (a
    multi-label row's tag set: etl/tag_split.py).
    """
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    if sizes is None:
        sizes = bucket_sizes(kept, seed)
    ids = {p.label: i for i, p in enumerate(plans)}
    # Label ids from a literal map, so no join for them.
    table = _bucket_offsets(kept.sparkSession, plans, ids, sizes)
    label_map = F.create_map(*[F.lit(x) for p in plans for x in (p.label, ids[p.label])])
    h = rank_hash(seed)
    keyed = (
        kept.select("text", "label", *keep)
        .withColumn("label_id", label_map[F.col("label")].cast("int"))
        .withColumn("h", h)
        .withColumn("bucket", rank_bucket(F.col("h")))
    )
    if partitions:
        keyed = keyed.repartition(partitions, "label_id", "bucket")
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
        .select("text", "label", "label_id", "split", *keep)
    )


def _bucket_offsets(spark, plans: list[ClassSplit], ids: dict[str, int], sizes: dict[tuple[str, int], int]):
    """Per (label_id, bucket): the rows of its class in earlier buckets (offset), and where the class's
    test and val ranks end."""
    import pyarrow as pa

    label_ids, buckets, offsets, test_ends, val_ends = [], [], [], [], []
    before, current = 0, None
    for label, bucket in sorted(sizes, key=lambda k: (ids[k[0]], k[1])):
        if label != current:
            before, current = 0, label
        plan = plans[ids[label]]
        label_ids.append(ids[label])
        buckets.append(bucket)
        offsets.append(before)
        test_ends.append(plan.test)
        val_ends.append(plan.test + plan.val)
        before += sizes[(label, bucket)]
    # A small Arrow table: Spark builds it in the JVM (a Python list would start Python workers just to
    # unpickle it).
    return spark.createDataFrame(pa.table({
        "label_id": pa.array(label_ids, pa.int32()), "bucket": pa.array(buckets, pa.int64()),
        "offset": pa.array(offsets, pa.int64()), "test_end": pa.array(test_ends, pa.int64()),
        "val_end": pa.array(val_ends, pa.int64()),
    }))
