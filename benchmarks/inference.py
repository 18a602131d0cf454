"""Inference runtimes on this machine: PyTorch eager (fp32, and bf16 autocast as `serve --precision bf16`)
against ONNX Runtime fp32 and int8, one run.

    .venv/bin/python benchmarks/inference.py RUN_DIR [--rounds 3] [--single 64]

RUN_DIR: a finished `torchloom run` (its model/ and its prepared data/). The script copies model/ to a
temporary directory and exports it there with the ONNX parity gates (`export --format onnx-int8`: fp32
model.onnx and int8 model.int8.onnx), so RUN_DIR is not changed; a second copy is exported through
torch.export (the fallback exporter, whose graph's attention ONNX Runtime does not fuse) for comparison.
Then, for each runtime, through Predictor (clean, tokenize, forward, softmax: what predict, serve and Spark
batch run):

- accuracy on the run's test split (every text, batch 32);
- texts/s at batch 32 (the test texts in batches of 32) and at batch 1 (the first --single texts, one
  call each).

The runtimes are timed in turn, --rounds times, interleaved (torch, onnx, int8, torch, ...), each on
all cores; the table shows the median texts/s per runtime and its ratio to PyTorch eager measured in
the same rounds.
"""

from __future__ import annotations

import argparse
import platform
import shutil
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--single", type=int, default=64, help="texts timed one call each (batch 1)")
    args = ap.parse_args()

    import torch

    from torchloom.data.texts import gate_rows, texts_at
    from torchloom.machine import usable_cores
    from torchloom.manifest import read as read_manifest
    from torchloom.model.onnx import export_onnx
    from torchloom.model.predict import Predictor

    run = Path(args.run_dir)
    manifest = read_manifest(run / "data")
    if manifest.tokenizer.get("truncation") == "chunks":
        sys.exit("benchmarks/inference.py: use a run prepared without chunks (one row per text)")
    rows = manifest.split("test").rows
    by_row = texts_at(manifest, "test", set(range(rows)))
    texts = [by_row[i] for i in range(rows)]
    labels = gate_rows(manifest, rows).labels
    threads = usable_cores()
    torch.set_num_threads(threads)
    tmp = Path(tempfile.mkdtemp(prefix="tl-inference-"))
    try:
        model_dir = tmp / "model"
        shutil.copytree(run / "model", model_dir)
        started = time.perf_counter()
        gate = gate_rows(manifest, 2000)
        export_onnx(model_dir, gate, "onnx-int8", threads=threads, say=print)
        print(f"exported and gated in {time.perf_counter() - started:.0f} s")
        plain_dir = tmp / "plain"  # the torch.export graph, whose attention ONNX Runtime does not fuse
        shutil.copytree(run / "model", plain_dir)
        export_onnx(plain_dir, gate, "onnx-int8", threads=threads, exporter="torch.export")
        fp32_dir, plain_fp32_dir = tmp / "fp32", tmp / "plain-fp32"
        for src, dest in ((model_dir, fp32_dir), (plain_dir, plain_fp32_dir)):
            shutil.copytree(src, dest)
            info = (dest / "torchloom.json").read_text().replace('"file": "model.int8.onnx"', '"file": "model.onnx"')
            (dest / "torchloom.json").write_text(info)
        runtimes = {
            "PyTorch eager (fp32)": lambda b: Predictor(str(model_dir), batch_size=b),
            "PyTorch eager, bf16 autocast": lambda b: Predictor(str(model_dir), batch_size=b),
            "ONNX Runtime fp32": lambda b: Predictor(str(fp32_dir), batch_size=b, runtime="onnx", threads=threads),
            "ONNX Runtime int8": lambda b: Predictor(str(model_dir), batch_size=b, runtime="onnx", threads=threads),
            "ONNX Runtime fp32, unfused attention": lambda b: Predictor(str(plain_fp32_dir), batch_size=b,
                                                                        runtime="onnx", threads=threads),
            "ONNX Runtime int8, unfused attention": lambda b: Predictor(str(plain_dir), batch_size=b,
                                                                        runtime="onnx", threads=threads),
        }
        accuracy, batch32, batch1 = {}, {name: [] for name in runtimes}, {name: [] for name in runtimes}
        loaded = {name: (make(32), make(1)) for name, make in runtimes.items()}
        def call(name, predictor, batch):
            if "bf16" in name:  # what serve --precision bf16 does on CPU
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    return predictor.predict(batch)
            return predictor.predict(batch)

        for name, (p32, _) in loaded.items():
            predicted = [p["label"] for p in call(name, p32, texts)]
            accuracy[name] = float(np.mean([manifest.labels[y] == p for y, p in zip(labels, predicted)]))
        single = texts[:args.single]
        for r in range(args.rounds):
            for name, (p32, p1) in loaded.items():
                t = time.perf_counter()
                call(name, p32, texts)
                batch32[name].append(len(texts) / (time.perf_counter() - t))
                t = time.perf_counter()
                for text in single:
                    call(name, p1, [text])
                batch1[name].append(len(single) / (time.perf_counter() - t))
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(
                f"{name} {batch32[name][-1]:.0f}/{batch1[name][-1]:.0f} texts/s" for name in runtimes))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    base = "PyTorch eager (fp32)"
    print(f"\n{datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {platform.node()}, {threads} threads; {run} test split:"
          f" {rows} texts (batch 32), first {len(single)} (batch 1); median of {args.rounds} interleaved rounds\n")
    print("| runtime | accuracy | vs PyTorch (points) | batch 32 texts/s | x PyTorch | batch 1 texts/s | x PyTorch |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    base32, base1 = statistics.median(batch32[base]), statistics.median(batch1[base])
    for name in runtimes:
        b32, b1 = statistics.median(batch32[name]), statistics.median(batch1[name])
        print(f"| {name} | {accuracy[name]:.4f} | {100 * (accuracy[name] - accuracy[base]):+.2f} | {b32:.0f} |"
              f" {b32 / base32:.2f}x | {b1:.0f} | {b1 / base1:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
