"""The commands that use an exported model: `predict` (texts, files locally or on Spark, two models compared),
`serve` (one model or several) and `monitor`; their arguments and the model's way from a store to this host."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from torchloom.errors import UserError
from torchloom.serve.arguments import OldName


def add_tracking_uri(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--tracking-uri", "--tracking.uri", dest="tracking_uri", default=None, metavar="URI",
                    help="the MLflow registry of a models:/NAME@ALIAS model (default $MLFLOW_TRACKING_URI, else"
                         " ./mlflow.db)")


def use_tracking_uri(args: argparse.Namespace) -> None:
    """--tracking-uri where a models:/ URI is looked up (registry.fetch reads it as MLflow does)."""
    if getattr(args, "tracking_uri", None):
        os.environ["MLFLOW_TRACKING_URI"] = args.tracking_uri


def add_monitor_arguments(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--model", required=True,
                    help="an exported model dir (its monitor/profile.json is written at export), or a registered"
                         " model: models:/NAME@ALIAS")
    sp.add_argument("--input", required=True,
                    help="the new texts: a CSV, JSON lines or .txt file, as predict reads it")
    sp.add_argument("--text-column", default="text", help="the column or field with the texts (default text)")
    sp.add_argument("--outliers", type=int, default=10, metavar="N",
                    help="list the N most unusual texts in the report, by their outlier score against the reference"
                         " (default 10; 0: none)")
    sp.add_argument("--labels", metavar="COLUMN", help="a column with the true labels: the real accuracy is reported"
                                                       " beside the estimate")
    sp.add_argument("--output", default="monitor-report",
                    help="the report's directory: report.md, monitor.json, plots/ (default monitor-report)")
    sp.add_argument("--overwrite", action="store_true", help="replace an earlier report of torchloom's at --output")
    sp.add_argument("--false-alarm", type=float, default=None, metavar="RATE",
                    help="the chance of a drift verdict on texts like the validation split (default: the profile's,"
                         " 0.01)")
    sp.add_argument("--device", default="cpu", help="cpu, cuda or auto (default cpu)")
    sp.add_argument("--sample", type=int, default=10_000, metavar="N",
                    help="compare a uniform sample of at most N texts of the input (default 10000: more makes every"
                         " tiny shift significant, and costs scoring time)")
    sp.add_argument("--read-with", choices=("local", "spark"), default="local",
                    help="read the input in this process, streamed (default), or draw the sample on Spark (an input"
                         " too large to scan on one machine: a directory or a store's prefix)")
    sp.add_argument("--spark-master", default="local[*]", help="for --read-with spark (default local[*])")
    sp.add_argument("--track", action="store_true",
                    help="log the report to MLflow: a run of kind monitor with each signal's distance and threshold,"
                         " the estimated (and real) accuracy, the verdict, and report.md, monitor.json and plots/")
    sp.add_argument("--tracking-uri", "--tracking.uri", dest="tracking_uri", default="", metavar="URI",
                    help="with --track, and a models:/ --model: the MLflow store, as tracking.uri (default"
                         " $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db here)")
    sp.add_argument("--experiment", default="torchloom", help="with --track: the MLflow experiment (default"
                                                               " torchloom)")


def track_monitor(args: argparse.Namespace, result: dict) -> None:
    """`monitor --track`: the report as an MLflow run (a store that fails is a warning, as for training)."""
    from torchloom.config import build
    from torchloom.tracking import Tracker

    cfg = build(overrides=["--tracking.uri", args.tracking_uri, "--tracking.experiment", args.experiment,
                           "--output.dir", args.output])
    tracker = Tracker.start(cfg, "monitor", run_name=f"monitor {Path(args.input).name}", params=False,
                            extra_tags={"model": str(args.model), "input": str(args.input)})
    with tracker:
        metrics = {"drift": float(result["drift"]), "texts": result["texts"],
                   "estimated_accuracy": result["estimated_accuracy"]["value"],
                   "estimated_accuracy_low": result["estimated_accuracy"]["low"],
                   "estimated_accuracy_high": result["estimated_accuracy"]["high"],
                   **({"accuracy": result["accuracy"]} if "accuracy" in result else {})}
        for name, signal in result["signals"].items():
            metrics[f"{name}_distance"], metrics[f"{name}_threshold"] = signal["distance"], signal["threshold"]
        tracker.log_metrics(metrics)
        tracker.log_artifact(args.output, "monitor")
    if tracker.enabled:
        print(f"monitor: logged to MLflow at {tracker.shown_uri} (run {tracker.run_id})", file=sys.stderr)


def cmd_monitor(args: argparse.Namespace, rest: list[str]) -> int:
    if rest:
        raise UserError(f"monitor: unexpected arguments {' '.join(rest)}; see torchloom monitor --help")
    from torchloom.model.export import check_exported
    from torchloom.monitor.batch import DRIFT_EXIT, monitor_file

    use_tracking_uri(args)
    model = local_model(args.model, "--model")
    check_exported(model)
    device = args.device
    if device != "cpu":
        from torchloom.model.device import resolve_device

        device = resolve_device(device)
    spark = None
    if args.read_with == "spark":
        from torchloom.config.schema import PrepareConfig
        from torchloom.etl.session import get_spark

        spark = get_spark(PrepareConfig(spark_master=args.spark_master))
    result = monitor_file(model, args.input, args.output, text_column=args.text_column, labels_column=args.labels,
                          false_alarm=args.false_alarm, device=device, overwrite=args.overwrite,
                          say=lambda line: print(f"monitor: {line}", file=sys.stderr, flush=True),
                          sample=args.sample, spark=spark, outliers=args.outliers)
    if args.track:
        track_monitor(args, result)
    est = result["estimated_accuracy"]
    verdict = f"drift in {', '.join(result['drifted'])}" if result["drift"] else "no drift"
    real = f", accuracy with the labels {result['accuracy']:.3f}" if "accuracy" in result else ""
    u = result.get("unusual")
    real += f"; {u['share']:.1%} unusual, about {u['expected']:.0%} for texts like the reference" if u else ""
    print(f"monitor: {verdict} ({result['texts']} texts; estimated accuracy {est['value']:.3f}, 95 % interval"
          f" {est['low']:.3f}-{est['high']:.3f}{real}); report in {Path(args.output) / 'report.md'}")
    return DRIFT_EXIT if result["drift"] else 0


def add_predict_arguments(sp: argparse.ArgumentParser) -> None:
    sp.usage = ('torchloom predict --model DIR "text" ... | --input FILE\n'
                "       torchloom predict MODEL_DIR --input PATH --output PATH [--score-with local|spark]")
    add_tracking_uri(sp)
    sp.add_argument("--model", action="append", help="an exported model dir (e.g. runs/bbc-minilm/model) or a"
                    " registered model (models:/NAME@ALIAS); or give it"
                    " as the first argument. Twice (`--model v1=DIR --model v2=DIR --input FILE`): compare the two"
                    " on the file (agreement, class shares; with --labels accuracy, per-class F1 and McNemar's test)")
    sp.add_argument("--labels", metavar="COLUMN", help="with two models: the column of true labels")
    sp.add_argument("--outlier-score", action="store_true",
                    help="each prediction with \"outlier\": how unusual the text is against the model's reference"
                         " (0.5 ordinary, 0.99 more unusual than 99 %% of it; needs its monitor profile's sketch)")
    sp.add_argument("--report", default="compare-report",
                    help="with two models: the comparison's directory (report.md, compare.json, disagreements.jsonl;"
                         " default compare-report)")
    sp.add_argument("--sample", type=int, default=100_000, metavar="N",
                    help="with two models: compare a uniform sample of at most N texts (default 100000)")
    sp.add_argument("--input", help="without --output: a .txt (one text per line), .jsonl or .csv file with a text"
                                    " field; with --output: a CSV, JSONL or Parquet file or directory")
    sp.add_argument("--output", help="write a Parquet file (--score-with local) or directory (spark): the input"
                                     " columns plus label, score and probabilities")
    sp.add_argument("--score-with", "--engine", dest="score_with", choices=("local", "spark"), default="local",
                    action=OldName, help="for --output: score in this process (local, the default) or on Spark")
    sp.add_argument("--text-column", default="text",
                    help="the column (CSV, Parquet) or field (JSON lines) with the texts (default text)")
    sp.add_argument("--spark-master", default="local[*]", help="for --score-with spark (default local[*])")
    sp.add_argument("--device", default="cpu", help="cpu, cuda or auto (default cpu)")
    sp.add_argument("--batch-size", type=int, default=32)
    sp.add_argument("--runtime", choices=("torch", "onnx"), default="torch",
                    help="torch, or onnx: the gated ONNX file of `torchloom export --format onnx|onnx-int8`")
    sp.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    sp.add_argument("texts", nargs="*", help="texts to classify")


def _is_model_dir(path: str) -> bool:
    from torchloom.model.export import is_exported
    from torchloom.uri import is_uri

    return (is_uri(path) or path.startswith("models:/") or is_exported(path)
            or is_exported(Path(path) / "model"))  # a run directory too


def local_model(model: str, what: str) -> str:
    """A registered model (models:/NAME@ALIAS, models:/NAME/VERSION: registry.fetch, from the registry at
    --tracking-uri or $MLFLOW_TRACKING_URI). An exported model on a store (s3://bucket/run/model): downloaded once
    into torchloom's private cache, keyed by its objects and checked by their hashes (model_cache.fetch_model). A
    local directory as it is. A run directory given for its model (runs/x, s3://bucket/runs/x): its exported
    model/, said in one line."""
    from torchloom.model.export import is_exported
    from torchloom.registry import local_copy
    from torchloom.uri import is_uri

    if not is_uri(model) and not model.startswith("models:/"):
        if not is_exported(model) and is_exported(Path(model) / "model"):
            print(f"torchloom: {what} {model}: a run directory; using its exported model, {Path(model) / 'model'}",
                  file=sys.stderr, flush=True)
            return str(Path(model) / "model")
        return model
    return local_copy(model, what)


def cmd_predict(args: argparse.Namespace, rest: list[str]) -> int:
    # argparse leaves texts that come after an option in `rest`; they are texts all the same.
    unknown = [r for r in rest if r.startswith("-")]
    if unknown:
        raise UserError(f"predict: unexpected arguments {' '.join(unknown)}; see torchloom predict --help")
    texts = list(args.texts) + [r for r in rest if not r.startswith("-")]
    use_tracking_uri(args)
    if args.model and len(args.model) > 1:
        return compare_models(args, texts)
    model = args.model[0] if args.model else None
    if model is None:
        if not texts or not _is_model_dir(texts[0]):
            first = f"{texts[0]!r} is not a model dir (no config.json)" if texts else "none was given"
            raise UserError(f"predict: pass the exported model dir as --model DIR or as the first argument; {first}")
        model = texts.pop(0)
    given, model = model, local_model(model, "--model")
    from torchloom.model.export import check_exported

    check_exported(model)  # before torch loads: a wrong --model is one line at once
    if args.batch_size < 1:
        raise UserError(f"--batch-size {args.batch_size}: must be at least 1")
    if args.output:
        return predict_file(args, model, texts, given)
    if args.score_with != "local":
        raise UserError(f"--score-with {args.score_with}: only for batch prediction to a file; add --output PATH")
    from torchloom.model.predict import Predictor, read_texts, repair_note, well_formed  # torch: after the checks

    if args.input:
        texts += read_texts(args.input, say=lambda line: print(f"predict: {line}", file=sys.stderr, flush=True),
                            column=args.text_column)
    if not texts:
        raise UserError('predict: no texts; pass them as arguments or --input FILE'
                        ' (e.g. torchloom predict --model DIR "text")')
    note = repair_note(texts)
    if note:  # repaired here too, not only in Predictor: each text is printed back, and stdout cannot print them
        print(f"predict: warning: {note}", file=sys.stderr, flush=True)
        texts = [well_formed(t) for t in texts]
    device = args.device
    if device != "cpu":
        from torchloom.model.device import resolve_device

        device = resolve_device(device)
    predictor = Predictor(model, device=device, batch_size=args.batch_size, runtime=args.runtime)
    predictions = outlier_scored(predictor, model, texts) if args.outlier_score else predictor.predict(texts)
    lines = (json.dumps({"text": text[:200], **pred}, ensure_ascii=False) for text, pred in zip(texts, predictions))
    return print_lines(lines)


def outlier_scored(predictor, model: str, texts: list[str]) -> list[dict]:
    """--outlier-score: each prediction with its outlier score against the model's reference (monitor/outliers.py),
    one line where the model cannot give one."""
    import numpy as np

    from torchloom.monitor.outliers import scorer_for
    from torchloom.monitor.profile import REEXPORT, kernel_for, read_profile

    profile = read_profile(model)
    if profile is None or kernel_for(profile, predictor) is None or scorer_for(profile) is None:
        raise UserError(f"--outlier-score: model dir {model} has no reference sketches to score against (a profile"
                        f" with a sketch, and the torch runtime); {REEXPORT}")
    answers = predictor.predict(texts, with_signals=True)
    scores = scorer_for(profile).scores(np.stack([a["sketch"] for a in answers]))
    signals = ("tokens", "unknown", "sketch")  # what with_signals adds (Predictor.predict_encoded): not printed
    return [{**{k: v for k, v in a.items() if k not in signals}, "outlier": round(float(s), 4)}
            for a, s in zip(answers, scores)]


def compare_models(args: argparse.Namespace, texts: list[str]) -> int:
    """`predict --model A --model B --input FILE`: monitor/compare.py."""
    from torchloom.model.export import check_exported
    from torchloom.monitor.compare import compare_file, model_names

    if len(args.model) != 2:
        raise UserError(f"predict: {len(args.model)} --model flags; compare two models at a time")
    if texts or not args.input:
        raise UserError("predict: two models compare the texts of --input FILE (a CSV, JSON lines or Parquet file or"
                        " directory with a text column)")
    if args.output:
        raise UserError("predict: --output writes one model's predictions; with two models the comparison goes to"
                        " --report DIR")
    models = [(name, local_model(path, "--model")) for name, path in model_names(args.model)]
    for _, path in models:
        check_exported(path)
    result = compare_file(models, args.input, args.report, text_column=args.text_column, labels_column=args.labels,
                          sample=args.sample, device=args.device, overwrite=args.overwrite,
                          say=lambda line: print(f"predict: {line}", file=sys.stderr, flush=True))
    verdict = f"; {result['verdict']['state']}: {result['verdict']['line']}" if "verdict" in result else ""
    print(f"predict: {result['texts']} texts, agreement {result['agreement']:.1%}{verdict}; report in"
          f" {Path(args.report) / 'report.md'}")
    return 0


SIGPIPE_EXIT = 128 + 13  # what a shell reports for a process that SIGPIPE ended


def print_lines(lines) -> int:
    """Print to stdout; a reader that stops early (`| head -1`) ends this quietly, as it ends any Unix tool."""
    try:
        for line in lines:
            print(line)
        sys.stdout.flush()
    except BrokenPipeError:
        # Python's advice (docs: "Note on SIGPIPE"): point stdout at devnull, so the flush at exit does not fail too
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return SIGPIPE_EXIT
    return 0


def predict_file(args: argparse.Namespace, model: str, texts: list[str], given: str) -> int:
    """The batch form: --input file(s) to a Parquet --output, on Spark or locally. `model` is a local
    directory; `given` what the user named (a store's URI: Spark's executors fetch the model from there)."""
    from torchloom.batch import files as score_files
    from torchloom.batch import spark as score_spark
    from torchloom.uri import is_uri

    if texts:
        raise UserError(f"predict: with --output the texts come from --input, not arguments ({texts[0]!r})")
    if not args.input:
        raise UserError("predict: --output needs --input PATH (a CSV, JSONL or Parquet file or directory)")
    options = dict(text_column=args.text_column, batch_size=args.batch_size, device=args.device,
                   overwrite=args.overwrite, runtime=args.runtime)
    if args.score_with == "spark":
        from torchloom.config.schema import PrepareConfig
        from torchloom.etl.session import get_spark
        from torchloom.model.export import check_exported

        check_exported(model)
        spark = get_spark(PrepareConfig(spark_master=args.spark_master))
        result = score_spark.predict_spark(spark, model, args.input, args.output, **options,
                                           model_uri=given if is_uri(given) else None)
    else:
        result = score_files.predict_local(model, args.input, args.output, **options)
    rate = result["rows"] / result["seconds"] if result["seconds"] else 0.0
    print(f"predict: {result['rows']} rows -> {result['output']} in {result['seconds']} s ({rate:.0f} rows/s)")
    return 0


def serve_models(args: argparse.Namespace) -> dict[str, str] | None:
    """`--model NAME=DIR` flags as {name: local dir} (fetched from a store where given a URI), each checked; None
    for one MODEL_DIR, which is checked and made local in args."""
    from torchloom.model.export import check_exported
    from torchloom.monitor.compare import model_names
    from torchloom.serve.settings import check_model_name

    if args.models and args.model_dir:
        raise UserError(f"serve: MODEL_DIR {args.model_dir} and --model flags; give one model as MODEL_DIR or"
                        " several as --model NAME=DIR, not both")
    if not args.models:
        if not args.model_dir:
            raise UserError("serve: no model; give MODEL_DIR (e.g. runs/bbc-minilm/model) or --model NAME=DIR flags")
        args.model_dir = local_model(args.model_dir, "MODEL_DIR")
        check_exported(args.model_dir)
        return None
    models: dict[str, str] = {}
    for name, path in model_names(args.models):
        if name in models:
            raise UserError(f"--model {name}=...: two models of one name; name them apart (--model v1=DIR --model"
                            " v2=DIR)")
        check_model_name(name, "--model")
        models[name] = local_model(path, f"--model {name}")
        check_exported(models[name])
    return models


def cmd_serve(args: argparse.Namespace, rest: list[str]) -> int:
    from torchloom.serve.settings import ServeSettings

    if rest:
        raise UserError(f"serve: unexpected arguments {' '.join(rest)}; see torchloom serve --help")
    use_tracking_uri(args)
    models = serve_models(args)
    settings = ServeSettings(
        model_dir=next(iter(models.values())) if models else args.model_dir, host=args.host, port=args.port,
        serve_with=args.serve_with, replicas=args.replicas,
        max_batch_size=args.max_batch_size, max_wait_ms=args.max_wait_ms, max_queue=args.max_queue,
        max_batch_tokens=args.max_batch_tokens, length_bucket=args.length_bucket,
        fixed_wait=args.fixed_wait, tune=args.tune,
        max_texts_per_request=args.max_texts_per_request, max_text_chars=args.max_text_chars,
        api_key=args.api_key, admin_key=args.admin_key, model_roots=args.model_roots,
        device=args.device, precision=args.precision, runtime=args.runtime,
        max_body_bytes=args.max_body_bytes, max_connections=args.max_connections, read_timeout_s=args.read_timeout,
        require_api_key=args.require_api_key, monitor=args.monitor, monitor_window=args.monitor_window,
        outlier_score=args.outlier_score,
        monitor_window_s=args.monitor_window_s, monitor_stale_s=args.monitor_stale_s,
        monitor_period_s=args.monitor_period_s, monitor_history=args.monitor_history, false_alarm=args.false_alarm,
        models=models, traffic=args.traffic,
        shadow=[s.strip() for given in args.shadow for s in given.split(",") if s.strip()],
        feedback_size=args.feedback_size, min_effect=args.min_effect, verdict_alpha=args.verdict_alpha,
        log=args.log, keep_texts=args.keep_texts, log_max_age_days=args.log_max_age_days, fleet_name=args.fleet_name,
    ).check()
    warning = settings.exposure_warning()
    if warning:
        print(warning, file=sys.stderr, flush=True)
    if settings.serve_with == "ray":
        from torchloom.serve.ray_engine import run_ray

        return run_ray(settings)
    from torchloom.serve.server import run_local

    return run_local(settings)
