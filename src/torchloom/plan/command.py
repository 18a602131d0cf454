"""`torchloom plan`: parse, estimate, advise, print. Imports nothing heavy unless --calibrate."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace

from torchloom.errors import OneLineArgs, UserError, one_line
from torchloom.plan import advice, estimate, hardware, models, report, stages

EPILOG = """\
examples:
  torchloom plan --model bert-large --device-type a100-80g --nodes 2 --micro-batch 32 --rows 100000000
  torchloom plan --model llama-7b --device-type a100-40g --devices 8 --seq 512 --micro-batch 1 --json
  torchloom plan --model distilbert-base --devices 8 --have-spark      # 8 CPU executors
  torchloom plan --calibrate          # this machine's real step time against the estimate
  torchloom plan --run runs/bbc-minilm # a prepared run: its rows, lengths, batch, workers and precision
"""


DEFAULT_ROWS = 1_000_000


def parser() -> argparse.ArgumentParser:
    p = OneLineArgs(prog="torchloom plan", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
               description="Estimate memory, communication and time per parallel strategy before training:"
                           " pure arithmetic, no torch (except --calibrate).")
    _model_arguments(p.add_argument_group("model and batch"))
    _device_arguments(p.add_argument_group("devices (a preset, then your own numbers over it)"))
    _data_arguments(p.add_argument_group("data and parallelism"))
    g = p.add_argument_group("engine advice")
    g.add_argument("--have-spark", action="store_true", help="an existing Spark cluster runs your ETL")
    g.add_argument("--spark-cores", metavar="N", type=int,
                   help="cores of the Spark that runs prepare and the baseline, for their estimates (default: this"
                        " machine's)")
    g.add_argument("--have-ray", action="store_true", help="an existing Ray cluster")
    g.add_argument("--tuning", action="store_true", help="many trainings: hyper-parameter search")
    g.add_argument("--serving", action="store_true", help="the model will be served online")
    g = p.add_argument_group("output")
    g.add_argument("--json", action="store_true", help="every number as JSON")
    g.add_argument("--calibrate", action="store_true",
                   help="measure this machine's training step for the embedded MiniLM (seq 128, micro-batch 8, bf16)"
                        " and print it against the estimate (imports torch; ~15 s)")
    g.add_argument("--calibrate-steps", metavar="N", type=int, default=6,
                   help="timed steps after 2 warm-up steps (default: 6)")
    return p


def _model_arguments(g) -> None:
    g.add_argument("--model", metavar="NAME|DIR", default="minilm-l6",
                   help=f"a preset ({', '.join(models.PRESETS)}) or a local Hugging Face model dir"
                        " (default: %(default)s)")
    g.add_argument("--num-labels", metavar="N", type=int, help="classes (default: the config's id2label, else 2)")
    g.add_argument("--seq", metavar="TOKENS", type=int,
                   help="sequence length in tokens (default: 128; ViT: its patches + 1)")
    g.add_argument("--micro-batch", metavar="N", type=int, help="sequences per device per forward (default: 16)")
    g.add_argument("--grad-accum", metavar="N", type=int, default=1,
                   help="micro-batches per optimizer step (default: 1)")
    g.add_argument("--precision", choices=("auto", "fp32", "bf16", "fp16"),
                   help="bf16 / fp16: mixed precision; auto (default): what training picks on the device (a GPU's"
                        " bf16; on a CPU bf16 only where it is native, else fp32)")
    g.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    g.add_argument("--attention", choices=("sdpa", "eager"), default="sdpa",
                   help="sdpa: fused kernels, no stored scores (transformers' default); eager: adds 5as/h per layer")


def _device_arguments(g) -> None:
    g.add_argument("--device-type", metavar="NAME", default="auto",
                   help=f"auto, {', '.join(hardware.DEVICES)} (default: auto, this machine: its GPU, else its CPU)")
    # The machine's numbers: each flag overrides what the device type (or this machine) says.
    for flag, metavar, kind, text in (
        ("--devices", "N", int, "devices in all (default: 1, or nodes x devices-per-node)"),
        ("--nodes", "N", int, "machines (default: devices / devices-per-node)"),
        ("--devices-per-node", "N", int, "default: 8 for GPUs given --nodes, 1 for cpu"),
        ("--memory-gib", "GIB", float, "memory per device (cpu: per machine)"),
        ("--tflops", "TFLOPS", float, "peak dense TFLOP/s per device at --precision"),
        ("--mfu", "FRACTION", float, "model FLOPs utilisation 0-1 (default: 0.4 GPU, 0.5 cpu)"),
        ("--mem-bw", "GB/S", float, "memory bandwidth, GB/s"),
        ("--intra-bw", "GB/S", float, "device-to-device bandwidth inside a node, GB/s per direction"),
        ("--inter-bw", "GB/S", float, "network bandwidth per node, GB/s per direction"),
    ):
        g.add_argument(flag, metavar=metavar, type=kind, help=text)
    g.add_argument("--headroom", metavar="FRACTION", type=float, default=0.9,
                   help="usable fraction of device memory (default: 0.9)")
    g.add_argument("--no-overlap", action="store_true", help="communication never overlaps compute")


def _data_arguments(g) -> None:
    g.add_argument("--rows", metavar="N", type=int, default=DEFAULT_ROWS,
                   help="training rows per epoch (default: 1,000,000)")
    g.add_argument("--mean-tokens", metavar="N", type=int, help="mean tokens per row (default: every row fills --seq)")
    g.add_argument("--epochs", metavar="N", type=int, default=1)
    g.add_argument("--pipeline-stages", metavar="P", type=int, help="P (default: the fewest that fit)")
    g.add_argument("--pipeline-microbatches", metavar="M", type=int,
                   help="M per step (default: grad-accum x P, the same global batch as DDP)")
    g.add_argument("--run", metavar="DIR", help="a run dir that prepare wrote: rows, tokens per row, classes, and"
                                                " the config's batch, workers, epochs and precision (flags given"
                                                " here win)")


def positive(name: str, value) -> None:
    if value is not None and value <= 0:
        raise UserError(f"{name} {value}: must be positive; see torchloom plan --help")


def validate(args: argparse.Namespace) -> None:
    for flag in ("num_labels", "seq", "micro_batch", "grad_accum", "rows", "mean_tokens", "epochs", "memory_gib",
                 "tflops", "mfu", "mem_bw", "intra_bw", "inter_bw", "headroom", "pipeline_microbatches",
                 "calibrate_steps", "spark_cores"):
        positive("--" + flag.replace("_", "-"), getattr(args, flag))
    for flag in ("mfu", "headroom"):
        if getattr(args, flag) is not None and getattr(args, flag) > 1:
            raise UserError(f"--{flag} {getattr(args, flag)}: a fraction, at most 1 (e.g. 0.4)")
    if args.pipeline_stages is not None and args.pipeline_stages < 2:
        raise UserError(f"--pipeline-stages {args.pipeline_stages}: a pipeline has at least 2 stages")


def build_job(args: argparse.Namespace) -> estimate.Job:
    validate(args)
    model = models.resolve(args.model)
    if args.num_labels:
        model = replace(model, num_labels=args.num_labels)
    seq = args.seq or model.default_seq
    if model.family != "vit" and model.max_positions and seq > model.max_positions:
        raise UserError(f"--seq {seq}: {model.name} has {model.max_positions} positions; use --seq"
                        f" {model.max_positions} or less")
    kind = hardware.detect() if args.device_type == "auto" else args.device_type
    precision = plan_precision(args.precision or "auto", kind)
    tflops = {"tflops_fp32" if precision == "fp32" else "tflops_bf16": args.tflops}
    spec = hardware.device(kind, memory_gib=args.memory_gib, mem_bw_gbs=args.mem_bw,
                           intra_bw_gbs=args.intra_bw, inter_bw_gbs=args.inter_bw, mfu=args.mfu, **tflops)
    return estimate.Job(
        model=model, cluster=hardware.cluster(spec, args.devices, args.nodes, args.devices_per_node), seq=seq,
        micro_batch=args.micro_batch or 16, grad_accum=args.grad_accum, precision=precision,
        optimizer=args.optimizer, attention=args.attention, rows=args.rows, mean_tokens=args.mean_tokens or 0,
        epochs=args.epochs, pipeline_stages=args.pipeline_stages or 0,
        pipeline_microbatches=args.pipeline_microbatches or 0, headroom=args.headroom, overlap=not args.no_overlap,
    )


def plan_precision(setting: str, kind: str) -> str:
    """--precision as training would run it: the one rule (torchloom.machine), on this CPU's facts for cpu
    and on a GPU's bf16 for the GPU presets (all of them have it)."""
    from torchloom import machine

    device = "cpu" if kind == "cpu" else "cuda"
    return machine.choose_precision(setting, device, cpu_bf16=machine.cpu().bf16_how, cuda_bf16=True,
                                    key="--precision").precision


def from_run(args: argparse.Namespace) -> None:
    """Fill what --run's prepared data and config say, where the flags left it open."""
    from pathlib import Path

    from torchloom import config as config_mod
    from torchloom import manifest as manifest_mod

    root = Path(args.run)
    if not (root / "data" / "manifest.json").is_file():
        raise UserError(f"--run {args.run}: no prepared data there (data/manifest.json); run torchloom prepare"
                        f" --output.dir {args.run} first")
    m = manifest_mod.read(root / "data")
    cfg = config_mod.load_saved(root / "config.toml") if (root / "config.toml").is_file() else config_mod.Config()
    workers = cfg.engine.workers if cfg.engine.workers != "auto" else config_mod.load.CPU_WORKERS
    train = m.split("train")
    args.rows = args.rows if args.rows != DEFAULT_ROWS else train.rows
    args.seq = args.seq or int(m.tokenizer.get("max_length") or 128)
    lengths = m.tokenizer.get("lengths") or {}
    if not args.mean_tokens and lengths.get("truncated_share", 1.0) < 0.9 and lengths.get("p50"):
        args.mean_tokens = min(args.seq, int(lengths["p50"]))
    args.num_labels = args.num_labels or m.num_labels
    args.devices = args.devices or workers
    if args.nodes is None and args.devices_per_node is None:
        args.devices_per_node = args.devices  # the local engine: every worker on this one machine
    from torchloom.config.budget import choose_batch

    batch = cfg.train.batch_size
    if batch == "auto":  # what the run will choose for this data (config/budget.py)
        batch = choose_batch(m.num_labels, train.rows, args.seq, workers * cfg.train.grad_accum)[0]
    args.micro_batch = args.micro_batch or max(1, batch // (workers * cfg.train.grad_accum))
    args.grad_accum = cfg.train.grad_accum if args.grad_accum == 1 else args.grad_accum
    if args.epochs == 1:  # the run's own: what train.epochs auto will choose for this data (config/budget.py)
        from torchloom.config.budget import choose_epochs

        epochs = cfg.train.epochs
        args.epochs = epochs if epochs != "auto" else choose_epochs(cfg.train.budget, m.num_labels, train.rows,
                                                                    batch)[0]
    args.precision = args.precision or cfg.train.precision


def plan(args: argparse.Namespace) -> int:
    if args.run:
        from_run(args)
    job = build_job(args)
    strategies = estimate.estimate(job)
    site = advice.Site(have_spark=args.have_spark, have_ray=args.have_ray, tuning=args.tuning, serving=args.serving)
    adv = advice.advise(job, strategies, site)
    around = stages.stages(job, args.spark_cores or os.cpu_count() or 1)
    measured = against_run(args, strategies) if args.run else None
    if args.json:
        extra = {"measured": measured} if measured else {}
        print(json.dumps({**report.to_json(job, strategies, adv, around), **extra}, indent=2))
    else:
        print(report.render(job, strategies, adv, around))
        if measured:
            print(f"measured: the run trained at {measured['samples_per_s']:,.1f} samples/s with {measured['strategy']}"
                  f" (train_result.json); this estimate {measured['estimated_samples_per_s']:,.1f}: the estimate is"
                  f" {measured['ratio']:.2f}x the measured rate")
    return 0


def against_run(args: argparse.Namespace, strategies: list) -> dict | None:
    """How far the estimate is from what the run measured (its train_result.json), for the strategy it ran."""
    from pathlib import Path

    from torchloom import config as config_mod

    root = Path(args.run)
    try:
        result = json.loads((root / "train_result.json").read_text())
        strategy = config_mod.load_saved(root / "config.toml").train.strategy
    except (OSError, ValueError, UserError):
        return None
    st = next((s for s in strategies if s.name == strategy and s.applicable), None)
    rate = float(result.get("samples_per_s") or 0)
    if st is None or rate <= 0 or st.samples_per_s <= 0:
        return None
    return {"strategy": strategy, "samples_per_s": rate, "estimated_samples_per_s": round(st.samples_per_s, 1),
            "ratio": round(st.samples_per_s / rate, 3), "tokens_per_s": result.get("tokens_per_s"),
            "mfu": result.get("mfu")}


def calibrate(args: argparse.Namespace) -> int:
    from torchloom.plan import calibrate as cal  # torch is imported only here

    if args.device_type not in ("auto", "cpu"):
        raise UserError(f"--calibrate measures this machine's CPU: drop --device-type {args.device_type}")
    args.device_type = "cpu"
    args.model = cal.embedded_model_dir()
    args.seq, args.micro_batch = args.seq or 128, args.micro_batch or 8
    args.precision = cal.precision(args.precision or "auto")
    job = build_job(args)
    job = replace(job, model=replace(job.model, name="all-MiniLM-L6-v2"))
    result = cal.compare(job, steps=args.calibrate_steps)
    print(json.dumps(result, indent=2) if args.json else cal.render(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    """`torchloom plan ARGS`: the exit code (2 for bad input, with a one-line message on stderr)."""
    try:
        args = parser().parse_args(sys.argv[1:] if argv is None else argv)
        return calibrate(args) if args.calibrate else plan(args)
    except UserError as e:
        print(f"torchloom: error: {one_line(e)}", file=sys.stderr)
        return UserError.exit_code
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else 0
    except BrokenPipeError:  # `| head` stopped reading: not an error (the recipe in Python's signal docs)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
