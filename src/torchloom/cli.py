"""The command line. Each sub-command is a thin call into one stage."""

from __future__ import annotations

import argparse
import json
import sys

from torchloom import __version__
from torchloom.errors import UserError

COMMANDS = {
    "run": "prepare, train, export and evaluate into one run dir (no arguments: the embedded demo)",
    "prepare": "Spark ETL: validate, clean, dedup, split and tokenize labelled text to Parquet",
    "train": "train on the prepared data (DDP with engine.workers processes)",
    "export": "write the selected checkpoint as a Hugging Face model dir (<run>/model)",
    "evaluate": "score the exported model on a split: report.md, report.json, plots/",
    "predict": "predict labels for texts with an exported model, as JSON lines",
    "config": "print the resolved config as TOML",
}

OVERRIDES_HELP = """\
Config: defaults are the embedded demo (BBC News + all-MiniLM-L6-v2). Change any field with
--config FILE.toml and/or --SECTION.KEY VALUE (or --SECTION.KEY=VALUE), e.g.
  --data.path my.csv --data.text_column body --train.lr 3e-5 --engine.workers 4
`torchloom config` prints every section and key with its current value.
"""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="torchloom", description="Labelled text to a trained, exported classifier with distributed PyTorch.",
        epilog=OVERRIDES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"torchloom {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_text in COMMANDS.items():
        sp = sub.add_parser(name, help=help_text, description=help_text, epilog=OVERRIDES_HELP,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
        if name == "predict":
            sp.add_argument("--model", required=True, help="an exported model dir (e.g. runs/bbc-minilm/model)")
            sp.add_argument("--input", help="a .txt (one text per line), .jsonl or .csv file with a text field")
            sp.add_argument("--batch-size", type=int, default=32)
            sp.add_argument("texts", nargs="*", help="texts to classify")
            continue
        sp.add_argument("--config", help="a TOML file with [section] tables")
        if name in ("run", "prepare", "train"):
            sp.add_argument("--overwrite", action="store_true", help="same as --output.overwrite true")
        if name in ("run", "train"):
            sp.add_argument("--resume", nargs="?", const="latest", default=None, metavar="CHECKPOINT",
                            help="resume from the latest checkpoint, or from CHECKPOINT")
    return p


def build_config(args: argparse.Namespace, rest: list[str]):
    from torchloom.config import build

    extra = list(rest)
    if getattr(args, "overwrite", False):
        extra += ["--output.overwrite", "true"]
    if getattr(args, "resume", None):
        extra += ["--train.resume", args.resume]
    return build(args.config, extra)


def cmd_predict(args: argparse.Namespace, rest: list[str]) -> int:
    from torchloom.model.predict import Predictor, read_texts

    if rest:
        raise UserError(f"predict: unexpected arguments {' '.join(rest)}; see torchloom predict --help")
    texts = list(args.texts)
    if args.input:
        texts += read_texts(args.input)
    if not texts:
        raise UserError('predict: no texts; pass them as arguments or --input FILE (e.g. torchloom predict --model DIR "text")')
    predictor = Predictor(args.model, batch_size=args.batch_size)
    for text, pred in zip(texts, predictor.predict(texts)):
        print(json.dumps({"text": text[:200], **pred}, ensure_ascii=False))
    return 0


def dispatch(args: argparse.Namespace, rest: list[str]) -> int:
    from torchloom import pipeline

    pipeline.env_defaults()
    if args.command == "predict":
        return cmd_predict(args, rest)
    cfg = build_config(args, rest)
    if args.command == "config":
        from torchloom.config import to_toml

        sys.stdout.write(to_toml(cfg))
        return 0
    if args.command == "prepare":
        pipeline.prepare_stage(cfg)
    elif args.command == "train":
        pipeline.train_stage(cfg)
    elif args.command == "export":
        pipeline.export_stage(cfg)
    elif args.command == "evaluate":
        pipeline.evaluate_stage(cfg)
    elif args.command == "run":
        pipeline.run_all(cfg)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args, rest = p.parse_known_args(argv)
    if args.command is None:
        p.print_help()
        return 0
    try:
        return dispatch(args, rest)
    except UserError as e:
        print(f"torchloom: error: {e}", file=sys.stderr)
        return UserError.exit_code
    except KeyboardInterrupt:
        print("torchloom: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        from torchloom.engines.common import TrainingFailed

        if isinstance(e, TrainingFailed):
            print(f"torchloom: error: {e}", file=sys.stderr)
            return TrainingFailed.exit_code
        raise
