"""The stages as functions over a run directory: prepare, train, export, evaluate, and all of them."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from contextlib import nullcontext
from pathlib import Path

from torchloom import config as config_mod
from torchloom.config import Config
from torchloom.errors import UserError


def say(msg: str) -> None:
    print(f"torchloom: {msg}", file=sys.stderr, flush=True)


def run_dir(cfg: Config) -> Path:
    return Path(cfg.output.dir).resolve()


def save_config(cfg: Config, rd: Path) -> None:
    rd.mkdir(parents=True, exist_ok=True)
    config_mod.save(cfg, rd / "config.toml")


def prepare_stage(cfg: Config, spark=None, tracker=None) -> dict:
    from torchloom.etl.prepare import prepare

    rd = run_dir(cfg)
    started = time.perf_counter()
    try:
        manifest = prepare(cfg, str(rd / "data"), spark=spark, progress=lambda m: say(f"prepare: {m}"))
    finally:
        if spark is None:
            # Nothing later needs the session we started: its JVM would keep memory and wake-ups
            # away from the training workers.
            stop_spark()
    save_config(cfg, rd)
    splits = ", ".join(f"{k} {v.rows}" for k, v in manifest.splits.items())
    rejected = sum(manifest.counts.get("rows_rejected", {}).values())
    say(f"prepare: {manifest.counts.get('rows_read', '?')} rows read, {rejected} rejected,"
        f" {manifest.counts.get('duplicates_removed', 0)} duplicates removed; {splits}")
    splits = {k: v.rows for k, v in manifest.splits.items()}
    if tracker is not None:
        tracker.set_tags({"data_fingerprint": manifest.fingerprint})
        tracker.log_metrics({"rows_read": manifest.counts.get("rows_read", 0), "rows_rejected": rejected,
                             "duplicates_removed": manifest.counts.get("duplicates_removed", 0),
                             **{f"rows_{k}": v for k, v in splits.items()}})
        tracker.log_artifact(Path(manifest.root) / "manifest.json")
    return {"seconds": round(time.perf_counter() - started, 2), "splits": splits}


def stop_spark() -> None:
    try:
        from pyspark.sql import SparkSession
    except ImportError:
        return
    active = SparkSession.getActiveSession()
    if active is not None:
        active.stop()


def check_trainable(cfg: Config) -> None:
    """Catch in the driver what would otherwise fail in every worker."""
    from torchloom import manifest as manifest_mod
    from torchloom.embedded import model_path
    from torchloom.model.build import check_model_dir
    from torchloom.train.loop import micro_batch_size

    m = manifest_mod.read(run_dir(cfg) / "data")
    micro_batch_size(cfg, cfg.engine.workers)
    check_model_dir(model_path(cfg.model.path))
    if m.split("train").rows < cfg.engine.workers:
        raise UserError(
            f"{m.root}: {m.split('train').rows} training rows for {cfg.engine.workers} workers;"
            " add data or lower engine.workers"
        )
    if cfg.train.resume and cfg.train.resume != "latest" and not (Path(cfg.train.resume) / "meta.json").is_file():
        raise UserError(
            f"train.resume {cfg.train.resume}: not a checkpoint directory; pass 'latest' or checkpoints/step-N"
        )


def launch(cfg: Config, rd: Path, quiet: bool, spark=None) -> dict:
    """Start the workers on the configured engine; returns rank 0's result."""
    if cfg.engine.name == "spark":
        from torchloom.engines import spark as spark_engine

        return spark_engine.train(cfg, rd, quiet=quiet, spark=spark)
    if cfg.engine.name == "ray":
        from torchloom.engines import ray as ray_engine

        return ray_engine.train(cfg, rd, quiet=quiet)
    from torchloom.engines import local

    return local.train(cfg, rd, quiet=quiet)


def write_hooks(rd: Path, hooks: dict) -> None:
    """What the workers must call out to, e.g. an Optuna pruner (train/reporter.py)."""
    from torchloom.train.reporter import HOOKS_FILE

    path = rd / HOOKS_FILE
    if hooks:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(hooks))
        os.replace(tmp, path)
    elif path.exists():
        path.unlink()


def train_stage(cfg: Config, quiet: bool = False, spark=None, tracker=None, hooks: dict | None = None) -> dict:
    check_trainable(cfg)
    rd = run_dir(cfg)
    save_config(cfg, rd)
    from torchloom.tracking import MetricsForwarder, NullTracker
    from torchloom.train.loop import reset_metrics_log

    tracker = tracker or NullTracker()
    if tracker.enabled:
        from torchloom import manifest as manifest_mod

        tracker.set_tags({"data_fingerprint": manifest_mod.read(rd / "data").fingerprint})
    write_hooks(rd, hooks or {})
    # Before any worker starts, so the driver never forwards another run's lines to this run's tracker.
    resume_step = resumed_step(cfg)
    reset_metrics_log(rd / "metrics.jsonl", resume_step)
    say(f"train: {cfg.engine.workers} workers on the {cfg.engine.name} engine, precision {cfg.train.precision},"
        f" global batch {cfg.train.batch_size}, {cfg.train.epochs} epochs; logs in {rd / 'logs'}")
    started = time.perf_counter()
    forward = nullcontext()
    if tracker.enabled:
        after = -1 if resume_step is None else resume_step
        forward = MetricsForwarder(tracker.client, tracker.run_id, rd / "metrics.jsonl", after)
    try:
        with forward:  # rank 0's per-step metrics to MLflow, from here: the workers never import MLflow
            result = launch(cfg, rd, quiet, spark)
    finally:
        write_hooks(rd, {})  # a later run must not report into this run's trial
    result["wall_s"] = round(time.perf_counter() - started, 2)
    (rd / "train_result.json").write_text(json.dumps(result, indent=2))
    tracker.log_metrics({"train_samples_per_s": result["samples_per_s"], "train_steps": result["steps"],
                         "train_first_step_s": result["first_step_s"], "train_wall_s": result["wall_s"]})
    if isinstance(result.get("best_metric"), (int, float)):
        tracker.log_metrics({f"best_val_{cfg.train.metric}": result["best_metric"]}, step=result["best_step"])
    for name in ("config.toml", "metrics.jsonl", "train_result.json"):
        tracker.log_artifact(rd / name)
    say(f"train: {result['steps']} steps in {result['train_s']:.1f} s ({result['samples_per_s']:.1f} samples/s);"
        f" validation {result.get('last_eval') or '-'}")
    return result


def resumed_step(cfg: Config) -> int | None:
    """The step of the checkpoint train.resume names (None: a fresh start)."""
    from torchloom.train import checkpoint

    path = checkpoint.resolve(cfg.train.resume, run_dir(cfg) / "checkpoints")
    return None if path is None else int(json.loads((path / "meta.json").read_text())["step"])


def select_checkpoint(cfg: Config) -> Path:
    from torchloom.train import checkpoint

    root = run_dir(cfg) / "checkpoints"
    last = checkpoint.latest(root)
    if last is None:
        raise UserError(f"{root}: no checkpoint; run torchloom train first")
    if cfg.train.select == "best":
        best_step = json.loads((last / "meta.json").read_text()).get("best_step", -1)
        best = root / f"step-{best_step}"
        if best_step >= 0 and (best / "meta.json").is_file():
            return best
    return last


def export_stage(cfg: Config, tracker=None) -> dict:
    from torchloom import __version__
    from torchloom import manifest as manifest_mod
    from torchloom.embedded import model_path
    from torchloom.model.build import build_classifier
    from torchloom.model.export import export_model
    from torchloom.train import checkpoint

    rd = run_dir(cfg)
    started = time.perf_counter()
    ckpt = select_checkpoint(cfg)
    m = manifest_mod.read(rd / "data")
    src = model_path(cfg.model.path)
    model = build_classifier(src, m.labels)
    model.load_state_dict(checkpoint.load_weights(ckpt))
    meta = json.loads((ckpt / "meta.json").read_text())
    out = export_model(model, src, m.labels, str(rd / "model"), extra_info={
        "torchloom_version": __version__, "checkpoint": str(ckpt), "step": meta.get("step"),
        "validation": meta.get("eval", {}), "data_fingerprint": m.fingerprint,
        "max_length": m.tokenizer.get("max_length"),
    })
    say(f"export: {ckpt.name} -> {out}")
    if tracker is not None and tracker.enabled and cfg.tracking.log_model:
        tracker.log_model(out)
    return {"seconds": round(time.perf_counter() - started, 2), "checkpoint": str(ckpt), "model_dir": out}


def evaluate_stage(cfg: Config, extra: dict | None = None, tracker=None) -> dict:
    from torchloom.evaluate.report import write_report
    from torchloom.evaluate.run import evaluate_model_dir

    rd = run_dir(cfg)
    started = time.perf_counter()
    model_dir = rd / "model"
    if not (model_dir / "config.json").is_file():
        raise UserError(f"{model_dir}: no exported model; run torchloom export (or torchloom run) first")
    from torchloom import manifest as manifest_mod

    if manifest_mod.read(rd / "data").split(cfg.eval.split).rows == 0:
        raise UserError(f"eval.split {cfg.eval.split}: the split is empty in {rd / 'data'}; choose another split"
                        " or prepare with a non-zero fraction for it")
    metrics, misclassified = evaluate_model_dir(cfg, str(model_dir))
    seconds = round(time.perf_counter() - started, 2)
    labels = manifest_mod.read(rd / "data").labels
    write_report(str(rd), metrics, split=cfg.eval.split, label_names=labels, misclassified=misclassified,
                 metrics_jsonl_path=str(rd / "metrics.jsonl"), extra={"evaluate_s": seconds, **(extra or {})})
    if tracker is not None:
        tracker.log_metrics({f"{cfg.eval.split}_{k}": v for k, v in metrics.items()
                             if isinstance(v, (int, float)) and not isinstance(v, bool)})
        for name in ("report.md", "report.json", "plots"):
            tracker.log_artifact(rd / name, "plots" if name == "plots" else None)
    say(f"evaluate ({cfg.eval.split}, {metrics['n']} rows): accuracy {metrics['accuracy']:.4f},"
        f" macro-F1 {metrics['macro_f1']:.4f}; report {rd / 'report.md'}")
    return {"seconds": seconds, "metrics": metrics}


def run_all(cfg: Config) -> dict:
    """prepare -> train -> export -> evaluate into one run dir, then a summary."""
    rd = run_dir(cfg)
    if rd.exists() and any(rd.iterdir()) and not cfg.output.overwrite and not cfg.train.resume:
        raise UserError(
            f"output.dir {rd}: exists and is not empty; pass --output.overwrite true or another --output.dir"
        )
    if rd.exists() and cfg.output.overwrite and not cfg.train.resume:
        shutil.rmtree(rd)
    from torchloom import tracking

    with tracking.start(cfg, "run") as tracker:
        return _run_all(cfg, rd, tracker)


def _run_all(cfg: Config, rd: Path, tracker) -> dict:
    started = time.perf_counter()
    timings: dict[str, float] = {}
    spark = None
    if cfg.engine.name == "spark":
        from torchloom.etl.session import get_spark

        spark = get_spark(cfg.prepare)  # one SparkSession for the ETL and the training
    if cfg.train.resume and (rd / "data" / "manifest.json").is_file():
        say("run: resuming; reusing the prepared data in " + str(rd / "data"))
    else:
        timings["prepare_s"] = prepare_stage(cfg, spark=spark, tracker=tracker)["seconds"]
    result = train_stage(cfg, spark=spark, tracker=tracker)
    timings["train_s"] = result["wall_s"]
    timings["export_s"] = export_stage(cfg, tracker=tracker)["seconds"]
    ev = evaluate_stage(cfg, extra={"timings": timings, "train": result}, tracker=tracker)
    timings["evaluate_s"] = ev["seconds"]
    timings["total_s"] = round(time.perf_counter() - started, 2)
    summary = {
        "run_dir": str(rd),
        "accuracy": ev["metrics"]["accuracy"],
        "macro_f1": ev["metrics"]["macro_f1"],
        "timings": timings,
        "model_dir": str(rd / "model"),
        "report": str(rd / "report.md"),
    }
    if tracker.enabled:
        summary["mlflow_run_id"] = tracker.run_id
        summary["mlflow_uri"] = tracker.uri
    (rd / "summary.json").write_text(json.dumps(summary, indent=2))
    tracker.log_metrics({f"time_{k}": v for k, v in timings.items()})
    tracker.log_artifact(rd / "summary.json")
    stage_times = ", ".join(f"{k[:-2]} {v:.0f}s" for k, v in timings.items() if k != "total_s")
    print(
        f"\ntorchloom run finished in {timings['total_s']:.0f} s ({stage_times})\n"
        f"  test accuracy {summary['accuracy']:.4f}   macro-F1 {summary['macro_f1']:.4f}\n"
        f"  model   {summary['model_dir']}\n  report  {summary['report']}\n"
        f"  plots   {rd / 'plots'}\n  predict torchloom predict --model {summary['model_dir']} \"some text\""
        + (f"\n  mlflow  run {tracker.run_id} in {tracker.uri}" if tracker.enabled else ""),
        flush=True,
    )
    return summary


def env_defaults() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
