"""The `run` command: prepare -> (baseline) -> train -> export -> evaluate into one run directory, sharing one
SparkSession between prepare, the baseline and the Spark engine, then a summary (summary.json and the lines
console.summary_text prints)."""

from __future__ import annotations

import time

from torchloom.config.engines import engine_of
from torchloom.console import say, speed_line, summary_text, training_line
from torchloom.errors import UserError
from torchloom.etl.session import stop_spark
from torchloom.jsonio import write_json
from torchloom.manifest import read as read_manifest
from torchloom.preflight import check_input, check_writable
from torchloom.runs.run import Run
from torchloom.stages import recorded
from torchloom.stages.baseline import baseline_stage, stored_baseline
from torchloom.stages.evaluate import evaluate_stage
from torchloom.stages.export import export_stage
from torchloom.stages.prepare import prepare_stage
from torchloom.stages.train import after_training, train_stage


@recorded
def run_all(run: Run) -> dict:
    """prepare -> train -> export -> evaluate into one run dir, then a summary."""
    cfg, rd, files = run.cfg, run.rd, run.files
    reuse = bool(cfg.train.resume) and files.place.holds(rd.manifest)  # a resume reuses the prepared data (the store's)
    if not reuse:
        check_input(cfg)  # every input checked before --overwrite deletes anything
    check_writable(run)  # a store answers and takes writes (one line otherwise, before any work)
    if not cfg.train.resume:
        _fresh(run)
    from torchloom import tracking

    if reuse:
        files.ensure(rd.manifest)  # on another host: the store's
    with tracking.start(cfg, "run") as tracker:
        return _run_all(run.but(tracker=tracker), reuse)


def _fresh(run: Run) -> None:
    """A fresh run: where the run lives (the directory, or the store's prefix, its lease aside: this driver's own,
    runs/lease.py) holds anything, it is refused without --overwrite, and with it what torchloom wrote there is
    replaced; a store's staging copy on this host is emptied too (RunFiles.drop_copy)."""
    cfg, files = run.cfg, run.files
    if files.place.holds_anything():
        if not cfg.output.overwrite:
            raise UserError(f"output.dir {files.rd.where}: exists and is not empty; pass --output.overwrite true or"
                            " another --output.dir")
        files.place.replace(inputs=cfg.inputs())
    files.drop_copy(inputs=cfg.inputs())


def _run_all(run: Run, reuse: bool) -> dict:
    cfg, rd, tracker = run.cfg, run.rd, run.tracker
    started = time.perf_counter()
    timings: dict[str, float] = {}
    startup: dict[str, float] = {}  # the driver's phases before the workers launch (the start-up account)
    run = _prepare_and_baseline(run, timings, startup, reuse)
    result = train_stage(run, startup=startup)
    after_training(cfg)  # the local engine's fork server: ~300 MB of the workers' imports, idle from here on
    timings["train_s"] = result.wall_s
    exported = export_stage(run)
    timings["export_s"] = exported["seconds"]
    ev = evaluate_stage(run, extra={"timings": timings, "train": result.to_dict()}, announce=False)
    if exported.get("registered"):  # the registered version learns its test metrics too
        from torchloom.registry import tag_version

        tag_version(tracker, exported["registered"]["name"], exported["registered"]["version"],
                    {f"test_{k}": v for k, v in ev["metrics"].items() if k in ("accuracy", "macro_f1", "n")})
    timings["evaluate_s"] = ev["seconds"]
    timings["total_s"] = round(time.perf_counter() - started, 2)
    # the first step ended this long after the run started: everything before training, then the launch's part
    startup["first_step_after_s"] = round(timings["total_s"] - timings["train_s"] - timings["export_s"]
                                          - timings["evaluate_s"] + result.first_step_s, 2)
    summary = {
        "run_dir": rd.where, "accuracy": ev["metrics"]["accuracy"], "macro_f1": ev["metrics"]["macro_f1"],
        **({"micro_f1": ev["metrics"]["micro_f1"]} if "micro_f1" in ev["metrics"] else {}),
        "timings": timings, "model_dir": rd.home(rd.model), "report": rd.home(rd.report_md),
        "precision": result.precision, "precision_reason": result.precision_reason,
        "workers": cfg.engine.workers, "startup": {**startup, **result.startup},
        "data": {k: v for k, v in read_manifest(rd.data).inputs.items()
                 if k in ("path", "format", "version", "committed")},  # a table: the version read
        "training": training_line(cfg, read_manifest(rd.data), result), "speed": speed_line(result),
        "throughput": {k: getattr(result, k) for k in ("samples_per_s", "tokens_per_s", "padding", "packed", "mfu",
                                                        "time_split")},
    }
    heldout = read_manifest(rd.data).counts.get("heldout")
    if heldout:  # val/test capped by prepare.heldout_rows: from what, and why
        summary["heldout"] = heldout
    if exported.get("registered"):  # the version it became in the registry (the loop moves the alias to it)
        summary["registered"] = exported["registered"]
    if result.uploads:  # a run on a store: checkpoints uploaded, the loop's wait for them, their upload time
        summary["uploads"] = result.uploads
    if result.preemptions:
        summary["preemptions"] = result.preemptions
    cmp = ev.get("baseline")
    if cmp:
        summary["baseline"] = {k: cmp[k] for k in ("name", "accuracy", "macro_f1", "accuracy_gain", "macro_f1_gain",
                                                   "transformer_accuracy", "transformer_macro_f1", "metric",
                                                   "micro_f1", "micro_f1_gain", "transformer_micro_f1") if k in cmp}
        if cmp.get("shipped"):
            summary["shipped"] = cmp["shipped"]
        summary["verdict"] = ev.get("verdict")
    if tracker.enabled:
        summary["mlflow_run_id"] = tracker.run_id
        summary["mlflow_uri"] = tracker.shown_uri
    write_json(rd.summary, summary)
    run.files.push(rd.summary)
    tracker.log_metrics({f"time_{k}": v for k, v in timings.items()})
    tracker.log_artifact(rd.summary)
    print(summary_text(summary, cfg.eval.split, rd, tracker), flush=True)
    return summary


def _prepare_and_baseline(run: Run, timings: dict, startup: dict, reuse: bool) -> Run:
    """prepare (or, on a resume, the prepared data as it is) and the baseline in one SparkSession; returns the
    run with the session when the Spark engine trains next, else stops it (its JVM would keep memory and
    wake-ups away from the workers)."""
    from torchloom.etl.session import get_spark

    cfg, rd, tracker = run.cfg, run.rd, run.tracker
    t = time.perf_counter()
    run = run.but(spark=get_spark(cfg.prepare))  # one SparkSession for the ETL, the baseline and the Spark engine
    startup["spark_start_s"] = time.perf_counter() - t
    if reuse:
        say(f"run: resuming; reusing the prepared data in {rd.home(rd.data)}")
    else:
        timings["prepare_s"] = prepare_stage(run)["seconds"]
        done = read_manifest(rd.data).timings
        startup.update({"read_clean_s": done.get("read_clean_dedup", 0.0) + done.get("write_rejected", 0.0),
                        "tokenize_s": done.get("tokenize_write", 0.0)})
    if cfg.eval.baseline:
        stored = stored_baseline(run, read_manifest(rd.data))
        if stored is None:  # fitted now, and logged as it is
            fitted = baseline_stage(run)
            if fitted:
                timings["baseline_s"] = startup["baseline_s"] = fitted["seconds"]
        else:  # a resumed run reuses it: this run's tracker gets its scores once
            tracker.log_metrics({f"baseline_{k}_{metric}": v[metric] for k, v in stored["splits"].items()
                                 for metric in ("accuracy", "macro_f1")})
    if engine_of(cfg.engine).uses_spark:  # the training's ranks are its tasks
        return run
    stop_spark()
    return run.but(spark=None)
