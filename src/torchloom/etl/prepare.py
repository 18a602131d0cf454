"""The prepare stage: raw labelled text -> cleaned, deduplicated, split, tokenized Parquet + manifest."""

from __future__ import annotations

import hashlib
import json
import shutil
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchloom import embedded
from torchloom.config.schema import Config
from torchloom.errors import UserError
from torchloom.etl import tag_split
from torchloom.etl.clean import CLEANED_SCHEMA, CLEANED_SCHEMA_GIVEN, REASONS, clean_batches, look_alike
from torchloom.etl.given_splits import TYPED, given_source, leaked_by_split, spread, with_given
from torchloom.etl.lengths import choose_length, model_positions
from torchloom.etl.session import default_parallelism, default_partitions, get_spark
from torchloom.etl.split import DUPLICATE, KEPT, heldout_record, mark_duplicates, plan_split, rank_bucket, rank_hash
from torchloom.etl.tokenize import read_tokenizer_json
from torchloom.etl.write_splits import make_tmp, publish, write_rejected, write_splits
from torchloom.inputs.locate import check_inputs, pin_tables, resolve_format, utf8_files
from torchloom.inputs.read import read_input, who_reads
from torchloom.inputs.tables import record as table_record
from torchloom.manifest import Manifest, Split
from torchloom.runs.ledger import check_replaceable, deletable, holding, seal
from torchloom.text.tags import check_count, decide, mode_for, of_label

Progress = Callable[[str], object]


def check_output(out: Path, overwrite: bool, inputs: list[str] = (), shown: str | None = None) -> None:
    """Before any work: `out` is new, empty, or (overwrite) holds only what torchloom wrote and no input (the
    new data replaces it whole): one line otherwise. shown: what names `out` in a line (a store's URI for a
    working copy, never the staging path)."""
    shown = shown or str(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"output {shown}: exists and is not a directory; choose another --output.dir")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise UserError(f"output {shown}: already exists and is not empty; pass --output.overwrite true to replace"
                        " it")
    if overwrite and out.is_dir():
        tree, under = holding(out)
        if under:  # a run's data/: its ledger is the run's
            deletable(tree, "output", inputs, under)
        else:
            check_replaceable(out, "output", inputs)


def prepare(cfg: Config, out_dir: str, spark=None, progress: Progress | None = None,
            store: str | None = None, shown_inputs: dict[str, str] | None = None,
            shown_out: str | None = None) -> Manifest:
    """Prepare cfg.data into `out_dir` (train/ val/ test/ rejected/ manifest.json); returns the manifest.

    Everything is written to a temporary sibling directory first and renamed at the end, so a failure
    leaves nothing half-written behind. store: a URI on an object store that the executors write their
    rows through (etl/store_write.py): a Spark cluster whose hosts do not see `out_dir`. shown_inputs: the
    names, in lines and in the manifest, of inputs that cfg names by a local copy (local path: its URI on a store);
    shown_out: the name of `out_dir` in lines where it is a working copy (its URI on the store).
    """
    say = progress or (lambda msg: None)
    start = time.perf_counter()
    out = Path(out_dir)
    check_output(out, cfg.output.overwrite, cfg.inputs(), shown_out)
    data_path = embedded.data_path(cfg.data.path)
    model_dir, tokenizer_json = _model(cfg)
    check_inputs(cfg.data, data_path)  # before Spark starts: a typo should cost no JVM start-up
    fmt = resolve_format(cfg.data, data_path)
    tables = pin_tables(cfg.data, data_path, fmt)  # the versions read, whatever is committed meanwhile
    names = dict(shown_inputs or {})
    shown = names.get(data_path, data_path)
    what = tables[data_path].describe() if data_path in tables else fmt
    say(f"{names.get(data_path) or cfg.data.path or 'embedded BBC News'} ({what}) -> {shown_out or out}")
    created = [p for p in (out.parent, *out.parent.parents) if not p.exists()]
    spark = spark or get_spark(cfg.prepare)

    tmp = make_tmp(out)
    try:
        with warnings.catch_warnings():
            # mapInArrow checks the pandas version on every call and warns about pandas 3 each time;
            # nothing here uses pandas.
            warnings.filterwarnings("ignore", "PySpark does not yet fully support pandas", FutureWarning)
            job = _Job(spark, cfg, data_path, shown, fmt, model_dir, tokenizer_json, tmp, say, store, names, tables)
            manifest = _prepare(job, start)
        manifest.write(tmp)
        seal(tmp)  # its own ledger: a later --overwrite may replace exactly these files
        publish(tmp, out)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        for p in created:  # the directories this call made, innermost first, if still empty
            try:
                p.rmdir()
            except OSError:
                break
        from torchloom.inputs.store_read import input_error
        from torchloom.java_errors import unreadable_input

        if isinstance(e, Exception) and not isinstance(e, UserError):
            # a task could not read an object of the input on a store, or a file Spark reads (read's schema pass
            # may not have opened it): its line
            unreadable = input_error(e) or unreadable_input(f"data.path {shown}", e)
            if unreadable is not None:
                raise unreadable from None
        raise
    manifest.root = str(out)
    say(f"prepared {manifest.counts['rows_kept']} rows into {shown_out or out} in {manifest.timings['total']:.1f}s")
    return manifest


def _model(cfg: Config) -> tuple[str, str]:
    """The model's directory and its tokenizer.json; prepare.max_length within the model's positions."""
    model_dir = embedded.model_path(cfg.model.path)
    positions = model_positions(model_dir)
    if cfg.prepare.max_length != "auto" and positions and int(cfg.prepare.max_length) > positions:
        raise UserError(f"config prepare.max_length: {cfg.prepare.max_length} is more than the {positions} positions of"
                        f" the model in {model_dir}; use at most {positions}, or \"auto\"")
    return model_dir, read_tokenizer_json(model_dir)


@dataclass
class _Job:
    """One prepare call: its inputs, where it writes, and what it says and times."""

    spark: Any
    cfg: Config
    data_path: str  # what is read
    shown: str  # its name in lines and the manifest (the URI of an input on a store read from a local copy)
    fmt: str
    model_dir: str
    tokenizer_json: str
    tmp: Path
    say: Progress
    store: str | None = None  # the executors write through this URI (a cluster that does not see `tmp`)
    names: dict[str, str] = field(default_factory=dict)  # local copy -> the input's URI (lines, the manifest)
    tables: dict = field(default_factory=dict)  # path -> its table (inputs/tables.py), pinned at one version
    timings: dict[str, float] = field(default_factory=dict)
    strata: dict[str, str] | None = None  # multi-label: tag set -> its stratum (etl/tag_split.py); None: single

    @property
    def user_split(self) -> bool:
        return bool(self.cfg.data.split_column or self.cfg.data.val_path or self.cfg.data.test_path)

    def name(self, path: str | None) -> str | None:
        """An input's name in lines and the manifest: its URI where `path` is a local copy of it."""
        return self.names.get(path, path) if path else path


@dataclass
class _Counts:
    """What the one job over the input counted, per status, label, given split and split-rank bucket."""

    stats: list[dict]
    rows_read: int = 0
    rows_kept: int = 0
    rejected: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REASONS, 0))
    duplicates: int = 0
    per_label: dict[str, int] = field(default_factory=dict)  # kept train rows (or all kept rows) per label
    buckets: dict[tuple[str, int], int] = field(default_factory=dict)  # (label, rank bucket) -> rows
    content: dict[str, int] = field(default_factory=dict)  # per label: the sum of its kept rows' hashes
    given: dict[tuple[str, str], int] = field(default_factory=dict)  # (split, label) -> kept rows given val/test
    leaks: dict[tuple[str, str], int] = field(default_factory=dict)  # of those, rows whose text is also in train
    leaked: dict[str, int] = field(default_factory=dict)  # per split: val/test texts also in train
    decoded: dict[str, int] = field(default_factory=dict)  # rows read from files in an encoding not UTF-8
    heldout: dict | None = None  # val/test capped by prepare.heldout_rows (etl/split.heldout_record)

    @property
    def rows_rejected(self) -> int:
        return sum(self.rejected.values())


def _prepare(job: _Job, start: float) -> Manifest:
    """The jobs of prepare, in order: count, set aside, choose the length, write the splits, fingerprint."""
    cfg, say = job.cfg, job.say
    cached = None
    try:
        cached, counts = _read_and_count(job)
        marked, plans = _set_aside(job, _tagged(job, cached, counts), counts)
        labels = tag_split.labels_of(job.strata, {plan.label for plan in plans}) if job.strata is not None else None
        if labels is not None:
            check_count(labels, f"data.path {job.shown}")
        t = time.perf_counter()
        write_rejected(tag_split.shown_tags(marked) if labels is not None else marked, job.tmp / "rejected",
                       counts.rows_rejected, job.store)
        job.timings["write_rejected"] = time.perf_counter() - t
        t = time.perf_counter()
        info = _choose_length(job, marked, counts, plans)
        splits = write_splits(job.spark, marked, plans, cfg.prepare, info, job.tokenizer_json, job.tmp,
                              rows=counts.rows_kept, sizes=counts.buckets,
                              given=counts.given if job.user_split else None, store=job.store, tags=labels)
        job.timings["tokenize_write"] = time.perf_counter() - t
        rate = counts.rows_kept / max(job.timings["tokenize_write"], 1e-9)
        say(f"tokenized and wrote {counts.rows_kept} rows in {job.timings['tokenize_write']:.1f}s ({rate:.0f} rows/s): "
            + ", ".join(f"{name} {s.documents or s.rows}" for name, s in splits.items()))
        if cfg.prepare.truncation == "chunks":
            say(f"chunks of {info['max_length']} tokens, {info['stride']} apart (at most"
                f" {cfg.prepare.max_chunks or 'any number'} per text): "
                + ", ".join(f"{name} {s.documents} texts -> {s.rows} chunks" for name, s in splits.items()))
    finally:
        if cached is not None:
            cached.unpersist()
    job.timings["total"] = time.perf_counter() - start
    manifest = _manifest(job, counts, plans, info, splits)
    if labels is not None:
        manifest.labels, manifest.task = labels, "multi_label"
        manifest.tags = tag_split.record(job.tmp, splits, labels, cfg.data.keep_untagged)
        for name, split in splits.items():  # rows per tag; the strata's rows stay in the tags record
            manifest.tags.setdefault("strata", {})[name], split.per_class = (split.per_class,
                manifest.tags["per_split"][name])
        say(tag_split.summary(manifest.tags, labels))
    return manifest


def _tagged(job: _Job, marked, counts: _Counts):
    """Multi-label rows (text/tags.decide on the labels read) planned on their strata; other rows as read."""
    labels = {*counts.per_label, *(label for _, label in counts.given)}
    if decide(labels, job.cfg.data.task, job.cfg.data.label_delimiter, job.shown) != "multi_label":
        return marked
    job.strata = tag_split.strata(counts)
    tag_split.restratify(counts, job.strata)
    job.say(f"multi-label: {len({t for lb in labels for t in of_label(lb)})} tags in {len(labels)} distinct tag"
            " sets; the split is stratified on each row's rarest tag")
    return tag_split.with_strata(marked, job.strata)


def _read_and_count(job: _Job):
    """Read + clean + dedup + every count: one job. The rows marked kept/duplicate/rejected come back
    cached for the writes after it; rows per (label, split-rank bucket) come with the counts."""
    from pyspark import StorageLevel
    from pyspark.sql import functions as F

    cfg, p, say = job.cfg, job.cfg.prepare, job.say
    t = time.perf_counter()
    through = (" by the tasks with pyarrow (prepare.input_reader)"
        if who_reads(job.data_path, p.input_reader, spark=job.spark) == "pyarrow" else "")
    say(f"reading {job.shown} ({job.fmt}){through}")
    width = default_parallelism(job.spark, default_partitions(p))
    raw = spread(read_input(job.spark, cfg.data, job.data_path, job.fmt, p.input_reader,
                             job.tables.get(job.data_path), say), width, job.fmt)
    if job.user_split:
        raw = with_given(job, raw, width)
    inputs = [(job.data_path, job.fmt)] + [(path, resolve_format(cfg.data, path))
                                           for path in (cfg.data.val_path, cfg.data.test_path) if path]
    utf8 = frozenset().union(*(utf8_files(path) for path, _ in inputs))
    cleaned = raw.mapInArrow(clean_batches(p.min_chars, p.max_chars, utf8,
                                           fffd_is_error=any(f not in TYPED for _, f in inputs),
                                           encoding=cfg.data.encoding,
                                           tags=(mode_for(cfg.data.task, cfg.data.label_delimiter),
                                                 cfg.data.label_delimiter, cfg.data.keep_untagged,
                                                 cfg.data.label_path_delimiter)),
                             CLEANED_SCHEMA_GIVEN if job.user_split else CLEANED_SCHEMA)
    if job.user_split:
        cleaned = cleaned.withColumn("reason", F.coalesce(F.col("reason"),
                                                          F.when(F.col("given").isNull(), F.lit("unknown_split"))))
    marked = mark_duplicates(cleaned, drop_leaked=p.leakage == "drop").persist(StorageLevel.MEMORY_AND_DISK)
    kept_col = F.col("status") == KEPT
    group = ["status", "label", "codec", *(["given"] if job.user_split else [])]
    sums = [F.count(F.lit(1)).alias("n"),
            F.sum(F.when(kept_col, F.xxhash64("text", "label").cast("decimal(38,0)"))).alias("h")]
    if job.user_split:
        sums.append(F.sum(F.when(kept_col & F.col("leaked"), 1).otherwise(0)).alias("leak"))
    try:
        stats = (marked.groupBy(*group, F.when(kept_col, rank_bucket(rank_hash(p.seed))).alias("bucket"))
                 .agg(*sums).toArrow().to_pylist())
    except BaseException:
        marked.unpersist()
        raise
    counts = _fold(stats)
    job.timings["read_clean_dedup"] = time.perf_counter() - t
    say(f"read {counts.rows_read} rows in {job.timings['read_clean_dedup']:.1f}s")
    if counts.decoded:  # read, not set aside: said, so a wrong guess (latin-1 for a cp1250 file) shows
        unit = "files" if job.fmt == "folder" else "rows"
        say("decoded as " + ", ".join(f"{codec}: {n} {unit}" for codec, n in sorted(counts.decoded.items()))
            + f" (data.encoding {cfg.data.encoding}; the rest UTF-8)")
    reasons = ", ".join(f"{k} {v}" for k, v in counts.rejected.items() if v) or "none"
    if counts.rows_read == 0:
        marked.unpersist()
        raise UserError(f"data.path {job.shown}: no rows read ({job.fmt}); check the path and --data.format")
    say(f"rejected {counts.rows_rejected} rows ({reasons}); removed {counts.duplicates} exact duplicates")
    return marked, counts


def _fold(stats: list[dict]) -> _Counts:
    counts = _Counts(stats)
    for row in stats:
        counts.rows_read += row["n"]
        if row["codec"] is not None:
            counts.decoded[row["codec"]] = counts.decoded.get(row["codec"], 0) + row["n"]
        if row["status"] == DUPLICATE:
            counts.duplicates += row["n"]
        elif row["status"] != KEPT:
            counts.rejected[row["status"]] += row["n"]
        else:
            label = row["label"]
            counts.content[label] = counts.content.get(label, 0) + int(row["h"])
            if row.get("given", "train") != "train":
                key = (row["given"], label)
                counts.given[key] = counts.given.get(key, 0) + row["n"]
                counts.leaks[key] = counts.leaks.get(key, 0) + row["leak"]
                continue
            counts.per_label[label] = counts.per_label.get(label, 0) + row["n"]
            key = (label, row["bucket"])  # one row per codec as well
            counts.buckets[key] = counts.buckets.get(key, 0) + row["n"]
    counts.rows_kept = sum(counts.per_label.values()) + sum(counts.given.values())
    return counts


def _set_aside(job: _Job, marked, counts: _Counts):
    """The split plan per class; classes too small for one row in each split, and val/test labels no train
    row has, are set aside with a reason like a rejected row (the other classes go on)."""
    from pyspark.sql import functions as F

    p, say, given = job.cfg.prepare, job.say, counts.given
    if counts.rows_kept == 0:
        reasons = ", ".join(f"{k} {v}" for k, v in counts.rejected.items() if v) or "none"
        raise UserError(
            f"data.path {job.shown}: no usable rows after cleaning ({counts.rows_read} read; rejected: {reasons});"
            " check --data.text_column / --data.label_column and --prepare.min_chars / --prepare.max_chars"
        )
    if job.user_split and not counts.per_label:
        raise UserError(f"data.path {job.shown}: no usable train rows ({given_source(job)}); the train"
                        " split needs rows to learn from")
    carve_val = p.val_fraction if not job.user_split or not any(k[0] == "val" for k in given) else 0.0
    carve_test = p.test_fraction if not job.user_split else 0.0
    plans, small = plan_split(counts.per_label, carve_val, carve_test, job.shown, p.heldout_rows)
    counts.heldout = heldout_record(plans, carve_val, carve_test, p.heldout_rows)
    usable = {plan.label for plan in plans}
    orphans = sorted({label for _, label in given if label not in usable and label not in small})
    if small or orphans:
        kept_col = F.col("status") == KEPT
        given_small = sum(n for (_, label), n in given.items() if label in small)
        counts.rejected["class_too_small"] = sum(small.values()) + given_small
        counts.rejected["label_not_in_train"] = sum(n for (_, label), n in given.items() if label in orphans)
        counts.rows_kept -= counts.rejected["class_too_small"] + counts.rejected["label_not_in_train"]
        marked = marked.withColumn(
            "status",
            F.when(kept_col & F.col("label").isin(*small), "class_too_small")
            .when(kept_col & F.col("label").isin(*orphans), "label_not_in_train")
            .otherwise(F.col("status")))
        counts.given = {k: n for k, n in given.items() if k[1] in usable}
        counts.leaks = {k: n for k, n in counts.leaks.items() if k[1] in usable}
    if orphans:
        say(f"set aside {counts.rejected['label_not_in_train']} val/test rows whose label no train row has"
            f" (label_not_in_train): " + ", ".join(repr(label) for label in orphans))
    if small:
        needed = 1 + (carve_val > 0) + (carve_test > 0)
        say(f"set aside {counts.rejected['class_too_small']} rows of {len(small)} class(es) with fewer than the"
            f" {needed} rows needed for one in each split (class_too_small): "
            + ", ".join(f"{label!r} {n}" for label, n in sorted(small.items()))
            + "; add rows, or set --prepare.val_fraction / --prepare.test_fraction to 0, to keep them")
        counts.buckets = {key: n for key, n in counts.buckets.items() if key[0] not in small}
    _say_kept(job, counts, plans, carve_val)
    if counts.heldout:
        say("held out " + ", ".join(f"{name} {h['rows']:,} rows (not {h['by_fraction']:,})"
                                    for name, h in counts.heldout.items() if name != "why")
            + f": {counts.heldout['why']}")
    return marked, plans


def _say_kept(job: _Job, counts: _Counts, plans, carve_val: float) -> None:
    """The split as given (and what leaked into it), then the kept rows per class."""
    p, given = job.cfg.prepare, counts.given
    counts.leaked = (leaked_by_split(counts.stats) if p.leakage == "drop" else
                     {name: sum(n for (g, _), n in counts.leaks.items() if g == name) for name in ("val", "test")})
    if job.user_split:
        job.say(f"split as given ({given_source(job)}): train {sum(plan.train for plan in plans)}, val "
                + (f"{sum(plan.val for plan in plans)} (carved from train by prepare.val_fraction)" if carve_val
                   else str(sum(n for (g, _), n in given.items() if g == "val")))
                + f", test {sum(n for (g, _), n in given.items() if g == 'test')}")
        if sum(counts.leaked.values()):
            what = ("set aside as leaked" if p.leakage == "drop" else
                    "kept and counted; --prepare.leakage drop sets them aside")
            job.say(f"leakage: {counts.leaked['test']} test and {counts.leaked['val']} val texts also appear in train"
                    f" ({what})")
    job.say(f"kept {counts.rows_kept} rows in {len(plans)} {'strata (rarest tag)' if job.strata else 'classes'}: "
            + ", ".join(f"{plan.label} {plan.rows}" for plan in plans))
    alike = look_alike([plan.label for plan in plans])
    if alike:
        job.say(f"warning: {sum(map(len, alike))} labels differ only in case, spaces or punctuation and are separate"
                " classes: " + "; ".join(" and ".join(map(repr, group)) for group in alike[:5])
                + (f" (and {len(alike) - 5} more groups)" if len(alike) > 5 else "")
                + "; if each group is one class, write it one way in the data")


def _choose_length(job: _Job, marked, counts: _Counts, plans) -> dict:
    """max_length and the tokenizer's record (lengths.choose_length), from a sample of the kept train rows."""
    from pyspark.sql import functions as F

    kept_col = F.col("status") == KEPT
    if job.user_split:
        labels = [plan.label for plan in plans]
        sample_of = marked.filter(kept_col & F.col("label").isin(*labels) & (F.col("given") == "train"))
    else:
        sample_of = marked.filter(kept_col)
    rows = sum(plan.train for plan in plans) if job.user_split else counts.rows_kept
    return choose_length(job.cfg.prepare, job.model_dir, job.tokenizer_json, sample_of, rows, job.say)


def _manifest(job: _Job, counts: _Counts, plans, info: dict, splits: dict[str, Split]) -> Manifest:
    """The manifest of what was written, with the data's fingerprint: the same input, seed, split and
    tokenization give the same fingerprint, however Spark partitioned the work."""
    cfg, p = job.cfg, job.cfg.prepare
    given = counts.given
    labels = [plan.label for plan in plans]
    content_sum = sum(counts.content[label] for label in labels)
    fingerprint = hashlib.sha256(json.dumps({
        "rows": f"{content_sum % 2**64:016x}",  # order-free sum of per-row hashes: partitioning cannot change it
        "classes": [[plan.label, plan.train, plan.val, plan.test] for plan in plans],
        "seed": p.seed, "val_fraction": p.val_fraction, "test_fraction": p.test_fraction,
        "given": sorted([g, label, n] for (g, label), n in given.items()) if job.user_split else None,
        "tokenizer": info["hash"], "max_length": info["max_length"], "truncation": p.truncation,
        **({"stride": info["stride"], "max_chunks": p.max_chunks} if p.truncation == "chunks" else {}),
    }, sort_keys=True).encode()).hexdigest()
    return Manifest(
        labels=labels, splits=splits, tokenizer=info, fingerprint=fingerprint,
        inputs={"path": job.shown, "format": job.fmt, "text_column": cfg.data.text_column,
                "label_column": cfg.data.label_column,
                **({"label_columns": cfg.data.label_sources()} if cfg.data.label_columns else {}),
                **({"label_path_delimiter": cfg.data.label_path_delimiter} if cfg.data.label_path_delimiter else {}),
                **table_record(job.tables, {"data.path": job.data_path, "data.val_path": cfg.data.val_path,
                                            "data.test_path": cfg.data.test_path}),
                **({"split_column": cfg.data.split_column, "val_path": job.name(cfg.data.val_path),
                    "test_path": job.name(cfg.data.test_path)} if job.user_split else {})},
        counts={
            "rows_read": counts.rows_read, "rows_rejected": counts.rejected,
            "duplicates_removed": counts.duplicates, "rows_kept": counts.rows_kept,
            **({"decoded": dict(sorted(counts.decoded.items()))} if cfg.data.encoding != "strict" else {}),
            **({"split": given_source(job), "leaked": counts.leaked, "leakage": p.leakage}
               if job.user_split else {}),
            "splits": {name: s.rows for name, s in splits.items()},
            **({"heldout": counts.heldout} if counts.heldout else {}),
        },
        timings={k: round(v, 3) for k, v in job.timings.items()},
    )
