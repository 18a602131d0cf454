"""The same 2-rank training as two hosts against one host, on the same cores, in one run.

    sudo .venv/bin/python benchmarks/multihost.py [--steps 40] [--rounds 2]

Two hosts: network namespaces from tests/cluster/netns.py (their own addresses and names, a bridge
between them), one torchrun agent and rank on each, gloo over the veth pair. One host: torchrun
--standalone with 2 ranks in one namespace. Both train MiniLM on the prepared demo data (bf16, global
batch 16, one torch thread per rank) for --steps steps; rounds alternate the two. Each side is timed
from one parent-side timestamp taken just before its processes start. Steady-state samples/s is the
median of rank 0's logging windows after the first (metrics.jsonl); wall time covers start-up too.
Needs root (namespaces).
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
sys.path.insert(0, str(ROOT / "tests"))

from cluster.netns import Cluster, unavailable  # noqa: E402


def worker_args(rd: Path, steps: int) -> list[str]:
    return ["-m", "torchloom.engines.torchrun", "--output.dir", str(rd), "--engine.workers", "2",
            "--engine.threads_per_worker", "1", "--train.max_steps", str(steps), "--train.log_every", "5",
            "--train.batch_size", "16", "--engine.device", "cpu"]


def steady(rd: Path) -> float:
    """Samples/s by wall clock from the first log step (5) to the last: both sides alike."""
    train = {r["step"]: r for r in map(json.loads, (rd / "metrics.jsonl").read_text().splitlines())
             if r.get("kind") == "train"}
    first, last = min(train), max(train)
    return (last - first) * 16 / (train[last]["time"] - train[first]["time"])


def env(tmp: Path) -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
            "GLOO_SOCKET_IFNAME": "eth0", "TMPDIR": str(tmp)}


def fresh(data: Path, tmp: Path, name: str) -> Path:
    rd = tmp / name
    shutil.rmtree(rd, ignore_errors=True)
    rd.mkdir()
    shutil.copytree(data, rd / "data")
    return rd


def two_hosts(data: Path, tmp: Path, steps: int, r: int) -> tuple[float, float]:
    rd = fresh(data, tmp, f"two-{r}")
    with Cluster(["b", "c"]) as hosts:
        b, c = hosts["b"], hosts["c"]
        argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{b.name}:29400", "--rdzv-id", f"bench{r}",
                *worker_args(rd, steps)]
        started = time.perf_counter()
        procs = [h.popen(argv, log=tmp / f"two-{r}-{h.name}.log", env=env(tmp)) for h in (b, c)]
        codes = [p.wait(timeout=900) for p in procs]
        wall = time.perf_counter() - started
    if any(codes):
        sys.exit(f"two hosts failed; see {tmp}/two-{r}-*.log")
    return wall, steady(rd)


def one_host(data: Path, tmp: Path, steps: int, r: int) -> tuple[float, float]:
    rd = fresh(data, tmp, f"one-{r}")
    with Cluster(["a"]) as hosts:
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                *worker_args(rd, steps)]
        started = time.perf_counter()
        code = hosts["a"].popen(argv, log=tmp / f"one-{r}.log", env=env(tmp)).wait(timeout=900)
        wall = time.perf_counter() - started
    if code:
        sys.exit(f"one host failed; see {tmp}/one-{r}.log")
    return wall, steady(rd)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args()
    reason = unavailable()
    if reason:
        sys.exit(f"benchmarks/multihost.py: {reason}")
    tmp = Path(tempfile.mkdtemp(prefix="torchloom-multihost-"))
    prepared = tmp / "prepared"
    subprocess.run([sys.executable, "-m", "torchloom", "prepare", "--output.dir", str(prepared),
                    "--tracking.enabled", "false"], check=True, env=env(tmp), capture_output=True)
    rows = []
    for r in range(a.rounds):
        for name, fn in (("one host, 2 ranks (baseline)", one_host), ("two hosts, 1 rank each", two_hosts)):
            wall, rate = fn(prepared / "data", tmp, a.steps, r)
            rows.append((r + 1, name, wall, rate))
            print(f"round {r + 1}: {name}: {wall:.1f} s, {rate:.1f} samples/s", flush=True)
    base = statistics.median(rate for _, n, _, rate in rows if n.startswith("one"))
    print(f"\n{'round':>5}  {'what':30} {'wall s':>7} {'samples/s':>10} {'x baseline':>11}")
    for r, name, wall, rate in rows:
        print(f"{r:>5}  {name:30} {wall:7.1f} {rate:10.1f} {rate / base:11.3f}")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
