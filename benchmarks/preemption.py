"""Preemption: steps lost and seconds from notice to exit, against a crash at the same step.

    .venv/bin/python benchmarks/preemption.py [--rounds 3] [--model minilm|tiny] [--engine local|spark|ray]
                                              [--no-write]

2 workers on the chosen engine (spark: local-cluster[2,1,2048], executors as worker processes; ray: a local
instance), 2 workers, fp32, global batch 16, a periodic checkpoint every 4 steps. minilm: the embedded
MiniLM on the demo's prepared data (runs/bbc-minilm/data, made by `torchloom run`), max_steps 14; tiny: a
random 2-layer model on synthetic data. Per round, a random rank and step K (seeded), three runs:
- notice: SIGTERM to that worker at step K (TORCHLOOM_FAULT kind=term): every worker stops after the same
  step with a checkpoint of it, and the run goes on from there. Steps lost: K minus the step it went on from.
- crash: the same worker SIGKILLed at step K (a host taken back without notice, today's path before this
  change), engine.max_restarts 1: it goes on from the newest periodic checkpoint.
- launcher (local engine only): SIGTERM to `torchloom train` once step K is in metrics.jsonl: seconds from the
  signal to the process's exit (code 75), and the step of the checkpoint it left.
Both sides of each row timed from the same moment in the same round; writes '## Preemption' in
docs/benchmarks.md unless --no-write.
"""

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHECKPOINT_EVERY = 4


def setup(kind: str, work: Path) -> tuple[str, Path, list[str]]:
    """(model path, prepared data dir, extra config) for the chosen model."""
    if kind == "tiny":
        from torchloom.data.synthetic import write_synthetic_dataset
        from torchloom.model.tiny import write_tiny_model

        data = work / "data"
        write_synthetic_dataset(data, rows={"train": 400, "val": 40, "test": 20}, rows_per_group=20, rows_per_shard=100)
        return write_tiny_model(work / "tiny"), data, ["--train.max_steps", "20"]
    from torchloom.embedded import demo_model_path

    data = ROOT / "runs" / "bbc-minilm" / "data"
    if not (data / "manifest.json").is_file():
        raise SystemExit(f"{data}: no prepared demo data; run `torchloom run` first, or use --model tiny")
    return demo_model_path(), data, ["--train.max_steps", "14"]


def args_for(rd: Path, model: str, extra: list[str], *more: str) -> list[str]:
    return ["--output.dir", str(rd), "--model.path", model, "--train.precision", "fp32", "--train.batch_size", "16",
            "--engine.workers", "2", "--train.log_every", "1", "--train.keep_last", "20", "--train.checkpoint_every",
            str(CHECKPOINT_EVERY), "--tracking.enabled", "false", *extra, *more]


def new_run(work: Path, data: Path, name: str) -> Path:
    rd = work / name
    shutil.rmtree(rd, ignore_errors=True)
    rd.mkdir(parents=True)
    shutil.copytree(data, rd / "data")
    return rd


def in_process(rd: Path, args: list[str], fault: str, engine: str) -> tuple[dict, float]:
    from torchloom.config import build

    os.environ["TORCHLOOM_FAULT"] = fault
    cfg = build(None, [*args, "--engine.name", engine])
    started = time.perf_counter()
    try:
        if engine == "spark":
            from torchloom.engines import spark
            from torchloom.etl.session import get_spark

            result = spark.train(cfg, rd, quiet=True, spark=get_spark(cfg.prepare))
        elif engine == "ray":
            from torchloom.engines import ray

            result = ray.train(cfg, rd, quiet=True)
        else:
            from torchloom.engines import local

            result = local.train(cfg, rd, quiet=True)
    finally:
        del os.environ["TORCHLOOM_FAULT"]
    return result.to_dict(), time.perf_counter() - started


def launcher_round(rd: Path, args: list[str], step: int) -> tuple[float, int, int]:
    """SIGTERM to `torchloom train` once `step` is logged: (seconds to exit, exit code, checkpoint step)."""
    proc = subprocess.Popen([sys.executable, "-m", "torchloom", "train", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 900
    while proc.poll() is None and time.monotonic() < deadline:
        lines = (rd / "metrics.jsonl").read_text().splitlines() if (rd / "metrics.jsonl").is_file() else []
        if any(json.loads(x).get("kind") == "train" and json.loads(x)["step"] >= step for x in lines if x.strip()):
            break
        time.sleep(0.02)
    signalled = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    exit_s = time.perf_counter() - signalled
    steps = [int(p.name.split("-")[1]) for p in (rd / "checkpoints").glob("step-*")]
    return exit_s, proc.returncode, max(steps, default=0)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--model", default="minilm", choices=["minilm", "tiny"])
    p.add_argument("--engine", default="local", choices=["local", "spark", "ray"])
    p.add_argument("--no-write", action="store_true")
    a = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from torchloom.machine import cpu

    work = Path(tempfile.mkdtemp(prefix="torchloom-bench-preempt-"))
    model, data, extra = setup(a.model, work)
    total = int(extra[-1])
    if a.engine == "spark":
        extra = [*extra, "--prepare.spark_master", "local-cluster[2,1,2048]", "--engine.threads_per_worker", "1"]
    rng = random.Random(29)
    rows = []
    for n in range(a.rounds):
        rank, step = rng.randrange(2), rng.randrange(CHECKPOINT_EVERY + 1, total - 2)
        while step % CHECKPOINT_EVERY == 0:  # a step with a periodic checkpoint would flatter the crash
            step = rng.randrange(CHECKPOINT_EVERY + 1, total - 2)
        rd = new_run(work, data, f"notice-{n}")
        notice, notice_s = in_process(rd, args_for(rd, model, extra, "--engine.max_restarts", "0"),
                                      f"rank={rank},step={step},kind=term", a.engine)
        [pre] = notice["preemptions"]
        rd = new_run(work, data, f"crash-{n}")
        crash, crash_s = in_process(rd, args_for(rd, model, extra, "--engine.max_restarts", "1"),
                                    f"rank={rank},step={step},kind=kill", a.engine)
        crash_from = int(Path(crash["resumed_from"]).name.split("-")[1]) if crash["resumed_from"] else 0
        exit_s, code, left = float("nan"), "-", 0
        if a.engine == "local":
            rd = new_run(work, data, f"launcher-{n}")
            exit_s, code, left = launcher_round(rd, args_for(rd, model, extra), step)
        rows.append({"round": n, "rank": rank, "step": step, "notice_lost": max(0, step - pre["resumed_from_step"]),
                     "notice_checkpoint_s": pre["checkpoint_s"], "notice_run_s": notice_s,
                     "crash_lost": step - crash_from, "crash_run_s": crash_s, "launcher_exit_s": exit_s,
                     "launcher_code": code, "launcher_left": left})
        print(json.dumps(rows[-1]), flush=True)
    c = cpu()
    lines = [f"`benchmarks/preemption.py --rounds {a.rounds} --model {a.model} --engine {a.engine}`,"
             f" {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {c.model} ({c.cores} cores), {a.engine} engine,"
             " 2 workers, fp32,"
             f" global batch 16, {total} steps, a periodic checkpoint every {CHECKPOINT_EVERY} steps.", "",
             "| round | rank | notice at step | notice: steps lost | notice: checkpoint s | notice: run s"
             " | crash: steps lost | crash: run s | run s notice / crash | launcher: signal to exit s"
             " | launcher: exit code, checkpoint step |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['round']} | {r['rank']} | {r['step']} | {r['notice_lost']} | {r['notice_checkpoint_s']:.2f}"
                     f" | {r['notice_run_s']:.1f} | {r['crash_lost']} | {r['crash_run_s']:.1f}"
                     f" | {r['notice_run_s'] / r['crash_run_s']:.2f} | "
                     + (f"{r['launcher_exit_s']:.1f} | {r['launcher_code']}, step {r['launcher_left']} |"
                        if a.engine == "local" else "- | - |"))
    lines += ["", f"Mean steps lost: notice {statistics.mean(r['notice_lost'] for r in rows):.2f}, crash"
                  f" {statistics.mean(r['crash_lost'] for r in rows):.2f}."]
    body = "\n".join(lines)
    print("\n" + body)
    shutil.rmtree(work, ignore_errors=True)
    if not a.no_write:
        import re

        path = ROOT / "docs" / "benchmarks.md"
        old = path.read_text(encoding="utf-8")
        title = "## Preemption: a notice against a crash at the same step (issue 29)"
        if a.engine != "local":
            title = f"## Preemption on the {a.engine} engine: a notice against a crash at the same step (issue 29)"
        section = f"{title}\n\n{body}\n"
        match = re.search(rf"^{re.escape(title)}.*?(?=^## |\Z)", old, flags=re.M | re.S)
        new = (old[:match.start()] + section + "\n" + old[match.end():] if match
               else old.rstrip("\n") + "\n\n" + section)
        path.write_text(new, encoding="utf-8")
        print(f"written to {path}")


if __name__ == "__main__":
    main()
