"""The command line. Each sub-command is a thin call into one stage; those that use an exported model (predict,
serve, monitor) are cli/serving.py's."""

from __future__ import annotations

import argparse
import json
import sys

from torchloom import __version__
from torchloom.cli.serving import add_monitor_arguments, add_predict_arguments, cmd_monitor, cmd_predict, cmd_serve
from torchloom.errors import UserError, one_line
from torchloom.redaction import mask_streams, remember
from torchloom.serve.arguments import add_serve_arguments

COMMANDS = {
    "run": "prepare, train, export and evaluate into one run dir (no arguments: the embedded demo)",
    "prepare": "Spark ETL: validate, clean, dedup, split and tokenize labelled text to Parquet",
    "train": "train on the prepared data (DDP with engine.workers processes)",
    "export": "write the selected checkpoint as a Hugging Face model dir (<run>/model)",
    "evaluate": "score the exported model on a split: report.md, report.json, plots/",
    "predict": "predict labels with an exported model: texts as JSON lines, or a whole file to Parquet (--output)",
    "serve": "serve an exported model over HTTP: REST with dynamic batching, or Ray Serve (--serve-with ray)",
    "monitor": "compare new texts with the model's reference profile: drift report, estimated accuracy (exit 3:"
               " drift); `monitor rules`: Prometheus alerts and a Grafana dashboard for served models",
    "feedback": "send the true labels of a server's predictions from a file to its POST /v1/feedback, in bulk",
    "loop": "retrain a served fleet's model on what it sees, gate, shadow, ramp and promote or roll back"
            " (`loop history`, `loop resume`)",
    "tune": "search hyperparameters (tune.space) with ASHA early stopping: Ray Tune or Optuna; exports the best",
    "config": "print the resolved config as TOML",
    "plan": "estimate memory, communication and time per strategy before spending (torchloom plan --help)",
    "k8s": "Kubernetes manifests: an Indexed Job of torchrun pods (train), a Deployment (serve) (torchloom k8s --help)",
}

OVERRIDES_HELP = """\
Config: defaults are the embedded demo (BBC News + all-MiniLM-L6-v2). Change any field with
--config FILE.toml and/or --SECTION.KEY VALUE (or --SECTION.KEY=VALUE), e.g.
  --data.path my.csv --data.text_column body --train.lr 3e-5 --engine.workers 4
`torchloom config` prints every section and key with its current value.
"""


# The config keys each command uses: whole sections, or "section.key".
COMMAND_KEYS = {
    "run": ["data", "prepare", "model", "train", "eval", "export", "engine", "output", "tracking"],
    "prepare": ["data", "prepare", "model.path", "output", "tracking"],
    "train": ["train", "engine", "model", "prepare.spark_master", "prepare.spark_conf", "eval.batch_size",
              "eval.precision", "output", "tracking"],
    "export": ["train.select", "model.path", "export", "output.dir", "tracking"],
    "evaluate": ["eval", "prepare.spark_master", "prepare.spark_conf", "output.dir", "tracking"],
    "tune": ["tune", "data", "prepare", "model", "train", "eval", "engine", "output", "tracking"],
    "config": ["data", "prepare", "model", "train", "eval", "export", "engine", "output", "tracking", "tune", "k8s"],
}


def keys_help(command: str, width: int = 110) -> str:
    """The config keys `command` uses, each with its default and meaning, from the schema (config/keys.py)."""
    import dataclasses
    import re
    import textwrap

    from torchloom.config.keys import MEANINGS
    from torchloom.config.schema import Config

    defaults = {}
    for section in dataclasses.fields(Config):
        for f in dataclasses.fields(section.default_factory()):  # type: ignore[misc]
            value = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            defaults[f"{section.name}.{f.name}"] = json.dumps(value) if isinstance(value, str | dict) else str(value)
            if isinstance(value, bool):
                defaults[f"{section.name}.{f.name}"] = str(value).lower()
    wanted = COMMAND_KEYS.get(command, [])
    keys = [k for k in defaults if k in wanted or k.split(".")[0] in wanted]
    lines = [f"Config keys of `torchloom {command}` (--KEY VALUE; default, then meaning):"]
    for k in keys:
        head = f"  --{k} {defaults[k]}"
        meaning = re.sub(r"\[([^\]]+)\]\([^)]+\)", r"\1", MEANINGS[k]).replace("`", "")  # markdown to text
        lines += textwrap.wrap(meaning, width, initial_indent=f"{head}\n      ",
                               subsequent_indent="      ") or [head]
    return "\n".join(lines) + "\n\n"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="torchloom", description="Labelled text to a trained, exported classifier with distributed PyTorch.",
        epilog=OVERRIDES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"torchloom {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_text in COMMANDS.items():
        epilog = (keys_help(name) if name in COMMAND_KEYS else "") + OVERRIDES_HELP
        sp = sub.add_parser(name, help=help_text, description=help_text, epilog=epilog,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
        if name == "predict":
            add_predict_arguments(sp)
            continue
        if name == "serve":
            add_serve_arguments(sp)
            continue
        if name == "monitor":
            add_monitor_arguments(sp)
            continue
        if name == "feedback":
            from torchloom.cli.feedback import add_feedback_arguments

            add_feedback_arguments(sp)
            continue
        if name == "loop":
            from torchloom.loop.arguments import add_loop_arguments

            add_loop_arguments(sp)
            continue
        sp.add_argument("--config", help="a TOML file with [section] tables")
        if name in ("run", "prepare", "train", "tune"):
            sp.add_argument("--overwrite", action="store_true", help="same as --output.overwrite true")
        if name in ("run", "export"):
            sp.add_argument("--format", choices=("hf", "onnx", "onnx-int8"), default=None,
                            help="same as --export.format: onnx / onnx-int8 add a gated ONNX model beside the HF one")
            sp.add_argument("--register", metavar="NAME", default=None,
                            help="same as --export.register: the model becomes a new version of NAME in MLflow's"
                                 " registry (serve it as models:/NAME@ALIAS or models:/NAME/VERSION)")
            sp.add_argument("--alias", metavar="ALIAS", default=None,
                            help="same as --export.alias: the alias the new version takes (e.g. champion)")
        if name in ("run", "train"):
            sp.add_argument("--resume", nargs="?", const="latest", default=None, metavar="CHECKPOINT",
                            help="resume from the latest checkpoint, or from CHECKPOINT")
    return p


def build_config(args: argparse.Namespace, rest: list[str]):
    """The command's config from --config and the flags, and the keys the user gave (recorded.given_keys)."""
    from torchloom.cli.recorded import given_keys
    from torchloom.config import build

    extra = list(rest)
    if getattr(args, "overwrite", False):
        extra += ["--output.overwrite", "true"]
    if getattr(args, "resume", None):
        extra += ["--train.resume", args.resume]
    if getattr(args, "format", None):
        extra += ["--export.format", args.format]
    if getattr(args, "register", None) is not None:
        extra += ["--export.register", args.register]
    if getattr(args, "alias", None) is not None:
        extra += ["--export.alias", args.alias]
    return build(args.config, extra), given_keys(args.config, extra)


def dispatch(args: argparse.Namespace, rest: list[str]) -> int:
    from torchloom.model.env import use_model_env

    use_model_env()  # models from local directories only, here and in the workers this command starts
    if args.command == "predict":
        return cmd_predict(args, rest)
    if args.command == "serve":
        return cmd_serve(args, rest)
    if args.command == "monitor":
        return cmd_monitor(args, rest)
    if args.command == "feedback":
        from torchloom.cli.feedback import cmd_feedback

        return cmd_feedback(args, rest)
    if args.command == "loop":
        from torchloom.cli.loop import cmd_loop

        return cmd_loop(args, rest)
    cfg, given = build_config(args, rest)
    if args.command == "config":
        from torchloom.config import to_toml

        sys.stdout.write(to_toml(cfg))
        return 0
    from torchloom import preflight
    from torchloom.cli.recorded import follow
    from torchloom.runs.lease import hold
    from torchloom.runs.runfiles import RunFiles

    # The command's Run, built once: the run's files; the config with what the run recorded where the user gave
    # nothing (a stage on its own: the model and, on a resume, the training), checked for this machine (what
    # cannot run here fails now, before prepare). Every stage takes it.
    files = RunFiles(cfg.output.dir)
    run = preflight.open_run(follow(cfg, args.command, given, files), files)
    with hold(run, args.command):  # a run on a store: one driver writes it at a time
        return run_stage(args.command, run)


def run_stage(command: str, run) -> int:
    from torchloom.stages import evaluate, export, prepare, train
    from torchloom.stages import run as run_all

    if command == "prepare":
        prepare.prepare_with_baseline(run)
    elif command == "train":
        from torchloom import tracking
        from torchloom.preflight import check_prepared

        check_prepared(run)  # before MLflow and torch load: a wrong --output.dir is one line at once
        with tracking.start(run.cfg, "train") as tracker:
            train.train_stage(run.but(tracker=tracker))
    elif command == "export":
        if run.cfg.export.register:  # a version in the registry belongs to an MLflow run: this export's
            from torchloom import tracking

            with tracking.start(run.cfg, "export") as tracker:
                export.export_stage(run.but(tracker=tracker))
        else:
            export.export_stage(run)
    elif command == "evaluate":
        evaluate.evaluate_stage(run)
    elif command == "run":
        run_all.run_all(run)
    elif command == "tune":
        from torchloom.tune.study import run as tune_run

        tune_run(run)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    mask_streams()  # a password this process sees in a URL is never printed (redaction.remember)
    remember(argv)
    if argv and argv[0] == "plan":
        # pure arithmetic with its own options: no config, no torch, starts in a blink
        from torchloom.plan.command import main as plan_main

        return plan_main(argv[1:])
    if argv[:2] == ["monitor", "rules"]:  # Prometheus rules and a Grafana dashboard: text, no torch
        from torchloom.monitor.alerting import main as rules_main

        return rules_main(argv[2:])
    if argv and argv[0] == "k8s":  # manifests from the config: no torch either
        from torchloom.k8s.command import main as k8s_main

        return k8s_main(argv[1:])
    p = parser()
    args, rest = p.parse_known_args(argv)
    if args.command is None:
        p.print_help()
        return 0
    try:
        return dispatch(args, rest)
    except UserError as e:
        print(f"torchloom: error: {one_line(e)}", file=sys.stderr)
        return UserError.exit_code
    except KeyboardInterrupt:
        print("torchloom: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        from torchloom.engines.common import Preempted, TrainingFailed

        if isinstance(e, Preempted):  # one line: where it stopped, and the command that goes on
            print(f"torchloom: {e}", file=sys.stderr)
            return Preempted.exit_code
        if isinstance(e, TrainingFailed):  # the failing rank's error and traceback: several lines on purpose
            print(f"torchloom: error: {e}", file=sys.stderr)
            return TrainingFailed.exit_code
        raise
