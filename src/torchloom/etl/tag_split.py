"""prepare for multi-label rows: each row's tag set (text/tags.py) stands in the label column from cleaning on, so
dedup and conflicting labels hold for sets as for labels; here the split is planned on a stratum per row, its
rarest tag, and the written rows get their tag set's ids as label_id (a list<int32>).

Why the rarest tag: a split stratified on whole tag sets (the label powerset) leaves most sets too small to cut,
and iterative stratification (Sechidis et al., 2011) needs every row in one place. Cutting each row's rarest tag
in the split's proportions is the part of it that matters most (a rare tag's rows are cut as a class is) and
stays one Spark job: every tag with enough rows reaches every split, and the common tags ride along with the
rows of the rarer ones. A stratum too small to reach every split is set aside as a small class is
(class_too_small, naming the tag); the tags that remain are the run's labels. Untagged rows kept
(data.keep_untagged) are a stratum of their own.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from torchloom.tag_scoring import label_array
from torchloom.text import tags as tag_rules

NO_TAG = "(no tag)"  # the stratum of a kept untagged row


def frequencies(counts) -> Counter:
    """Kept rows per tag, from the rows counted per tag set (train and given val/test)."""
    freq: Counter = Counter()
    for label, n in [*counts.per_label.items(), *((lb, n) for (_, lb), n in counts.given.items())]:
        for tag in tag_rules.of_label(label):
            freq[tag] += n
    return freq


def strata(counts) -> dict[str, str]:
    """Tag set (prepare's label) -> its stratum: the set's rarest tag (ties: the first by name)."""
    freq = frequencies(counts)
    out = {}
    for label in {*counts.per_label, *(lb for _, lb in counts.given)}:
        found = tag_rules.of_label(label)
        out[label] = min(found, key=lambda t: (freq[t], t)) if found else NO_TAG
    return out


def restratify(counts, by: dict[str, str]) -> None:
    """The counts per tag set re-keyed per stratum, in place: what the split plans count."""
    def rekey(table: dict, key):
        out: dict = {}
        for k, n in table.items():
            out[key(k)] = out.get(key(k), 0) + n
        return out

    counts.per_label = rekey(counts.per_label, lambda lb: by[lb])
    counts.content = rekey(counts.content, lambda lb: by[lb])
    counts.buckets = rekey(counts.buckets, lambda k: (by[k[0]], k[1]))
    counts.given = rekey(counts.given, lambda k: (k[0], by[k[1]]))
    counts.leaks = rekey(counts.leaks, lambda k: (k[0], by[k[1]]))


def with_strata(marked, by: dict[str, str]):
    """`marked` with its tag set moved to `tags` and its stratum in `label` (null where the set is)."""
    from pyspark.sql import functions as F

    lookup = F.create_map(*[F.lit(x) for pair in by.items() for x in pair])
    return marked.withColumn("tags", F.col("label")).withColumn("label", lookup[F.col("label")])


def labels_of(by: dict[str, str], kept_strata: set[str]) -> list[str]:
    """The run's labels: every tag of a set whose stratum is kept, sorted."""
    return sorted({tag for label, stratum in by.items() if stratum in kept_strata for tag in tag_rules.of_label(label)})


def with_masks(assigned, labels: list[str]):
    """The assigned rows with label_id their tag set's ids (sorted; labels[i] is id i: a list as long as the row's
    tags, whatever the vocabulary of tags) in place of the stratum's id; `label` stays the stratum (the split's
    counts check it)."""
    from pyspark.sql import functions as F

    return assigned.withColumn("label_id", _ids_column(F.col("tags"), {tag: i for i, tag in enumerate(labels)}))


def _ids_column(column, index: dict[str, int]):
    """The sorted tag ids of a tag-set label column, in Spark (a tag the index lacks left out). The tags arrive
    sorted (text/tags.as_label) and the ids are the sorted labels' positions, so they are in order already; the
    sort keeps it so whatever the map holds."""
    from pyspark.sql import functions as F

    lookup = F.create_map(*[F.lit(x) for tag, i in index.items() for x in (tag, i)])
    parts = F.filter(F.split(column, tag_rules.SET), lambda t: F.length(t) > 0)
    ids = F.filter(F.transform(parts, lambda t: lookup[t].cast("int")), lambda i: i.isNotNull())
    return F.array_sort(ids)


def record(tmp, splits: dict, labels: list[str], untagged_kept: bool) -> dict:
    """The manifest's `tags`: per split, the rows holding each tag (read from the written shards' label_id), the
    mean tags per row (label cardinality), and the untagged rows. Counted batch by batch (RECORD_BATCH rows): the
    driver's memory stays a batch's, whatever the rows."""
    import pyarrow.parquet as pq

    out: dict = {"per_split": {}, "cardinality": {}, "untagged": {}, "keep_untagged": untagged_kept,
                 "stratified_by": "rarest tag"}
    for name, split in splits.items():
        per_tag, rows, untagged = np.zeros(len(labels), np.int64), 0, 0
        for shard in split.shards:
            shard_file = pq.ParquetFile(f"{tmp}/{shard.path}")
            for batch in shard_file.iter_batches(RECORD_BATCH, columns=["label_id", "chunk"]):
                first = batch.column("chunk").to_numpy() == 0
                ids = label_array(batch.column("label_id"))[first]
                per_tag += np.bincount(ids[ids >= 0], minlength=len(labels))
                rows, untagged = rows + len(ids), untagged + int((ids < 0).all(axis=1).sum())
        out["per_split"][name] = dict(zip(labels, map(int, per_tag), strict=True))
        out["cardinality"][name] = round(float(per_tag.sum() / rows), 4) if rows else 0.0
        out["untagged"][name] = untagged
    return out


RECORD_BATCH = 65_536


def shown_tags(marked):
    """`marked` with each row's tag set in `label` as a JSON list (the rejected rows' file), not its stratum."""
    from pyspark.sql import functions as F

    listed = F.to_json(F.filter(F.split(F.col("tags"), tag_rules.SET), lambda t: F.length(t) > 0))
    return marked.withColumn("label", F.when(F.col("tags").startswith(tag_rules.SET), listed)
                             .otherwise(F.col("tags")))


def summary(record: dict, labels: list[str]) -> str:
    """prepare's line on the tags: how many, per row, and each one's train rows (the rarest first)."""
    train = record["per_split"].get("train", {})
    rarest = sorted(labels, key=lambda t: (train.get(t, 0), t))
    return (f"{len(labels)} tags, {record['cardinality'].get('train', 0):.2f} a train row"
            + (f" ({record['untagged']['train']} untagged)" if record["untagged"].get("train") else "")
            + "; train rows per tag, rarest first: " + ", ".join(f"{t} {train.get(t, 0)}" for t in rarest[:12])
            + (f" (and {len(rarest) - 12} more)" if len(rarest) > 12 else ""))
