"""`torchloom k8s train|serve|loop`: parse, build the config, write the manifests (stdout or --out DIR), --apply."""

from __future__ import annotations

import argparse
import sys

from torchloom.errors import OneLineArgs, UserError, one_line

EPILOG = """\
examples:
  torchloom k8s train --image registry/torchloom:0.1 --nodes 2 --gpus-per-node 8 --output.dir s3://bucket/runs/x \\
      --secret store-credentials --train.lr 3e-5 > job.yaml
  torchloom k8s train --config run.toml --apply             # [k8s] in run.toml: image, nodes, gpus, ...
  torchloom k8s serve s3://bucket/runs/x/model --image registry/torchloom:0.1 --secret serve-secrets --replicas 2 \\
      --out manifests/ -- --max-batch-size 64
  torchloom k8s loop --image registry/torchloom:0.1 --secret loop-secrets --cpu 8 --memory 32Gi \\
      -- --url http://x-model --fleet x --recipe /loop/champion

Every [k8s] key (torchloom config shows them) is also --k8s.KEY VALUE; train takes every --SECTION.KEY of
torchloom train. The run must be prepared on the store first (torchloom prepare --output.dir s3://...).
"""

# torchloom k8s's own flags, each one config key
FLAGS = {"--image": "image", "--namespace": "namespace", "--name": "name", "--nodes": "nodes",
         "--gpus-per-node": "gpus", "--cpu": "cpu", "--memory": "memory", "--secret": "env_from",
         "--replicas": "replicas", "--service-account": "service_account", "--image-pull-secret": "image_pull_secrets",
         "--priority-class": "priority_class", "--scheduler": "scheduler"}
# repeatable KEY=VALUE flags, each an entry of one dict key
PAIRS = {"--node-selector": "node_selector", "--label": "labels", "--annotation": "annotations"}


def parser() -> argparse.ArgumentParser:
    p = OneLineArgs(prog="torchloom k8s", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
               description="Kubernetes manifests from a torchloom config: an Indexed Job of torchrun pods for"
                           " training, a Deployment of torchloom serve, one of torchloom loop; printed, written"
                           " (--out) or created (--apply)")
    p.add_argument("what", choices=("train", "serve", "loop"))
    p.add_argument("model_uri", nargs="?", metavar="MODEL_URI", help="serve: the exported model on the store")
    p.add_argument("--config", help="a TOML file with [section] tables ([k8s] among them)")
    p.add_argument("--out", metavar="DIR", help="write one YAML file per object into DIR (default: print them)")
    p.add_argument("--apply", action="store_true",
                   help="create the objects through the Kubernetes API (needs the kubernetes client)")
    p.add_argument("--port", type=int, default=8000, help="serve: the server's port in the pod (default 8000)")
    for flag, key in FLAGS.items():
        p.add_argument(flag, dest=f"k8s_{key}", metavar=key.upper(), help=f"same as --k8s.{key}")
    for flag, key in PAIRS.items():
        what = {"node_selector": "a node label the pods need", "labels": "a label on every object and pod",
                "annotations": "an annotation on every object and pod"}[key]
        p.add_argument(flag, dest=f"pairs_{key}", action="append", default=[], metavar="KEY=VALUE",
                       help=f"{what} (repeat for more; --k8s.{key})")
    p.add_argument("--toleration", action="append", default=[], metavar="KEY[=VALUE]:EFFECT",
                   help="a taint the pods tolerate (repeat for more); EFFECT NoSchedule, PreferNoSchedule, NoExecute")
    return p


def build_config(args: argparse.Namespace, rest: list[str]):
    from torchloom.config import build, validate

    extra = list(rest)
    for key in FLAGS.values():
        value = getattr(args, f"k8s_{key}")
        if value is not None:
            extra += [f"--k8s.{key}", value]
    cfg = build(args.config, extra)
    for flag, name in PAIRS.items():
        for item in getattr(args, f"pairs_{name}"):
            key, eq, value = item.partition("=")
            if not eq or not key:
                raise UserError(f"{flag} {item}: write KEY=VALUE")
            getattr(cfg.k8s, name)[key] = value
    for item in args.toleration:
        key_value, colon, effect = item.rpartition(":") if ":" in item else (item, "", "")
        key, eq, value = key_value.partition("=")
        if not key:
            raise UserError(f"--toleration {item}: write KEY:EFFECT or KEY=VALUE:EFFECT")
        cfg.k8s.tolerations[key] = f"{value}:{effect}" if eq else effect
    return validate(cfg)


def manifests(args: argparse.Namespace, rest: list[str], serve_flags: list[str]) -> tuple[list[dict], object, tuple]:
    if args.what == "train":
        if args.model_uri:
            raise UserError(f"k8s train: unexpected argument {args.model_uri}; the run is --output.dir")
        from torchloom.k8s.job import train_manifests

        cfg = build_config(args, rest)
        return train_manifests(cfg), cfg.k8s, ()
    if args.what == "loop":
        from torchloom.k8s.loop import ADMIN_KEY_ENV, LOG_ENV, loop_manifests

        if args.model_uri:
            raise UserError(f"k8s loop: unexpected argument {args.model_uri}; the loop's flags go after --")
        cfg = build_config(args, rest)
        return loop_manifests(cfg.k8s, serve_flags), cfg.k8s, (ADMIN_KEY_ENV, LOG_ENV)
    from torchloom.k8s.deployment import serve_manifests
    from torchloom.k8s.manifests import API_KEY_ENV

    cfg = build_config(args, rest)
    return serve_manifests(args.model_uri, cfg.k8s, args.port, serve_flags), cfg.k8s, (API_KEY_ENV,)


def split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """torchloom k8s's own arguments, and the config's `--section.key value` (or `=value`) pairs: apart, so that
    argparse never takes an override's value for MODEL_URI."""
    own: list[str] = []
    overrides: list[str] = []
    i = 0
    while i < len(argv):
        if argv[i].startswith("--") and "." in argv[i].split("=", 1)[0]:
            take = 1 if "=" in argv[i] else 2
            overrides += argv[i:i + take]
            i += take
        else:
            own.append(argv[i])
            i += 1
    return own, overrides


def run(argv: list[str]) -> int:
    argv = list(argv)
    serve_flags = argv[argv.index("--") + 1:] if "--" in argv else []
    own, rest = split_overrides(argv[:argv.index("--")] if "--" in argv else argv)
    args = parser().parse_args(own)
    if args.what == "train" and serve_flags:
        raise UserError("k8s train: nothing goes after --; config keys are --SECTION.KEY VALUE")
    if args.apply:  # before anything is written: without the client, one line that says what to install
        from torchloom.k8s.apply import client_module

        client_module()
    objects, k, secret_keys = manifests(args, rest, serve_flags)
    from torchloom.k8s import manifests as m

    if args.out:
        for path in m.write_files(objects, args.out):
            print(f"torchloom k8s: wrote {path}", file=sys.stderr)
    elif not args.apply:
        sys.stdout.write(m.to_yaml(objects))
    if args.apply:
        from torchloom.k8s.apply import apply

        for line in apply(objects, k, secret_keys):
            print(f"torchloom k8s: {line}")
    return 0


def main(argv: list[str]) -> int:
    try:
        return run(argv)
    except UserError as e:
        print(f"torchloom: error: {one_line(e)}", file=sys.stderr)
        return UserError.exit_code
