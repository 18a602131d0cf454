"""The prepare stage: the input read, cleaned, split and tokenized into the run's data/ (etl/prepare.py), and
the `prepare` command, which fits the baseline in the same SparkSession."""

from __future__ import annotations

import json
import time
from dataclasses import replace

from torchloom.config import Config
from torchloom.console import say
from torchloom.errors import UserError
from torchloom.etl.session import stop_spark
from torchloom.preflight import check_input, check_untrained
from torchloom.runs.ledger import deletable
from torchloom.runs.run import Run
from torchloom.runs.rundir import RunDir
from torchloom.runs.runfiles import RunFiles
from torchloom.stages import recorded, save_config
from torchloom.stages.baseline import baseline_stage
from torchloom.uri import redact


def local_input(cfg: Config, rd: RunDir) -> Config:
    """Data on a store, read by the embedded local Spark: streamed to this host's working copy first (that
    Spark has no Hadoop S3 connector, and none is on PyPI). A Spark cluster reads its own s3a:// or gs://
    paths with the connector it has, or its tasks stream them (inputs/store_read.py), as the local Spark does
    with prepare.input_reader pyarrow (no local copy). A Delta table on a store is read where it is, by the tasks
    (inputs/tables.py), at one version: a copy would be of every version's files. inputs/read.who_reads decides."""
    from torchloom.inputs.locate import is_table, stage_input
    from torchloom.inputs.read import who_reads

    paths = {}
    local = cfg.prepare.spark_here
    for key in ("path", "val_path", "test_path"):
        value = getattr(cfg.data, key)
        if value and who_reads(value, cfg.prepare.input_reader, table=is_table(cfg.data, value),
                               local_spark=local) == "copy":
            say(f"prepare: reading {redact(value)} from the store")
            paths[key] = stage_input(value, rd.staged_inputs / key, f"data.{key}")
    return replace(cfg, data=replace(cfg.data, **paths)) if paths else cfg


@recorded
def prepare_stage(run: Run) -> dict:
    from torchloom.etl.prepare import prepare

    cfg, rd, files, tracker, spark = run.cfg, run.rd, run.files, run.tracker, run.spark
    started = time.perf_counter()
    before = _recorded_inputs(files)
    _stage_data(run)
    try:
        # a Spark cluster's executors do not see this host's working copy: they write through the store
        through = None if run.spark_here else files.stored(rd.data)
        local = local_input(cfg, rd)
        # the inputs read from local copies are named by their URIs
        shown = {getattr(local.data, key): redact(getattr(cfg.data, key))
                 for key in ("path", "val_path", "test_path") if getattr(local.data, key) != getattr(cfg.data, key)}
        manifest = prepare(local, str(rd.data), spark=spark, progress=lambda m: say(f"prepare: {m}"), store=through,
                           shown_inputs=shown, shown_out=rd.home(rd.data))
    finally:
        if spark is None:
            # Nothing later needs the session we started: its JVM would keep memory and wake-ups
            # away from the training workers.
            stop_spark()
    # manifest.json last: the prepared data counts once it is there
    files.push_anew(rd.data, cfg.output.overwrite, cfg.inputs())
    files.new_identity()  # after the data: a host that saw the new record finds the new data
    save_config(run)
    splits = ", ".join(f"{k} {v.documents or v.rows}" + (f" ({v.rows} chunks)" if v.documents else "")
                       for k, v in manifest.splits.items())
    reasons = {k: v for k, v in manifest.counts.get("rows_rejected", {}).items() if v}
    rejected = sum(reasons.values())
    why = f" ({', '.join(f'{k} {v}' for k, v in reasons.items())})" if reasons else ""
    say(f"prepare: {manifest.counts.get('rows_read', '?')} rows read, {rejected} set aside{why},"
        f" {manifest.counts.get('duplicates_removed', 0)} duplicates removed; {splits}")
    _say_version_change(before, manifest.inputs)
    splits = {k: v.documents or v.rows for k, v in manifest.splits.items()}  # texts, with chunks too
    if tracker is not None:
        tracker.set_tags({"data_fingerprint": manifest.fingerprint, "data_format": manifest.inputs.get("format"),
                          **({"data_version": manifest.inputs["version"]} if "version" in manifest.inputs else {})})
        tracker.log_input(manifest.inputs, manifest.fingerprint, manifest.counts.get("rows_read", 0))
        tracker.log_metrics({"rows_read": manifest.counts.get("rows_read", 0), "rows_rejected": rejected,
                             "duplicates_removed": manifest.counts.get("duplicates_removed", 0),
                             **{f"rows_{k}": v for k, v in splits.items()}})
        tracker.log_artifact(rd.manifest)
    return {"seconds": round(time.perf_counter() - started, 2), "splits": splits}


def _recorded_inputs(files: RunFiles) -> dict:
    """The inputs of the data the run holds now (its manifest's), {} for none: a table re-read at another
    version says so."""
    try:
        return json.loads(files.read(files.rd.manifest) or b"{}").get("inputs") or {}
    except (OSError, ValueError, UserError):
        return {}


def _say_version_change(before: dict, after: dict) -> None:
    """One line when a table input was read at another version than the data it replaced."""
    if ("version" not in after or before.get("version") in (None, after["version"])
            or (before.get("path"), before.get("format")) != (after.get("path"), after.get("format"))):
        return
    from torchloom.inputs.tables import describe

    later = (after["version"] > before["version"] if after.get("format") == "delta"
        else after.get("committed", "") > before.get("committed", ""))
    newer = "a newer" if later else "another"
    say(f"prepare: {after['path']} read at {describe(after)}, {newer} version than the"
        f" {describe(before)} this run's data was prepared from (replaced)")


def _stage_data(run: Run) -> None:
    """prepare into a run on a store: the store says whether prepared data is there (never this host's copy,
    which may be of another run); the copy's data directory is cleared for the new data. A local run's data
    directory is etl/prepare.py's to check and replace (listing: {}, drop_copy: nothing)."""
    cfg, files, rd = run.cfg, run.files, run.rd
    run.check_own()  # before anything is written or deleted: the prefix is empty or torchloom's (once per run)
    if files.listing(rd.data):
        if not cfg.output.overwrite:
            raise UserError(f"output {rd.home(rd.data)}: already exists and is not empty; pass --output.overwrite true"
                            " to replace it")
        deletable(files.place.tree(), "output.dir", cfg.inputs(), under="data")  # refused now, not after the work
    files.sync_copy()
    files.drop_copy(rd.data, cfg.inputs())


@recorded
def prepare_with_baseline(run: Run) -> dict:
    """prepare, then (eval.baseline) the baseline: on the driver, or on Spark in prepare's SparkSession,
    which is stopped after."""
    cfg = run.cfg
    check_untrained(run)  # the run's own state first: whatever the input, a trained run is not prepared over
    check_input(cfg)
    if not cfg.eval.baseline:
        return prepare_stage(run)
    from torchloom.etl.session import get_spark

    run = run.but(spark=get_spark(cfg.prepare))
    try:
        out = prepare_stage(run)
        fitted = baseline_stage(run)
        if fitted:
            out["baseline_s"] = fitted["seconds"]
    finally:
        stop_spark()
    return out
