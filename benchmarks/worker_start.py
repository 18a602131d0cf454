"""The local engine's worker start: forks of a fork server holding the imports against fresh interpreters.

    .venv/bin/python benchmarks/worker_start.py RUN_DIR [--model DIR] [--workers 2] [--steps 10] [--rounds 2]

RUN_DIR holds prepared data (`torchloom prepare --output.dir RUN_DIR --model.path DIR`); --model is the model
it was prepared for (default: the embedded MiniLM). Each round runs `torchloom train`
with `engine.start_method spawn` (the baseline: every worker a fresh interpreter that imports torch,
transformers and the training loop) and `auto` (on CPU: forks of a fork server that imported them once),
one after the other from a fresh start, then the same two with rank 1 SIGKILLed at step 5 (one restart:
the workers start twice). Both sides are timed from the moment before the process starts; CPU s is the
whole process tree's, the fork server included (a cgroup per run: needs root, else n/a). Prints each
run, then the medians and their ratios against spawn.
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


CPUACCT = Path("/sys/fs/cgroup/cpuacct")  # cgroup v1; v2's cpu.stat where that is what the machine has
UNIFIED = Path("/sys/fs/cgroup")


class TreeCPU:
    """CPU seconds of a command and everything it starts, the fork server too (which outlives the command and is
    nobody's waited-for child): a cgroup of its own (needs root), else None."""

    def __init__(self, name: str):
        base = CPUACCT if (CPUACCT / "cpuacct.usage").exists() else UNIFIED
        self.dir = base / f"tl-bench-{name}-{os.getpid()}"
        try:
            self.dir.mkdir()
        except OSError:
            self.dir = None

    def enter(self) -> None:  # in the child, before exec
        if self.dir is not None:
            (self.dir / "cgroup.procs").write_text(str(os.getpid()))

    def seconds(self) -> float | None:
        if self.dir is None:
            return None
        deadline = time.monotonic() + 30  # the fork server leaves soon after the command has
        while (self.dir / "cgroup.procs").read_text().strip() and time.monotonic() < deadline:
            time.sleep(0.2)
        if (self.dir / "cpuacct.usage").exists():
            used = int((self.dir / "cpuacct.usage").read_text()) / 1e9
        else:
            stat = dict(line.split() for line in (self.dir / "cpu.stat").read_text().splitlines())
            used = int(stat["usage_usec"]) / 1e6
        try:
            self.dir.rmdir()
        except OSError:
            pass
        return used


def train(run_dir: Path, model: str, method: str, workers: int, steps: int, kill: bool) -> dict:
    for name in ("checkpoints", "logs"):
        shutil.rmtree(run_dir / name, ignore_errors=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if kill:
        env["TORCHLOOM_FAULT"] = "rank=1,step=5,kind=kill"
    tree = TreeCPU(f"{method}-{int(kill)}")
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "torchloom", "train", "--output.dir", str(run_dir),
                    "--engine.workers", str(workers), "--engine.start_method", method, "--train.max_steps", str(steps),
                    "--train.checkpoint_every", "4", "--train.eval_every", str(10 * steps), "--train.log_every", "5",
                    "--tracking.enabled", "false", *(["--model.path", model] if model else [])],
                   check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                   preexec_fn=tree.enter)
    wall = time.perf_counter() - started
    cpu = tree.seconds()
    result = json.loads((run_dir / "train_result.json").read_text())
    return {"method": method, "kill": kill, "wall_s": wall, "cpu_s": cpu, "first_step_s": result["first_step_s"]}


def fmt(x: float | None, digits: int = 1) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("run_dir")
    p.add_argument("--model", default="")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args()
    from torchloom.machine import cpu

    print(f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC; cpu: {cpu().describe()}; {a.workers} workers, {a.steps} steps"
          " per run", flush=True)
    runs = []
    for r in range(a.rounds):
        for kill in (False, True):
            for method in ("spawn", "auto"):
                run = train(Path(a.run_dir), a.model, method, a.workers, a.steps, kill)
                runs.append(run)
                print(f"round {r + 1}: {method:5} {'one restart' if kill else 'no restart '}: first step"
                      f" {run['first_step_s']:.1f} s, wall {run['wall_s']:.1f} s, CPU {fmt(run['cpu_s'])} s",
                      flush=True)
    print("\n| run | workers start | first step s | wall s | CPU s | wall x spawn | CPU x spawn |"
          "\n|---|---|---:|---:|---:|---:|---:|")
    for kill in (False, True):
        base = {}
        for method in ("spawn", "auto"):
            mine = [x for x in runs if x["method"] == method and x["kill"] == kill]
            med = {k: statistics.median(x[k] or 0.0 for x in mine) for k in ("first_step_s", "wall_s", "cpu_s")}
            base = base or med
            label = "spawn (fresh interpreters)" if method == "spawn" else "auto (forks of the fork server)"
            cpu_ratio = med["cpu_s"] / base["cpu_s"] if base["cpu_s"] else None
            print(f"| {'one worker killed at step 5' if kill else 'uninterrupted'} | {label} |"
                  f" {med['first_step_s']:.1f} | {med['wall_s']:.1f} | {fmt(med['cpu_s'] or None)} |"
                  f" {med['wall_s'] / base['wall_s']:.2f} | {fmt(cpu_ratio, 2)} |")


if __name__ == "__main__":
    main()
