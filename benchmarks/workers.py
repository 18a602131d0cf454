"""Workers on a CPU: 1 process with every core against one process per core (one thread each), same job.

    .venv/bin/python benchmarks/workers.py RUN_DIR [--steps 40] [--rounds 2] [--precision auto]

RUN_DIR holds prepared data (`torchloom prepare --output.dir RUN_DIR`). Each round trains `--steps`
optimizer steps of the same global batch (the config's, 16 by default) with each layout, one after the
other (interleaved, so a slow spell of the machine hits both), from a fresh start. Prints per run the
steady-state samples/s (the log windows after the first), the first step's time since launch and the
wall time, then the median per layout and its ratio against 1 process (the baseline of the table).
What engine.workers auto picks on a machine without GPUs rests on this (config/load.py CPU_WORKERS).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def train(run_dir: Path, workers: int, threads: int, steps: int, precision: str) -> dict:
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "torchloom", "train", "--output.dir", str(run_dir),
                    "--engine.workers", str(workers), "--engine.threads_per_worker", str(threads),
                    "--train.max_steps", str(steps), "--train.eval_every", str(10 * steps), "--train.log_every", "5",
                    "--train.precision", precision, "--tracking.enabled", "false"],
                   check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   env={**os.environ, "HF_HUB_OFFLINE": "1"})
    wall = time.perf_counter() - started
    result = json.loads((run_dir / "train_result.json").read_text())
    rates = [r["samples_per_s"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
             if r.get("kind") == "train"][1:]
    return {"workers": workers, "threads": threads, "steady": statistics.median(rates) if rates else 0.0,
            "first_step_s": result["first_step_s"], "wall_s": wall, "precision": result.get("precision")}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("run_dir")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--precision", default="auto")
    a = p.parse_args()
    from torchloom.machine import cpu

    cores = os.cpu_count() or 1
    layouts = [(1, cores), (cores, 1)]
    print(f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC; cpu: {cpu().describe()}; {a.steps} steps per run", flush=True)
    runs = []
    for r in range(a.rounds):
        for workers, threads in layouts:
            run = train(Path(a.run_dir), workers, threads, a.steps, a.precision)
            runs.append(run)
            print(f"round {r + 1}: {workers} x {threads} threads ({run['precision']}): {run['steady']:.2f} samples/s"
                  f" steady, first step {run['first_step_s']:.1f} s, wall {run['wall_s']:.1f} s", flush=True)
    print("\n| layout | steady samples/s (median) | x 1 process | first step s | wall s |\n|---|---:|---:|---:|---:|")
    base = None
    for workers, threads in layouts:
        mine = [x for x in runs if x["workers"] == workers]
        steady = statistics.median(x["steady"] for x in mine)
        base = base or steady
        print(f"| {workers} process{'es' if workers > 1 else ''} x {threads} thread{'s' if threads > 1 else ''} |"
              f" {steady:.2f} | {steady / base:.2f} | {statistics.median(x['first_step_s'] for x in mine):.1f} |"
              f" {statistics.median(x['wall_s'] for x in mine):.1f} |")


if __name__ == "__main__":
    main()
