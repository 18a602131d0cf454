"""The demo (`torchloom run`) on this checkout against the same command on an earlier commit, interleaved.

    .venv/bin/python benchmarks/demo_pair.py --base bcfbdd3 [--rounds 1] [extra torchloom overrides]

The earlier commit is checked out into a temporary git worktree and run with this venv
(PYTHONPATH points at its src/). Each round runs this checkout, then the base, each from a timestamp
taken just before its subprocess starts. Prints wall time, test accuracy and the ratio to the base.
MLflow tracking is off on both sides (`--tracking.enabled false`), so the pair measures torchloom only.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_demo(src: Path, run_dir: Path, extra: list[str]) -> tuple[float, dict]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(src / "src")}
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "torchloom", "run", "--output.dir", str(run_dir), "--overwrite",
                    "--tracking.enabled", "false", *extra], check=True, cwd=src, env=env,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - started, json.loads((run_dir / "summary.json").read_text())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--base", required=True, help="the git ref to compare with")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("extra", nargs="*")
    a = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="torchloom-pair-"))
    base_tree = tmp / "base"
    subprocess.run(["git", "worktree", "add", "--detach", str(base_tree), a.base], check=True, cwd=ROOT,
                   capture_output=True)
    rows = []
    try:
        for r in range(a.rounds):
            for name, src in (("this checkout", ROOT), (f"base {a.base}", base_tree)):
                wall, summary = run_demo(src, tmp / f"run-{r}", a.extra)
                rows.append((r, name, wall, summary["accuracy"], summary["timings"]))
                print(f"round {r + 1}: {name}: {wall:.1f} s, test accuracy {summary['accuracy']:.4f}", flush=True)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(base_tree)], cwd=ROOT, capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)
    base = statistics.median(w for _, n, w, _, _ in rows if n.startswith("base"))
    print(f"\n{'round':>5}  {'what':28} {'wall s':>7} {'x base':>7} {'test acc':>9}  stages")
    for r, name, wall, acc, timings in rows:
        stages = " ".join(f"{k[:-2]}={v:.0f}s" for k, v in timings.items() if k != "total_s")
        print(f"{r + 1:>5}  {name:28} {wall:7.1f} {wall / base:7.3f} {acc:9.4f}  {stages}")


if __name__ == "__main__":
    main()
