"""Less padding on short texts (issue 48 item 2): padded batches against length-bucketed and packed ones.

    flock /tmp/torchloom-bench.lock .venv/bin/python benchmarks/padding.py [--corpora trec,sms] [--rounds 1]
        [--modes padded,bucketed,packed,bucketed+packed] [--batch 32] [--epochs 2] [--workers 2] [--sample 0]
        [--max-steps 0]

Each corpus (benchmarks/quality.py's converters: trec = one question each, sms = text messages) is prepared once
with `torchloom prepare` (the defaults) into --workdir; then `torchloom train` runs each mode on a fresh copy of
that data with the same seed, global batch, epochs and workers (MiniLM, precision auto): padded (the defaults
before this measurement), bucketed (train.length_bucketing true), packed (train.packing true), and both. Modes
are interleaved within a round (padded first), so a stray load on the 2 shared cores skews one row, not one mode.

Prints a table per run: the CPU (lscpu), corpus, mode, samples/s and real tokens/s over the whole fit (validation and
checkpoints included, train_result.json), the share of computed tokens that were padding, validation accuracy
of the last step, test accuracy of the last step's weights (scored here in fp32, padded: the weights alone
differ between modes), samples/s against the padded run of the same round, and the 1-minute load average before
and after the run. With --rounds 2 or more, each mode's best and median samples/s over the rounds. Then the
model's own cost without the trainer: forward+backward of the same 30 micro-batches padded and packed, one
process, alternately, from each corpus's loader with and without train.length_bucketing.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from quality import data_args

ROOT = Path(__file__).resolve().parent.parent
TORCHLOOM = [sys.executable, "-m", "torchloom"]
# Each mode sets both options: the defaults may change (length_bucketing became true with this measurement).
MODES = {"padded": ["--train.length_bucketing", "false", "--train.packing", "false"],
         "bucketed": ["--train.length_bucketing", "true", "--train.packing", "false"],
         "packed": ["--train.length_bucketing", "false", "--train.packing", "true"],
         "bucketed+packed": ["--train.length_bucketing", "true", "--train.packing", "true"]}


def cpu() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    return f"{fields.get('Model name', '?').strip()} (family {fields.get('CPU family', '?').strip()})"


def load() -> float:
    return os.getloadavg()[0]


def prepared(corpus: str, workdir: Path, sample: int) -> Path:
    """The corpus prepared once with torchloom's defaults; returns its run directory."""
    rd = workdir / f"{corpus}{f'-sample{sample}' if sample else ''}"
    if not (rd / "data" / "manifest.json").is_file():
        subprocess.run(TORCHLOOM + ["prepare", *data_args(corpus, workdir, sample), "--output.dir", str(rd),
                                    "--output.overwrite", "true"], check=True, cwd=ROOT, capture_output=True)
    return rd


def test_accuracy(rd: Path, step: int) -> float:
    """Accuracy on the test split of the weights at `step`, scored in fp32 with padded batches."""
    import numpy as np
    import torch

    from torchloom.data.eval_rows import eval_batches
    from torchloom.embedded import model_path
    from torchloom.manifest import read
    from torchloom.model.build import build_classifier
    from torchloom.model.forward import prepared_logits
    from torchloom.train.checkpoint import load_weights

    manifest = read(rd / "data")
    model = build_classifier(model_path(""), manifest.labels)
    model.load_state_dict(load_weights(rd / "checkpoints" / f"step-{step}"))
    logits, labels, _ = prepared_logits(model, eval_batches(manifest, "test", 0, 1, 64), torch.device("cpu"),
                                        "fp32", manifest.num_labels)
    return float(np.mean(logits.argmax(axis=1) == labels))


def train(source: Path, workdir: Path, name: str, args: argparse.Namespace) -> dict:
    rd = workdir / "runs" / name
    shutil.rmtree(rd, ignore_errors=True)
    rd.mkdir(parents=True)
    shutil.copytree(source / "data", rd / "data")
    before = load()
    subprocess.run(TORCHLOOM + ["train", "--output.dir", str(rd), "--train.batch_size", str(args.batch),
                                "--train.epochs", str(args.epochs), "--train.budget", "off", "--train.seed", "42",
                                "--engine.workers", str(args.workers), "--tracking.enabled", "false",
                                "--train.max_steps", str(args.max_steps),
                                *MODES[name.split("-")[1]]], check=True, cwd=ROOT, capture_output=True)
    result = json.loads((rd / "train_result.json").read_text())
    return {"samples_per_s": result["samples_per_s"], "tokens_per_s": result["tokens_per_s"],
            "padding": result["padding"], "val": result["last_eval"].get("accuracy", float("nan")),
            "test": test_accuracy(rd, result["steps"]), "load": f"{before:.1f}/{load():.1f}",
            "train_s": result["train_s"]}


def best_of_rounds(rows: list[dict]) -> None:
    """Each mode's best samples/s over the rounds, against padded's best (a stray load only ever slows a run)."""
    print("\n| corpus | mode | best samples/s | x padded (best) | median samples/s | test acc (each round) |")
    print("|---|---|---:|---:|---:|---|")
    for corpus in dict.fromkeys(x["corpus"] for x in rows):
        mine = [x for x in rows if x["corpus"] == corpus]
        modes = dict.fromkeys(x["mode"] for x in mine)
        best = {m: max(x["samples_per_s"] for x in mine if x["mode"] == m) for m in modes}
        for mode, b in best.items():
            runs = [x for x in mine if x["mode"] == mode]
            tests = ", ".join(f"{x['test']:.4f}" for x in runs)
            print(f"| {corpus} | {mode} | {b:.1f} | {b / best[next(iter(best))]:.2f} |"
                  f" {statistics.median(x['samples_per_s'] for x in runs):.1f} |"
                  f" {tests} |")


def step_costs(corpus: str, source: Path, bucketing: bool, micro_batch: int, batches: int = 30) -> None:
    """One table row: forward+backward of the same micro-batches, padded and packed, timed alternately."""
    import torch
    import torch.nn.functional as F

    from torchloom.data.loader import ShardedLoader
    from torchloom.data.packing import pack_batch
    from torchloom.embedded import model_path
    from torchloom.manifest import read
    from torchloom.model.build import build_classifier
    from torchloom.model.packing import packed_logits

    torch.set_num_threads(1)  # as each of the 2 workers runs
    manifest = read(source / "data")
    model = build_classifier(model_path(""), manifest.labels)
    loader = ShardedLoader(manifest, "train", rank=0, world_size=2, batch_size=micro_batch, seed=42,
                           length_bucketing=bucketing)
    padded = list(itertools.islice(loader, batches))
    packed = [pack_batch(b) for b in padded]
    cpu_device = torch.device("cpu")
    forwards = {"padded": lambda b: model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits,
                "packed": lambda b: packed_logits(model, model, b, cpu_device)}
    seconds = dict.fromkeys(forwards, 0.0)
    for _ in range(2):
        for name, data in (("padded", padded), ("packed", packed)):
            started = time.perf_counter()
            for b in data:
                with torch.autocast("cpu", torch.bfloat16):
                    logits = forwards[name](b)
                F.cross_entropy(logits.float(), b["labels"]).backward()
            seconds[name] += time.perf_counter() - started
    ms = {k: 1000 * v / (2 * batches) for k, v in seconds.items()}
    tokens = [sum(b["input_ids"].numel() for b in data) for data in (padded, packed)]
    print(f"| {corpus} | {'length_bucketing' if bucketing else 'default'} | {ms['padded']:.1f} | {ms['packed']:.1f} |"
          f" {ms['padded'] / ms['packed']:.2f} | {tokens[0]:,} / {tokens[1]:,} |", flush=True)


def inference_padding(corpus: str, source: Path) -> None:
    """One table row: the share of computed tokens that are padding when the test split is scored in manifest order
    (validation and `evaluate`, eval.batch_size 16) padded and packed, and by the Predictor (predict, serve, batch
    scoring), which sorts texts by length and cuts forwards at 32 rows (and, on a CPU, 1,024 padded tokens)."""
    from types import SimpleNamespace

    from torchloom.data.eval_rows import eval_batches
    from torchloom.data.packing import pack_batch
    from torchloom.manifest import read
    from torchloom.model.predict import CPU_FORWARD_TOKENS, Predictor

    batches = list(eval_batches(read(source / "data"), "test", 0, 1, 16))
    lengths = [int(n) for b in batches for n in b["attention_mask"].sum(dim=1)]
    real = sum(lengths)

    def share(computed: int) -> str:
        return f"{(1 - real / computed) * 100:.0f}%"

    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    predictor = {where: sum(len(ids) * lengths[ids[-1]] for ids in Predictor.forwards(
        SimpleNamespace(batch_size=32, forward_tokens=limit), lengths, order))
        for where, limit in (("cpu", CPU_FORWARD_TOKENS), ("cuda", 0))}
    print(f"| {corpus} | {share(sum(b['input_ids'].numel() for b in batches))} |"
          f" {share(sum(pack_batch(b)['input_ids'].numel() for b in batches))} | {share(predictor['cpu'])} |"
          f" {share(predictor['cuda'])} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpora", default="trec,sms")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--batch", type=int, default=32, help="train.batch_size: the global batch")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--max-steps", type=int, default=0, help="train.max_steps (0: the epochs decide); a smoke test")
    ap.add_argument("--sample", type=int, default=0, help="a random N texts of each corpus")
    ap.add_argument("--workdir", default="/tmp/tl-padding")
    args = ap.parse_args()
    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    workdir = Path(args.workdir)
    sources = {c: prepared(c, workdir, args.sample) for c in args.corpora.split(",")}
    rows = []
    for r in range(args.rounds):
        for corpus, source in sources.items():
            base = None
            for mode in args.modes.split(","):
                started = time.time()
                row = {"round": r, "corpus": corpus, "mode": mode,
                       **train(source, workdir, f"{corpus}-{mode}-{r}", args)}
                base = base or row["samples_per_s"]
                row["ratio"] = row["samples_per_s"] / base
                rows.append(row)
                print(f"{corpus} {mode} round {r}: {row['samples_per_s']:.1f} samples/s, test {row['test']:.4f},"
                      f" {time.time() - started:.0f} s", file=sys.stderr, flush=True)
    print(f"\n{datetime.now(UTC):%Y-%m-%d %H:%M} UTC; {cpu()}, {os.cpu_count()} cores; MiniLM, precision auto,"
          f" {args.workers} workers, global batch {args.batch}, {args.epochs} epochs, seed 42"
          f"{f', --sample {args.sample}' if args.sample else ''}, {args.rounds} interleaved round(s)\n")
    print("| corpus | mode | round | samples/s | x padded | tokens/s | padding | val acc | test acc | train s |"
          " load 1 min (before/after) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for x in rows:
        print(f"| {x['corpus']} | {x['mode']} | {x['round']} | {x['samples_per_s']:.1f} | {x['ratio']:.2f} |"
              f" {x['tokens_per_s']:,.0f} | {x['padding'] * 100:.0f}% | {x['val']:.4f} | {x['test']:.4f} |"
              f" {x['train_s']:.0f} | {x['load']} |")
    if args.rounds > 1:
        best_of_rounds(rows)
    print("\nforward+backward alone (bf16 autocast, one process, 1 thread, micro-batches of"
          f" {args.batch // args.workers} rows from each corpus's loader, 2 interleaved passes over 30): ms per"
          " micro-batch")
    print("| corpus | loader | padded ms | packed ms | x padded | tokens computed padded / packed |")
    print("|---|---|---:|---:|---:|---:|")
    for corpus, source in sources.items():
        for bucketing in (False, True):
            step_costs(corpus, source, bucketing, args.batch // args.workers)
    print("\npadding when scoring the test split: validation/evaluate order (batches of 16) padded and packed, and"
          " the Predictor's length-sorted forwards")
    print("| corpus | in order, padded | in order, packed | Predictor, CPU | Predictor, CUDA |")
    print("|---|---:|---:|---:|---:|")
    for corpus, source in sources.items():
        inference_padding(corpus, source)


if __name__ == "__main__":
    main()
