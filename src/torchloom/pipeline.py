"""The stages as functions over a run directory: prepare, train, export, evaluate, and all of them."""

from __future__ import annotations

import os
import shutil
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from pathlib import Path

from torchloom import config as config_mod
from torchloom import storage
from torchloom.config import Config
from torchloom.errors import UserError
from torchloom.manifest import read as read_manifest
from torchloom.rundir import RunDir, is_own_file, read_json, replace_local, write_atomic, write_json
from torchloom.train.result import TrainResult


def say(msg: str) -> None:
    print(f"torchloom: {msg}", file=sys.stderr, flush=True)


def visible_gpus(cfg: Config) -> int:
    """CUDA devices a local run could use here: nvidia-smi first (no torch to import on a machine without
    one), then torch's own count, which is what the workers will see."""
    if cfg.engine.name != "local" or cfg.engine.device == "cpu":
        return 0
    from torchloom.machine import gpu_names

    if not gpu_names() and cfg.engine.device == "auto":
        return 0
    from torchloom.model.device import gpu_count

    return gpu_count()


_STORES_CHECKED: set[str] = set()


def check_stores(cfg: Config) -> None:
    """A run or data on a store: the store answers, the bucket exists and the credentials may read the data and
    write the run, said in one line before any stage starts (once per URI and process)."""
    for key, uri, check in (("output.dir", cfg.output.dir, storage.check_writable),
                            ("data.path", cfg.data.path, storage.check_readable),
                            ("data.val_path", cfg.data.val_path, storage.check_readable),
                            ("data.test_path", cfg.data.test_path, storage.check_readable)):
        if storage.is_uri(uri) and storage.redact(uri) != uri:
            raise UserError(f"{key} {storage.redact(uri)}: holds credentials (user:password@ or a query string);"
                            " give them in the environment (AWS_ACCESS_KEY_ID ..., a profile, an instance role),"
                            " never in the URI, which is written to config.toml and logs")
        if storage.is_uri(uri) and uri not in _STORES_CHECKED:
            if key.startswith("data.") and not cfg.prepare.spark_master.startswith("local"):
                continue  # a Spark cluster reads it with its own connector and credentials
            check(uri, key)
            _STORES_CHECKED.add(uri)


def for_this_machine(cfg: Config) -> Config:
    """engine.workers auto counted on this machine, and what cannot run here refused, before any stage
    starts (config/load.resolve_workers); a config already counted passes through. Stores are checked too."""
    check_stores(cfg)
    if not storage.is_uri(cfg.output.dir):
        check_output_dir(RunDir(cfg.output.dir).root)
    if not cfg.output.overwrite:  # --overwrite: rundir.owned_entries says
        check_foreign_config(RunDir(cfg.output.dir))
    if cfg.engine.workers != "auto" and (cfg.engine.name != "local" or cfg.engine.device == "cpu"):
        return cfg
    return config_mod.resolve_workers(cfg, visible_gpus(cfg))


def check_input(cfg: Config) -> None:
    """A local data.path (val_path, test_path) that matches nothing is one line before Spark or MLflow start:
    a typo costs no JVM start-up. prepare checks it again (etl/prepare.py); stores are check_stores'."""
    from torchloom import embedded
    from torchloom.etl.read import check_inputs

    check_inputs(cfg.data, embedded.data_path(cfg.data.path))


def check_prepared(cfg: Config) -> None:
    """`train` on a local output.dir without prepared data: the one line read_manifest gives, before anything
    loads (a run on a store is checked when its working copy is staged)."""
    if not storage.is_uri(cfg.output.dir):
        rd = RunDir(cfg.output.dir)
        if not (rd.data / "manifest.json").is_file():
            read_manifest(rd.data)


def check_output_dir(path: Path) -> None:
    """A local output.dir that cannot be made or written (a file on its path, a directory this user may not
    write) is one line before any stage starts, and nothing is created to find out."""
    fix = "pass another --output.dir"
    if path.exists() and not path.is_dir():
        raise UserError(f"output.dir {path}: is a file, not a directory; {fix}")
    nearest = path
    while not nearest.exists() and nearest.parent != nearest:  # a path under a file does not exist either
        nearest = nearest.parent
    if not nearest.is_dir():
        raise UserError(f"output.dir {path}: cannot be created, {nearest} is a file, not a directory; {fix}")
    if not os.access(nearest, os.W_OK | os.X_OK):
        made = "written" if nearest == path else f"created, {nearest} is not writable"
        raise UserError(f"output.dir {path}: cannot be {made} for this user; {fix} or make it writable")


def run_dir(cfg: Config) -> RunDir:
    return RunDir(cfg.output.dir)


def check_foreign_config(rd: RunDir) -> None:
    """Never write over a config.toml torchloom did not write (a Hugo site's, say), nor into a store's prefix
    that holds objects of someone else's: refused before any stage, from the store itself for a run on one."""
    if rd.remote:
        storage.check_own_prefix(rd)
    elif rd.config.is_file() and not is_own_file(rd.config.name, rd.config.read_bytes()):
        raise UserError(f"output.dir {rd.where}: holds a config.toml that torchloom did not write; it is left"
                        " alone; pass another --output.dir")


def save_config(cfg: Config, rd: RunDir) -> None:
    check_foreign_config(rd)
    try:
        rd.root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"output.dir {rd.root}: cannot be created ({e.strerror}); pass another --output.dir") \
            from None
    config_mod.save(cfg, rd.config)
    storage.push(rd, rd.config)


def local_input(cfg: Config, rd: RunDir) -> Config:
    """Data on a store, read by the embedded local Spark: streamed to this host's working copy first (that
    Spark has no Hadoop S3 connector, and none is on PyPI). A Spark cluster reads its own s3a:// or gs://
    paths with the connector it has, or its tasks stream them (etl/store_read.py), as the local Spark does
    with prepare.input_reader pyarrow (no local copy)."""
    if not cfg.prepare.spark_master.startswith("local") or cfg.prepare.input_reader == "pyarrow":
        return cfg
    paths = {}
    for key in ("path", "val_path", "test_path"):
        value = getattr(cfg.data, key)
        if storage.is_uri(value):
            say(f"prepare: reading {storage.redact(value)} from the store")
            paths[key] = storage.stage_input(value, rd.root / "input" / key, f"data.{key}")
    return replace(cfg, data=replace(cfg.data, **paths)) if paths else cfg


def prepare_stage(cfg: Config, spark=None, tracker=None) -> dict:
    from torchloom.etl.prepare import prepare

    rd = run_dir(cfg)
    started = time.perf_counter()
    if rd.remote:
        _stage_remote_data(cfg, rd)
    try:
        # a Spark cluster's executors do not see this host's working copy: they write through the store
        through = storage.join(rd.remote, "data") if rd.remote and not cfg.prepare.spark_master.startswith("local") \
            else None
        local = local_input(cfg, rd)
        # the inputs read from local copies are named by their URIs
        shown = {getattr(local.data, key): storage.redact(getattr(cfg.data, key))
                 for key in ("path", "val_path", "test_path") if getattr(local.data, key) != getattr(cfg.data, key)}
        manifest = prepare(local, str(rd.data), spark=spark, progress=lambda m: say(f"prepare: {m}"), store=through,
                           shown_inputs=shown, shown_out=rd.home(rd.data))
    finally:
        if spark is None:
            # Nothing later needs the session we started: its JVM would keep memory and wake-ups
            # away from the training workers.
            stop_spark()
    if rd.remote and cfg.output.overwrite:
        storage.delete_tree(storage.join(rd.remote, "data"))  # the earlier shards, whatever their names
    storage.push(rd, rd.data)  # manifest.json last: the prepared data counts once it is there
    storage.new_identity(rd)  # after the data: a host that saw the new record finds the new data
    save_config(cfg, rd)
    splits = ", ".join(f"{k} {v.documents or v.rows}" + (f" ({v.rows} chunks)" if v.documents else "")
                       for k, v in manifest.splits.items())
    reasons = {k: v for k, v in manifest.counts.get("rows_rejected", {}).items() if v}
    rejected = sum(reasons.values())
    why = f" ({', '.join(f'{k} {v}' for k, v in reasons.items())})" if reasons else ""
    say(f"prepare: {manifest.counts.get('rows_read', '?')} rows read, {rejected} set aside{why},"
        f" {manifest.counts.get('duplicates_removed', 0)} duplicates removed; {splits}")
    splits = {k: v.documents or v.rows for k, v in manifest.splits.items()}  # texts, with chunks too
    if tracker is not None:
        tracker.set_tags({"data_fingerprint": manifest.fingerprint})
        tracker.log_metrics({"rows_read": manifest.counts.get("rows_read", 0), "rows_rejected": rejected,
                             "duplicates_removed": manifest.counts.get("duplicates_removed", 0),
                             **{f"rows_{k}": v for k, v in splits.items()}})
        tracker.log_artifact(rd.manifest)
    return {"seconds": round(time.perf_counter() - started, 2), "splits": splits}


def _stage_remote_data(cfg: Config, rd: RunDir) -> None:
    """prepare into a run on a store: the store says whether prepared data is there (never this host's copy,
    which may be of another run); the copy's data directory is cleared for the new data."""
    if storage.list_files(storage.join(rd.remote, "data")) and not cfg.output.overwrite:
        raise UserError(f"output {rd.home(rd.data)}: already exists and is not empty; pass --output.overwrite true to"
                        " replace it")
    storage.sync_copy(rd)
    if rd.data.exists():
        shutil.rmtree(rd.data)


def stop_spark() -> None:
    try:
        from pyspark.sql import SparkSession
    except ImportError:
        return
    active = SparkSession.getActiveSession()
    if active is not None:
        active.stop()


def prepare_with_baseline(cfg: Config, tracker=None) -> dict:
    """prepare, then (eval.baseline) the baseline: on the driver, or on Spark in prepare's SparkSession,
    which is stopped after."""
    cfg = for_this_machine(cfg)
    check_input(cfg)
    check_untrained(cfg)
    if not cfg.eval.baseline:
        return prepare_stage(cfg, tracker=tracker)
    from torchloom.etl.session import get_spark

    spark = get_spark(cfg.prepare)
    try:
        out = prepare_stage(cfg, spark=spark, tracker=tracker)
        fitted = baseline_stage(cfg, spark=spark, tracker=tracker)
        if fitted:
            out["baseline_s"] = fitted["seconds"]
    finally:
        stop_spark()
    return out


def check_untrained(cfg: Config) -> None:
    """prepare --overwrite into a run that was trained: its checkpoints (and model) would belong to data that is
    gone, and a later resume or export would take them; one line before Spark starts, nothing touched."""
    rd = run_dir(cfg)
    if rd.remote:
        trained = bool(storage.list_files(storage.join(rd.remote, "checkpoints")))
    else:
        trained = any(rd.checkpoints.glob("step-*")) if rd.checkpoints.is_dir() else False
    if trained:
        raise UserError(f"output.dir {rd.where}: holds checkpoints trained on the data that prepare would replace;"
                        " start the whole run afresh (torchloom run --overwrite) or prepare into another"
                        " --output.dir")


def baseline_splits(cfg: Config) -> list[str]:
    return list(dict.fromkeys(["val", "test", cfg.eval.split]))


def baseline_stage(cfg: Config, spark=None, tracker=None) -> dict | None:
    """Fit the classical baseline on the train split, C chosen on val, and score the others (etl/baseline.py)
    into baseline.json; None when eval.baseline is off. The driver path (scikit-learn) needs no Spark; the
    Spark path uses `spark`, or starts a session and stops it."""
    if not cfg.eval.baseline:
        return None
    from torchloom import manifest as manifest_mod
    from torchloom.etl import baseline

    rd = run_dir(cfg)
    storage.ensure(rd, rd.data)
    m = manifest_mod.read(rd.data)
    how, started = "the baseline", False
    try:
        engine = baseline.engine_for(m, cfg.eval.baseline_engine)
        how = baseline.ENGINE_NAMES[engine]
        if engine == "spark" and not cfg.prepare.spark_master.startswith("local"):
            m = storage.streamed(rd, m)  # a cluster's executors read the shards from the store, not our copy
        say(f"baseline: {baseline.NAME} ({how}) on the train split's {baseline.train_texts(m)} texts")
        if spark is None and engine == "spark":
            from torchloom.etl.session import get_spark

            spark, started = get_spark(cfg.prepare), True
        result = baseline.fit_and_score(spark, m, baseline_splits(cfg), engine)
    except UserError:
        raise
    except Exception as e:  # the transformer's results do not depend on it: say why, and go on without it
        from torchloom.errors import first_line, one_line

        say(f"baseline: skipped, {how} failed ({one_line(first_line(e), 160)});"
            " --eval.baseline false turns it off")
        return None
    finally:
        if started:
            stop_spark()
    lexical = result.pop("lexical", None)
    shutil.rmtree(rd.baseline_model, ignore_errors=True)  # an earlier fit's arrays never go with this one's scores
    if lexical is not None:  # the arrays the shipped mix scores with (export copies them into the model)
        lexical.save(rd.baseline_model)
        result["model"] = rd.baseline_model.name
    write_json(rd.baseline, result)
    storage.push(rd, rd.baseline, rd.baseline_model)
    say(f"baseline: {baseline.summary_line(result)}")
    if tracker is not None:
        tracker.log_metrics({f"baseline_{k}_{metric}": v[metric] for k, v in result["splits"].items()
                             for metric in ("accuracy", "macro_f1")})
    return result


def stored_baseline(cfg: Config, m) -> dict | None:
    """baseline.json, when it was made from these prepared rows and scored the evaluated split."""
    rd = run_dir(cfg)
    storage.ensure(rd, rd.baseline)
    if not rd.baseline.is_file():
        return None
    try:
        stored = read_json(rd.baseline)
    except (OSError, ValueError):
        return None
    if stored.get("fingerprint") != m.fingerprint or cfg.eval.split not in stored.get("splits", {}):
        return None
    return stored


def check_trainable(cfg: Config) -> int | None:
    """Catch in the driver what would otherwise fail in every worker; returns the step train.resume
    resumes from (None: a fresh start)."""
    from torchloom import manifest as manifest_mod
    from torchloom.embedded import model_path
    from torchloom.model.build import check_model_dir
    from torchloom.train import checkpoint

    rd = run_dir(cfg)
    storage.ensure(rd, rd.manifest)  # the workers stream the shards from the store
    if cfg.train.resume == "latest":  # the newest intact checkpoint alone, hashed once (rank 0 finds it stamped)
        storage.pull_checkpoints(rd, intact=lambda p: checkpoint.damage(p) is None)
    m = manifest_mod.read(rd.data)
    check_model_dir(model_path(cfg.model.path))
    if m.split("train").rows < cfg.engine.workers:
        raise UserError(
            f"{m.root}: {m.split('train').rows} training rows for {cfg.engine.workers} workers;"
            " add data or lower engine.workers"
        )
    # a path that is no checkpoint, or only damaged ones, fails here, once; rank 0 warns of what it skips
    path = checkpoint.resolve(cfg.train.resume, rd.checkpoints, warn=False)
    return None if path is None else int(checkpoint.read_meta(path)["step"])


def launch(cfg: Config, rd: RunDir, quiet: bool, spark=None) -> TrainResult:
    """Start the workers on the configured engine; returns rank 0's result."""
    if cfg.engine.name == "spark":
        from torchloom.engines import spark as spark_engine

        return spark_engine.train(cfg, rd.location, quiet=quiet, spark=spark)
    if cfg.engine.name == "ray":
        from torchloom.engines import ray as ray_engine

        return ray_engine.train(cfg, rd.location, quiet=quiet)
    from torchloom.engines import local

    return local.train(cfg, rd.location, quiet=quiet)


def precision_line(cfg: Config) -> str:
    """What train.precision is for the workers: decided here for the local engine (this machine is theirs),
    by each worker on its own device on Spark and Ray (the result says what they chose)."""
    if cfg.engine.name != "local":
        return f"precision {cfg.train.precision}" + (" (each worker decides on its device)"
                                                       if cfg.train.precision == "auto" else "")
    from torchloom.model.device import choose_precision

    device = "cuda" if visible_gpus(cfg) else "cpu"
    choice = choose_precision(cfg.train.precision, device, scaler_ok=cfg.train.strategy == "ddp")
    if choice.warning:
        say(f"warning: {choice.warning}")
    return f"precision {choice.precision} ({choice.reason})"


def how_long(cfg: Config) -> Config:
    """train.epochs and early stopping made numbers for the prepared data (config/budget.py), said in one line."""
    from torchloom.config import budget

    m = read_manifest(run_dir(cfg).data)
    cfg, line = budget.resolve(cfg, m.num_labels, m.split("train").rows)
    if line:
        say(f"train: {line}")
    return cfg


def _start_history(rd: RunDir, resume_step: int | None, startup: dict | None) -> None:
    """metrics.jsonl for this training, before any worker starts (so the driver never forwards another run's lines
    to this run's tracker), with the driver's start-up record first; a fresh training voids other hosts' copies of
    the earlier one (its checkpoints)."""
    if resume_step is None:
        storage.new_identity(rd)
    else:  # this host's copy may lack the earlier lines (written on another host): the store's history first
        storage.catch_up_metrics(rd, resume_step)
    rd.reset_metrics(resume_step)
    if startup:
        rd.append_metrics({"kind": "startup", "step": resume_step or 0, "side": "driver",
                           **{k: round(v, 3) for k, v in startup.items()}})


@contextmanager
def kept_unless_started(rd: RunDir):
    """config.toml and metrics.jsonl as they were before this launch, put back if it fails before any worker has
    started (an unreachable cluster, no free slots): a launch that never ran takes nothing of the earlier one."""
    kept = {p: p.read_bytes() if p.is_file() else None for p in (rd.config, rd.metrics)}
    since = time.time()
    try:
        yield
    except BaseException:
        if not workers_started(rd, since):
            for path, content in kept.items():
                if content is None:
                    path.unlink(missing_ok=True)
                else:
                    write_atomic(path, content)
                    storage.push(rd, path)
        raise


def workers_started(rd: RunDir, since: float) -> bool:
    """Whether a rank of a launch begun at `since` recorded its start (logs/placement-*.json), here or on the
    run's store."""
    if any(p.stat().st_mtime >= since for p in rd.logs.glob("placement-*")) if rd.logs.is_dir() else False:
        return True
    if rd.remote is None:
        return False
    try:
        objects = storage.list_objects(storage.join(rd.remote, "logs"))
    except UserError:
        return True  # cannot tell: keep what the launch wrote
    return any(rel.startswith("placement-") and (mtime or 0) / 1e9 >= since - 5 for rel, (_, mtime) in objects.items())


def train_stage(cfg: Config, quiet: bool = False, spark=None, tracker=None, hooks: dict | None = None,
                startup: dict | None = None) -> TrainResult:
    """Launch the workers on the configured engine; hooks: reporters every worker adds (engines/common.py);
    startup: the driver's phases before the launch (seconds), the first record of metrics.jsonl."""
    from torchloom.tracking import MetricsForwarder, NullTracker

    cfg = for_this_machine(cfg)
    resume_step = check_trainable(cfg)
    cfg = how_long(cfg)
    if cfg.engine.name == "spark":  # its barrier slots counted before anything is written
        from torchloom.engines.spark import check_slots

        spark = check_slots(cfg, spark)
    rd = run_dir(cfg)
    tracker = tracker or NullTracker()
    if tracker.enabled:
        from torchloom import manifest as manifest_mod

        tracker.set_tags({"data_fingerprint": manifest_mod.read(rd.data).fingerprint})
    started = time.perf_counter()
    try:
        with kept_unless_started(rd):
            save_config(cfg, rd)
            rd.write_hooks(hooks or {})
            _start_history(rd, resume_step, startup)
            say(f"train: {cfg.engine.workers} workers on the {cfg.engine.name} engine, {precision_line(cfg)},"
                f" global batch {cfg.train.batch_size}, {cfg.train.epochs} epochs; logs in {rd.home(rd.logs)}")
            forward = nullcontext()
            if tracker.enabled:
                after = -1 if resume_step is None else resume_step
                forward = MetricsForwarder(tracker.client, tracker.run_id, rd.metrics, after)
            with forward:  # rank 0's per-step metrics to MLflow, from here: the workers never import MLflow
                result = launch(cfg, rd, quiet, spark)
    finally:
        rd.write_hooks({})  # a later run must not report into this run's trial
    result.wall_s = round(time.perf_counter() - started, 2)
    write_json(rd.train_result, result.to_dict())
    storage.push(rd, rd.train_result, rd.metrics, rd.progress, rd.logs)
    tracker.log_metrics({"train_samples_per_s": result.samples_per_s, "train_steps": result.steps,
                         "train_first_step_s": result.first_step_s, "train_wall_s": result.wall_s,
                         "train_preemptions": len(result.preemptions)})
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
    say(f"train: {result.steps} steps in {result.train_s:.1f} s ({result.samples_per_s:.1f} samples/s),"
        f" precision {result.precision} ({result.precision_reason}); validation {result.last_eval or '-'}")
    return result


def export_stage(cfg: Config, tracker=None) -> dict:
    from torchloom import __version__
    from torchloom import manifest as manifest_mod
    from torchloom.embedded import model_path
    from torchloom.model.build import build_classifier
    from torchloom.model.export import export_model
    from torchloom.train import checkpoint

    rd = run_dir(cfg)
    started = time.perf_counter()
    storage.ensure(rd, rd.data)
    storage.pull_checkpoints(rd)
    ckpt = checkpoint.select(rd.checkpoints, cfg.train.select)
    m = manifest_mod.read(rd.data)
    src = model_path(cfg.model.path)
    model = build_classifier(src, m.labels)
    model.load_state_dict(checkpoint.load_weights(ckpt))
    meta = checkpoint.read_meta(ckpt)
    combine = choose_combine(cfg, rd, model, m)
    shipped = combine is not None and combine["weight"] < 1.0
    out = export_model(model, src, m.labels, str(rd.model), extra_info={
        "torchloom_version": __version__, "checkpoint": rd.home(ckpt), "step": meta.get("step"),
        "validation": meta.get("eval", {}), "data_fingerprint": m.fingerprint,
        "max_length": m.tokenizer.get("max_length"), "truncation": m.tokenizer.get("truncation", "head"),
        **{k: m.tokenizer[k] for k in ("stride", "max_chunks") if k in m.tokenizer},
        **({"combine": combine} if combine else {}),
    }, extra_dirs={"baseline": rd.baseline_model} if shipped else None)
    say(f"export: {ckpt.name} -> {rd.home(out)}")
    if combine:
        say(f"export: {combine_line(combine)}")
    onnx_info = None
    if cfg.export.format != "hf":
        from torchloom.data.texts import gate_rows
        from torchloom.model.onnx import export_onnx

        onnx_info = export_onnx(out, gate_rows(m, cfg.export.gate_rows), cfg.export.format,
                                say=lambda msg: say(f"export: {msg}"))
    storage.push(rd, rd.model)
    if tracker is not None and tracker.enabled and cfg.tracking.log_model:
        tracker.log_model(out)
    return {"seconds": round(time.perf_counter() - started, 2), "checkpoint": str(ckpt), "model_dir": out,
            "onnx": onnx_info}


def choose_combine(cfg: Config, rd: RunDir, model, m) -> dict | None:
    """export.combine: the transformer's weight in the shipped mix with the baseline, chosen on val (evaluate/mix.py);
    None without a baseline fitted on these prepared rows by the driver."""
    if cfg.export.combine == "off":
        return None
    storage.ensure(rd, rd.baseline, rd.baseline_model)
    try:
        fitted_on = read_json(rd.baseline).get("fingerprint")
    except (OSError, ValueError):
        fitted_on = None
    if fitted_on != m.fingerprint:  # no baseline, or one of other rows: the transformer alone
        return None
    from torchloom.evaluate.mix import choose_combine as choose
    from torchloom.evaluate.run import split_probabilities

    return choose(cfg.export.combine, lambda: split_probabilities(cfg, model, m, "val"), m, rd.baseline_model)


def combine_line(combine: dict) -> str:
    """What export says of the mix: the weight and why, from the val accuracies it was chosen on."""
    val = combine["val_accuracy"]
    scores = (f"val accuracy: transformer {val['transformer']:.4f}, baseline {val['baseline']:.4f},"
              f" shipped {val['shipped']:.4f} on {combine['texts']} texts")
    if combine["weight"] >= 1.0:
        return f"ships the transformer alone (the mix with the baseline did not beat it on val; {scores})"
    return (f"ships the mix: {combine['weight']:.2f} x the transformer + {1 - combine['weight']:.2f} x the baseline"
            f" ({scores})")


def evaluate_stage(cfg: Config, extra: dict | None = None, tracker=None, announce: bool = True) -> dict:
    """Score the exported model (and the baseline beside it); announce: print the verdict line here (run
    prints it in its summary instead)."""
    from torchloom.evaluate.report import write_report
    from torchloom.evaluate.run import evaluate_model_dir

    rd = run_dir(cfg)
    started = time.perf_counter()
    from torchloom import manifest as manifest_mod
    from torchloom.model.export import check_exported

    storage.ensure(rd, rd.model, rd.data)
    check_exported(rd.model, "run torchloom export (or torchloom run) first")
    m = manifest_mod.read(rd.data)
    if m.split(cfg.eval.split).rows == 0:
        raise UserError(f"eval.split {cfg.eval.split}: the split is empty in {rd.home(rd.data)}; choose another split"
                        " or prepare with a non-zero fraction for it")
    metrics, misclassified = evaluate_model_dir(cfg, str(rd.model))
    cmp, line = None, None
    if cfg.eval.baseline:
        from torchloom.evaluate.baseline import comparison, verdict

        stored = stored_baseline(cfg, m) or baseline_stage(cfg, tracker=tracker)
        cmp = comparison(metrics, stored, cfg.eval.split) if stored else None
        line = verdict(cmp, m, (extra or {}).get("train") or _train_result(rd)) if cmp else None
    seconds = round(time.perf_counter() - started, 2)
    gate = onnx_gate(rd.model)
    write_report(rd, metrics, split=cfg.eval.split, label_names=m.labels, misclassified=misclassified,
                 extra={"evaluate_s": seconds, **(extra or {}), **({"onnx_export": gate} if gate else {})},
                 baseline=cmp, verdict=line)
    storage.push(rd, rd.report_md, rd.report_json, rd.misclassified, rd.plots)
    if tracker is not None:
        tracker.log_metrics({f"{cfg.eval.split}_{k}": v for k, v in metrics.items()
                             if isinstance(v, (int, float)) and not isinstance(v, bool)})
        tracker.log_artifact(rd.report_md)
        tracker.log_artifact(rd.report_json)
        tracker.log_artifact(rd.plots, "plots")
    against = f" (baseline {cmp['accuracy']:.4f}, {cmp['macro_f1']:.4f})" if cmp else ""
    say(f"evaluate ({cfg.eval.split}, {metrics['n']} rows): accuracy {metrics['accuracy']:.4f},"
        f" macro-F1 {metrics['macro_f1']:.4f}{against}; report {rd.home(rd.report_md)}")
    if line and announce:
        say(line)
    return {"seconds": seconds, "metrics": metrics, "baseline": cmp, "verdict": line}


def onnx_gate(model_dir) -> dict | None:
    """The ONNX export's parity gate (torchloom.json "onnx"), flat for the report; None without one."""
    from torchloom.model.export import read_export_info

    info = read_export_info(model_dir).get("onnx")
    if not info:
        return None
    gate = info.get("gate", {})
    fused = info.get("fused")
    if isinstance(fused, dict):
        from torchloom.model.onnx import fused_ops

        fused = fused_ops(fused) or "none"
    flat = {"format": info.get("format"), "file": info.get("file"), "exporter": info.get("exporter"),
            "fused ops": fused, "gate split": gate.get("split"),
            "gate rows": gate.get("rows"), "PyTorch accuracy": gate.get("torch_accuracy")}
    for kind in ("fp32", "int8"):
        for key, value in (gate.get(kind) or {}).items():
            flat[f"{kind} {key.replace('_', ' ')}"] = value
    return flat


def _train_result(rd: RunDir) -> dict | None:
    try:
        return read_json(rd.train_result)
    except (OSError, ValueError):
        return None


def run_all(cfg: Config) -> dict:
    """prepare -> train -> export -> evaluate into one run dir, then a summary."""
    cfg = for_this_machine(cfg)
    rd = run_dir(cfg)
    if not (cfg.train.resume and rd.manifest.is_file()):  # a resume reuses the prepared data
        check_input(cfg)  # every input checked before --overwrite deletes anything
    if rd.remote:
        _fresh_remote(cfg, rd)
    exists = rd.root.exists()
    if exists and any(rd.root.iterdir()) and not cfg.output.overwrite and not cfg.train.resume and not rd.remote:
        raise UserError(
            f"output.dir {rd.root}: exists and is not empty; pass --output.overwrite true or another --output.dir"
        )
    if exists and not cfg.train.resume:
        if rd.remote:  # a staging copy is ours to replace; the store's side was replaced above
            shutil.rmtree(rd.root)
        elif cfg.output.overwrite:
            replace_local(rd.root)
    from torchloom import tracking

    with tracking.start(cfg, "run") as tracker:
        return _run_all(cfg, rd, tracker)


def _fresh_remote(cfg: Config, rd: RunDir) -> None:
    """A run on a store: the store answers and takes writes (one line otherwise, before any work); a prefix
    that holds a run is refused without --overwrite or --resume, and its own objects replaced with --overwrite."""
    storage.check_writable(rd.remote, "output.dir")
    if cfg.train.resume:
        return
    if storage.run_listing(rd):  # its lease aside: this driver's own, taken before (lease.py)
        if not cfg.output.overwrite:
            raise UserError(f"output.dir {rd.where}: holds objects already; pass --output.overwrite true or another"
                            " --output.dir")
        storage.replace_remote(rd)


def _run_all(cfg: Config, rd: RunDir, tracker) -> dict:
    started = time.perf_counter()
    timings: dict[str, float] = {}
    startup: dict[str, float] = {}  # the driver's phases before the workers launch (the start-up account)
    spark = _prepare_and_baseline(cfg, rd, tracker, timings, startup)
    result = train_stage(cfg, spark=spark, tracker=tracker, startup=startup)
    if cfg.engine.name == "local":
        from torchloom.engines import local

        local.stop_fork_server()  # ~300 MB of the workers' imports, idle from here on
    timings["train_s"] = result.wall_s
    timings["export_s"] = export_stage(cfg, tracker=tracker)["seconds"]
    ev = evaluate_stage(cfg, extra={"timings": timings, "train": result.to_dict()}, tracker=tracker, announce=False)
    timings["evaluate_s"] = ev["seconds"]
    timings["total_s"] = round(time.perf_counter() - started, 2)
    # the first step ended this long after the run started: everything before training, then the launch's part
    startup["first_step_after_s"] = round(timings["total_s"] - timings["train_s"] - timings["export_s"]
                                          - timings["evaluate_s"] + result.first_step_s, 2)
    summary = {
        "run_dir": rd.where, "accuracy": ev["metrics"]["accuracy"], "macro_f1": ev["metrics"]["macro_f1"],
        "timings": timings, "model_dir": rd.home(rd.model), "report": rd.home(rd.report_md),
        "precision": result.precision, "precision_reason": result.precision_reason,
        "workers": cfg.engine.workers, "startup": {**startup, **result.startup},
        "training": training_line(cfg, result),
    }
    if result.uploads:  # a run on a store: checkpoints uploaded, the loop's wait for them, their upload time
        summary["uploads"] = result.uploads
    if result.preemptions:
        summary["preemptions"] = result.preemptions
    cmp = ev.get("baseline")
    if cmp:
        summary["baseline"] = {k: cmp[k] for k in ("name", "accuracy", "macro_f1", "accuracy_gain", "macro_f1_gain",
                                                   "transformer_accuracy", "transformer_macro_f1")}
        if cmp.get("shipped"):
            summary["shipped"] = cmp["shipped"]
        summary["verdict"] = ev.get("verdict")
    if tracker.enabled:
        summary["mlflow_run_id"] = tracker.run_id
        summary["mlflow_uri"] = tracker.shown_uri
    write_json(rd.summary, summary)
    storage.push(rd, rd.summary)
    tracker.log_metrics({f"time_{k}": v for k, v in timings.items()})
    tracker.log_artifact(rd.summary)
    print(summary_text(summary, cfg.eval.split, rd, tracker), flush=True)
    return summary


def _prepare_and_baseline(cfg: Config, rd: RunDir, tracker, timings: dict, startup: dict):
    """prepare (or, on a resume, the prepared data as it is) and the baseline in one SparkSession; returns
    the session when the Spark engine trains next, else stops it (its JVM would keep memory and wake-ups
    away from the workers)."""
    from torchloom.etl.session import get_spark

    t = time.perf_counter()
    spark = get_spark(cfg.prepare)  # one SparkSession for the ETL, the baseline and the Spark engine
    startup["spark_start_s"] = time.perf_counter() - t
    if cfg.train.resume and rd.manifest.is_file():
        say(f"run: resuming; reusing the prepared data in {rd.home(rd.data)}")
    else:
        timings["prepare_s"] = prepare_stage(cfg, spark=spark, tracker=tracker)["seconds"]
        done = read_manifest(rd.data).timings
        startup.update({"read_clean_s": done.get("read_clean_dedup", 0.0) + done.get("write_rejected", 0.0),
                        "tokenize_s": done.get("tokenize_write", 0.0)})
    if cfg.eval.baseline:
        stored = stored_baseline(cfg, read_manifest(rd.data))
        if stored is None:  # fitted now, and logged as it is
            fitted = baseline_stage(cfg, spark=spark, tracker=tracker)
            if fitted:
                timings["baseline_s"] = startup["baseline_s"] = fitted["seconds"]
        else:  # a resumed run reuses it: this run's tracker gets its scores once
            tracker.log_metrics({f"baseline_{k}_{metric}": v[metric] for k, v in stored["splits"].items()
                                 for metric in ("accuracy", "macro_f1")})
    if cfg.engine.name == "spark":
        return spark
    stop_spark()
    return None


def training_line(cfg: Config, result: TrainResult) -> str:
    """How long training ran against what was asked or chosen (train.epochs auto: config/budget.py), one line."""
    from torchloom.config import budget

    m = read_manifest(run_dir(cfg).data)
    chosen, why = cfg.train.epochs, None
    if chosen == "auto":
        chosen, why = budget.choose_epochs(cfg.train.budget, m.num_labels, m.split("train").rows,
                                           cfg.train.batch_size)
    stop = {"early_stopping": "; stopped early: validation had stopped improving",
            "budget": f"; stopped at train.budget {cfg.train.budget}"}.get(result.stop_reason or "", "")
    return (f"{result.epochs:g} of {chosen} epochs" + (f" (epochs auto: {why})" if why else "") + stop
            + (f"; the best on validation (step {result.best_step}) exported"
               if result.best_step and cfg.train.select == "best" else ""))


def summary_text(summary: dict, split: str, rd: RunDir, tracker) -> str:
    """What `torchloom run` prints at the end."""
    timings = summary["timings"]
    stage_times = ", ".join(f"{k[:-2]} {v:.0f}s" for k, v in timings.items() if k != "total_s")
    lines = [f"\ntorchloom run finished in {timings['total_s']:.0f} s ({stage_times})",
             f"  {split} accuracy {summary['accuracy']:.4f}   macro-F1 {summary['macro_f1']:.4f}",
             f"  precision {summary['precision']} ({summary['precision_reason']}); {summary['workers']} workers",
             f"  trained {summary['training']}",
             f"  start-up {startup_line(summary['startup'])}"]
    cmp, shipped = summary.get("baseline"), summary.get("shipped")
    if shipped:  # three rows: what ships (above), the transformer alone, the baseline
        lines[1] += (f"   (shipped: {shipped['weight']:.2f} x the transformer + {1 - shipped['weight']:.2f} x the"
                     " baseline, the weight chosen on val)")
        lines.append(f"  transformer {cmp['transformer_accuracy']:.4f}   macro-F1 {cmp['transformer_macro_f1']:.4f}")
    if cmp:
        lines.append(f"  baseline {cmp['accuracy']:.4f}   macro-F1 {cmp['macro_f1']:.4f}   ({cmp['name']};"
                     f" the transformer {cmp['accuracy_gain'] * 100:+.1f} points of accuracy)")
    if summary.get("verdict"):
        lines.append(f"  note    {summary['verdict']}")
    lines += [f"  model   {summary['model_dir']}", f"  report  {summary['report']}", f"  plots   {rd.home(rd.plots)}",
              f"  predict torchloom predict --model {summary['model_dir']} \"some text\""]
    if tracker.enabled:
        lines.append(f"  mlflow  run {tracker.run_id} in {tracker.shown_uri}")
    return "\n".join(lines)


STARTUP_NAMES = {"spark_start_s": "Spark start", "read_clean_s": "read+clean", "tokenize_s": "tokenize",
                 "baseline_s": "baseline", "worker_launch_s": "worker launch", "process_group_s": "process group",
                 "model_load_s": "model load", "data_s": "loader", "first_step_s": "first step"}


def startup_line(startup: dict) -> str:
    """The start-up account as one line: each phase before the first step, then when that step ended."""
    parts = [f"{name} {startup[k]:.1f}s" for k, name in STARTUP_NAMES.items() if startup.get(k) is not None]
    end = startup.get("first_step_after_s")
    return ", ".join(parts) + (f" (first step done {end:.0f} s after the start)" if end is not None else "")


def env_defaults() -> None:
    """The environment of the command (and the local workers it starts): models from local directories only."""
    from torchloom.model.env import use_model_env

    use_model_env()
