"""The train stage: the workers launched on the configured engine (engines/), the run's history and record kept
as they were if the launch never started a worker, and what training did said and tracked."""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext

from torchloom.config import Config
from torchloom.config.engines import Engine, engine_of
from torchloom.console import precision_line, say, speed_line
from torchloom.errors import UserError
from torchloom.jsonio import write_atomic, write_json
from torchloom.manifest import read as read_manifest
from torchloom.preflight import check_trainable
from torchloom.runs.run import Run
from torchloom.runs.rundir import RunDir
from torchloom.runs.runfiles import RunFiles
from torchloom.stages import recorded, save_config
from torchloom.train.result import TrainResult


def launch(run: Run, quiet: bool) -> TrainResult:
    """Start the workers on the configured engine with the run's files; returns rank 0's result."""
    cfg = run.cfg
    engine = engine_of(cfg.engine)
    train = launcher_function(engine, "train")
    if engine.uses_spark:  # the session prepare started, or the one it checked the slots of
        return train(cfg, run.files, quiet=quiet, spark=run.spark)
    return train(cfg, run.files, quiet=quiet)


def launcher_function(engine: Engine, name: str):
    """A function of the engine's launcher module (engines/<launcher>.py: its train, its hooks), imported now."""
    import importlib

    return getattr(importlib.import_module(f"torchloom.engines.{engine.launcher}"), name)


def after_training(cfg: Config) -> None:
    """The engine's hook after training (the local engine's fork server stopped), if it has one."""
    engine = engine_of(cfg.engine)
    if engine.after_training:
        launcher_function(engine, engine.after_training)()


def how_long(cfg: Config, rd: RunDir, resuming: bool = False) -> Config:
    """train.batch_size, train.epochs and early stopping made numbers for the prepared data (config/budget.py), said
    in one line. resuming: batch_size auto keeps the batch the run trained with (its config.toml)."""
    from torchloom.config import batch_multiple, budget, load_saved

    m = read_manifest(rd.data)
    resumed = None
    if resuming and cfg.train.batch_size == "auto" and rd.config.is_file():
        resumed = load_saved(rd.config).train.batch_size
    cfg, line = budget.resolve(cfg, m.num_labels, m.split("train").rows, m.tokenizer.get("max_length") or 128,
                               batch_multiple(cfg.train, cfg.engine.workers),
                               resumed if isinstance(resumed, int) else None)
    if line:
        say(f"train: {line}")
    return cfg


def _start_history(files: RunFiles, resume_step: int | None, startup: dict | None) -> None:
    """metrics.jsonl for this training, before any worker starts (so the driver never forwards another run's lines
    to this run's tracker), with the driver's start-up record first; a fresh training voids other hosts' copies of
    the earlier one (its checkpoints)."""
    rd = files.rd
    if resume_step is None:
        files.new_identity()
    else:  # this host's copy may lack the earlier lines (written on another host): the store's history first
        files.catch_up_metrics(resume_step)
    rd.reset_metrics(resume_step)
    if startup:
        rd.append_metrics({"kind": "startup", "step": resume_step or 0, "side": "driver",
                           **{k: round(v, 3) for k, v in startup.items()}})


@contextmanager
def kept_unless_started(files: RunFiles):
    """config.toml and metrics.jsonl as they were before this launch, put back if it fails before any worker has
    started (an unreachable cluster, no free slots): a launch that never ran takes nothing of the earlier one."""
    rd = files.rd
    kept = {p: p.read_bytes() if p.is_file() else None for p in (rd.config, rd.metrics)}
    since = time.time()
    try:
        yield
    except BaseException:
        if not workers_started(files, since):
            for path, content in kept.items():
                if content is None:
                    path.unlink(missing_ok=True)
                else:
                    write_atomic(path, content)
                    files.push(path)
        raise


def workers_started(files: RunFiles, since: float) -> bool:
    """Whether a rank of a launch begun at `since` recorded its start (logs/placement-*.json), here or on the
    run's store."""
    rd = files.rd
    if any(p.stat().st_mtime >= since for p in rd.logs.glob("placement-*")) if rd.logs.is_dir() else False:
        return True
    try:
        stored = files.modified(rd.logs)  # a local run: {}
    except UserError:
        return True  # cannot tell: keep what the launch wrote
    return any(rel.startswith("placement-") and (mtime or 0) / 1e9 >= since - 5 for rel, mtime in stored.items())


def tracked_metrics(result: TrainResult) -> dict[str, float]:
    """What MLflow gets of a training: speed, steps, preemptions and where the time went."""
    return {"train_samples_per_s": result.samples_per_s, "train_steps": result.steps,
            "train_first_step_s": result.first_step_s, "train_wall_s": result.wall_s,
            "train_preemptions": len(result.preemptions), "train_tokens_per_s": result.tokens_per_s,
            "train_padding": result.padding, **({"train_mfu": result.mfu} if result.mfu is not None else {}),
            **({"train_compiled_graphs": result.compiled_graphs} if result.compiled_graphs is not None else {}),
            **{f"train_time_{k}": v for k, v in result.time_split.items()}}


def notify_url(cfg: Config) -> str:
    import os

    return cfg.tracking.notify_url or os.environ.get("TORCHLOOM_NOTIFY_URL", "")


def alert(cfg: Config, rd: RunDir, event: str, text: str, **fields) -> None:
    """One message to the webhook (tracking.notify_url), if one is set; a line on stderr either way."""
    url = notify_url(cfg)
    if not url:
        return
    from torchloom import notify

    problem = notify.check_url(url)
    if problem:
        say(f"alert: TORCHLOOM_NOTIFY_URL: {problem}")
        return
    run = str(rd.where)
    notify.send(url, event, f"torchloom {run}: {text}",
                {"run": run, "engine": cfg.engine.name, "workers": cfg.engine.workers, **fields}, say=say)


@contextmanager
def alerting(cfg: Config, rd: RunDir):
    """A training that fails, or is preempted with nothing left here to go on, alerts the webhook."""
    from torchloom.engines.common import Preempted, TrainingFailed

    try:
        yield
    except TrainingFailed as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else "a worker failed"
        alert(cfg, rd, "train_failed", f"training failed: {first[:300]}", error=str(e)[-4000:])
        raise
    except Preempted as e:
        alert(cfg, rd, "train_preempted", f"training preempted, past what it could absorb: {e}", error=str(e))
        raise


def last_validation(rd: RunDir, metric: str) -> tuple[int, float] | None:
    """(step, value) of the last validation in the run's history so far (a resumed run's: the one it resumes)."""
    import json

    last = None
    if rd.metrics.exists():
        for line in rd.metrics.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and record.get("kind") == "eval" and isinstance(record.get(metric),
                                                                                        (int, float)):
                last = (int(record.get("step", 0)), float(record[metric]))
    return last


def worse_after_resume(cfg: Config, rd: RunDir, before: tuple[int, float] | None, result: TrainResult,
                       resume_step: int | None) -> None:
    """A resumed training whose last validation is worse than the one before it resumed: said, and alerted."""
    from torchloom.train.state import better

    metric = cfg.train.metric
    now = result.last_eval.get(metric) if result.last_eval else None
    if before is None or not isinstance(now, (int, float)) or result.steps <= before[0]:
        return
    if now == before[1] or better(metric, now, before[1]):
        return
    text = (f"validation {metric} {now:.4f} at step {result.steps}, worse than {before[1]:.4f} at step {before[0]}"
            f" before it resumed (from step {resume_step})")
    say(f"train: warning: {text}")
    alert(cfg, rd, "train_worse_after_resume", f"resumed training ended worse: {text}", metric=metric,
          value=now, before=before[1], before_step=before[0], step=result.steps)


@recorded
def train_stage(run: Run, quiet: bool = False, hooks: dict | None = None,
                startup: dict | None = None) -> TrainResult:
    """Launch the workers on the configured engine; hooks: reporters every worker adds (engines/common.py);
    startup: the driver's phases before the launch (seconds), the first record of metrics.jsonl."""
    from torchloom.tracking import MetricsForwarder, NullTracker

    resume_step = check_trainable(run)
    run = run.but(cfg=how_long(run.cfg, run.rd, resuming=resume_step is not None))
    cfg, rd = run.cfg, run.rd
    check_cluster = engine_of(cfg.engine).check_cluster
    if check_cluster:  # Spark's barrier slots, counted before anything is written
        run = run.but(spark=launcher_function(engine_of(cfg.engine), check_cluster)(cfg, run.spark))
    tracker = run.tracker or NullTracker()
    if tracker.enabled:
        from torchloom import manifest as manifest_mod

        tracker.set_tags({"data_fingerprint": manifest_mod.read(rd.data).fingerprint})
    started = time.perf_counter()
    try:
        with kept_unless_started(run.files):
            save_config(run)
            rd.write_hooks(hooks or {})
            _start_history(run.files, resume_step, startup)
            say(f"train: {cfg.engine.workers} workers on the {cfg.engine.name} engine, {precision_line(cfg)},"
                f" global batch {cfg.train.batch_size}, {cfg.train.epochs} epochs; logs in {rd.home(rd.logs)}")
            forward = nullcontext()
            if tracker.enabled:
                after = -1 if resume_step is None else resume_step
                forward = MetricsForwarder(tracker.client, tracker.run_id, rd.metrics, after)
            before = last_validation(rd, cfg.train.metric) if resume_step is not None else None
            with forward, alerting(cfg, rd):  # rank 0's per-step metrics to MLflow: the workers never import MLflow
                result = launch(run, quiet)
    finally:
        rd.write_hooks({})  # a later run must not report into this run's trial
    result.wall_s = round(time.perf_counter() - started, 2)
    write_json(rd.train_result, result.to_dict())
    run.files.push(rd.train_result, rd.metrics, rd.progress, rd.logs)
    tracker.log_metrics(tracked_metrics(result))
    if isinstance(result.best_metric, (int, float)):
        tracker.log_metrics({f"best_val_{cfg.train.metric}": result.best_metric}, step=result.best_step)
    for path in (rd.config, rd.metrics, rd.train_result):
        tracker.log_artifact(path)
    for p in result.preemptions:  # apart from failures: they never used engine.max_restarts
        written = f"checkpoint written in {p['checkpoint_s']:.1f} s" if p["checkpoint_s"] >= 0 else "no checkpoint"
        say(f"train: preempted at step {p['step']} (notice: {p['notice']}), {written}; resumed on {p['workers']}"
            f" workers from step {p['resumed_from_step']}")
    if result.resumed_world_size:
        say(f"train: resumed at step {result.resumed_at_step} on {result.world_size} workers (the checkpoint's run"
            f" had {result.resumed_world_size}); the same global batches went on")
    worse_after_resume(cfg, rd, before, result, resume_step)
    say(f"train: {result.steps} steps in {result.train_s:.1f} s, precision {result.precision}"
        f" ({result.precision_reason}); validation {result.last_eval or '-'}")
    say(f"train: {speed_line(result)}")
    return result
