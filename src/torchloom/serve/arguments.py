"""The command line of `torchloom serve`: its flags, shared by the command and by `torchloom k8s serve`, which
checks the flags it passes on to a pod's server with this same parser (spelled out whole: no abbreviation
reaches a manifest)."""

from __future__ import annotations

import argparse
import sys


class OldName(argparse.Action):
    """`--engine`, the name predict and serve used before: it still works, and says its new name once. Training's
    engine is `--engine.name`; a command's own choice of where it runs is named for what it does."""

    def __call__(self, parser, namespace, values, option_string=None):
        if option_string == "--engine":
            print(f"torchloom: --engine is now {self.option_strings[0]} (--engine.name is training's engine)",
                  file=sys.stderr)
        setattr(namespace, self.dest, values)


def add_model_arguments(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("model_dir", metavar="MODEL_DIR", nargs="?",
                    help="an exported model dir (e.g. runs/bbc-minilm/model) or a registered model"
                         " (models:/NAME@ALIAS, looked up at --tracking-uri); or several models as --model flags")
    sp.add_argument("--tracking-uri", "--tracking.uri", dest="tracking_uri", default=None, metavar="URI",
                    help="the MLflow registry of a models:/NAME@ALIAS model (default $MLFLOW_TRACKING_URI, else"
                         " ./mlflow.db)")


def add_access_arguments(sp: argparse.ArgumentParser) -> None:
    """Who may call what: the API key (predict, feedback), the admin key and where admin loads may come from."""
    sp.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/* (predict, feedback; or set"
                                      " TORCHLOOM_API_KEY)")
    sp.add_argument("--admin-key", help="the key of /v1/admin (load, traffic, shadow, promote; or set"
                                        " TORCHLOOM_ADMIN_KEY): without it the admin route refuses every call, and"
                                        " the --api-key is refused there")
    sp.add_argument("--model-root", dest="model_roots", action="append", default=[], metavar="DIR_OR_URI",
                    help="where /v1/admin may load models from (repeatable; default: anywhere this server reads)")
    sp.add_argument("--require-api-key", action="store_true",
                    help="refuse to start without an API key (default: start, with a warning when --host is not"
                         " loopback)")


def add_serve_arguments(sp: argparse.ArgumentParser) -> None:
    from torchloom.serve.settings import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_CONNECTIONS, DEFAULT_READ_TIMEOUT_S

    add_model_arguments(sp)
    add_fleet_arguments(sp)
    sp.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    sp.add_argument("--port", type=int, default=8000, help="default 8000; 0 picks a free port")
    sp.add_argument("--serve-with", "--engine", dest="serve_with", choices=("local", "ray"), default="local",
                    action=OldName, help="local: one process with dynamic batching (default); ray: Ray Serve replicas")
    sp.add_argument("--replicas", type=int, default=1, help="Ray Serve replicas (--serve-with ray)")
    sp.add_argument("--max-batch-size", type=int, default=32, help="texts per model forward (default 32)")
    sp.add_argument("--max-batch-tokens", type=int, default=8192,
                    help="padded tokens (texts x the longest) per model forward (default 8192; 0: no limit)")
    sp.add_argument("--length-bucket", type=int, default=16,
                    help="pad each forward to a multiple of this many tokens, so that forwards come in few shapes,"
                         " each warmed up before /readyz (default 16; 1: to the longest text)")
    sp.add_argument("--max-wait-ms", type=float, default=5.0,
                    help="how long a text waits for its batch to fill (default 5)")
    sp.add_argument("--fixed-wait", action="store_true",
                    help="always wait --max-wait-ms for a batch to fill, even when no other request is in flight"
                         " (default: adaptive, a lone request goes at once)")
    sp.add_argument("--no-tune", dest="tune", action="store_false",
                    help="skip the warm-up's measurements on a CPU (a traced forward where it is as fast as eager;"
                         " on 2-3 cores, torch's threads): eager, and every core for the model")
    sp.add_argument("--max-queue", type=int, default=1024,
                    help="texts waiting for the model; past this requests get 429 (default 1024)")
    sp.add_argument("--max-texts-per-request", type=int, default=256)
    sp.add_argument("--max-text-chars", type=int, default=20_000)
    add_access_arguments(sp)
    sp.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                    help=f"largest request body in bytes; past it 413, refused before it is read whole (default"
                         f" {DEFAULT_MAX_BODY_BYTES}; less where --max-texts-per-request x --max-text-chars allow"
                         " less)")
    sp.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS,
                    help=f"requests served at once (from their headers to their answer; /healthz, /readyz and"
                         f" /metrics not counted); past it 503 (default {DEFAULT_MAX_CONNECTIONS}; local engine)")
    sp.add_argument("--read-timeout", type=float, default=DEFAULT_READ_TIMEOUT_S, metavar="SECONDS",
                    help=f"a request's headers and body must arrive within this of its first byte, else 408 and"
                         f" the connection closes (default {DEFAULT_READ_TIMEOUT_S:g}; local engine)")
    sp.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default auto)")
    sp.add_argument("--precision", choices=("auto", "fp32", "bf16", "fp16"), default="auto",
                    help="auto (default): what training's rule picks: a GPU's bf16 (else fp16); on a CPU bf16 only"
                         " where it is native (AMX, AVX512-BF16), else fp32")
    sp.add_argument("--runtime", choices=("torch", "onnx"), default="torch",
                    help="torch, or onnx: the gated ONNX file of `torchloom export --format onnx|onnx-int8`")
    add_live_monitor_arguments(sp)


def add_live_monitor_arguments(sp: argparse.ArgumentParser) -> None:
    """The server's monitor: on or off, its window by count and age, staleness, history, outlier scores."""
    sp.add_argument("--no-monitor", dest="monitor", action="store_false",
                    help="do not compare recent texts with the model's reference profile (default: compare, where"
                         " the export wrote one: /v1/monitor, /metrics, the page at /)")
    sp.add_argument("--monitor-window", type=int, default=500, metavar="TEXTS",
                    help="the monitor compares the last this many texts (default 500)")
    sp.add_argument("--monitor-window-s", type=float, default=86400.0, metavar="SECONDS",
                    help="and none older than this (default 86400: a day; 0: no age limit). A verdict with no text"
                         " for --monitor-stale-s, or whose window emptied with age, stands and says it is stale")
    sp.add_argument("--monitor-stale-s", type=float, default=600.0, metavar="SECONDS",
                    help="a verdict is stale once no text came for this long (default 600)")
    sp.add_argument("--monitor-period-s", type=float, default=3600.0, metavar="SECONDS",
                    help="the monitor's history keeps one record per period (default 3600: an hour)")
    sp.add_argument("--outlier-score", action="store_true",
                    help="each prediction with \"outlier\": how unusual its text is against the model's reference"
                         " (0.5 ordinary, 0.99 more unusual than 99 %% of it); needs the monitor and its sketch")
    sp.add_argument("--monitor-history", default="", metavar="FILE",
                    help="append each period's record to this JSON-lines file too (default: kept in memory, the"
                         " last 48, in GET /v1/monitor and on the page)")
    sp.add_argument("--false-alarm", type=float, default=None, metavar="P",
                    help="the chance that a window of texts like the reference is called drift (default: the"
                         " profile's, 0.01)")


def add_fleet_arguments(sp: argparse.ArgumentParser) -> None:
    """Several models behind the endpoint (serve/fleet.py, docs/serving.md "A/B and shadow")."""
    sp.add_argument("--model", dest="models", action="append", metavar="NAME=DIR",
                    help="one of several models behind the endpoint (a dir or a store's URI), once per model; the"
                         " first is the one the others are compared with (docs/serving.md, A/B and shadow)")
    sp.add_argument("--traffic", metavar="A=90,B=10",
                    help="each model's share of the requests, in percent (default: even over the models that are"
                         " not shadows); a request's X-Torchloom-Key header always reaches the same model")
    sp.add_argument("--shadow", action="append", default=[], metavar="NAME",
                    help="a model that sees every text and whose answers are recorded, never returned (repeatable)")
    sp.add_argument("--feedback-size", type=int, default=100_000, metavar="N",
                    help="predictions kept for POST /v1/feedback: the most recent N (default 100000)")
    sp.add_argument("--min-effect", type=float, default=0.02, metavar="POINTS",
                    help="the accuracy difference the verdict between models is sized to find (default 0.02)")
    sp.add_argument("--verdict-alpha", type=float, default=0.05, metavar="P",
                    help="the chance that two equal models are ever called different (default 0.05)")
    sp.add_argument("--log", default="none", metavar="PATH_OR_URI",
                    help="write every prediction and feedback label to a durable log: a SQLite file (PATH or"
                         " sqlite:///PATH) or postgresql://USER@HOST/DB shared by replicas; feedback and the verdict"
                         " then survive restarts and are the fleet's (default $TORCHLOOM_LOG, else none)")
    sp.add_argument("--keep-texts", action="store_true",
                    help="the log keeps each text (retraining on feedback needs them); default: a hash only")
    sp.add_argument("--log-max-age-days", type=float, default=30.0, metavar="DAYS",
                    help="predictions and labels older than this leave the log (default 30)")
    sp.add_argument("--fleet-name", default="", metavar="NAME",
                    help="the name this fleet's rows carry in a shared log (default: the first model's name)")


def check_serve_flags(flags: list[str]) -> None:
    """Flags for `torchloom serve` as its own parser reads them, abbreviations refused; one line naming the flag
    otherwise (never its value: it may be a secret)."""
    from torchloom.errors import UserError

    parser = argparse.ArgumentParser(prog="torchloom serve", allow_abbrev=False, exit_on_error=False,
                                     add_help=False)
    add_serve_arguments(parser)
    try:
        _, unknown = parser.parse_known_args(["MODEL_DIR", *flags])
    except argparse.ArgumentError as e:
        raise UserError(f"{e.argument_name or 'torchloom serve'}: {e.message.split(':')[0]}; see torchloom serve"
                        " --help") from None
    names = [u.split("=", 1)[0] for u in unknown if u.startswith("-")]
    if names:
        raise UserError(f"{', '.join(names)}: not a flag of torchloom serve (flags are spelled out whole here); see"
                        " torchloom serve --help")
    if unknown:
        raise UserError(f"torchloom serve: {len(unknown)} value(s) after the flags that no flag takes; see torchloom"
                        " serve --help")
