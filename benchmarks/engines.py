"""The same short training on each engine, next to the bare launchers, in one sitting.

    .venv/bin/python benchmarks/engines.py [--steps 40] [--engines local,spark,ray] [--rounds 3]

For each engine: torchloom train (MiniLM on BBC News, 2 workers, global batch 16, bf16) and the bare
launcher running the same minimal loop (benchmarks/bare_ddp.py): torchrun, TorchDistributor.run
(local_mode), TorchTrainer.fit on a local Ray instance. Prints time to first step (from the launch
call), steady-state samples/s (wall clock from the end of step 3 to the last step, both sides), total
wall time and, for torchloom, the final
validation accuracy; then the ratios the targets are about, steady state both as the ratio of the
medians and as the median of the per-round ratios (each pairs two runs of the same round).

Rounds are interleaved (every launcher once per round, in the same order) and each figure is the
median over rounds. Both sides are timed from one timestamp this script takes before it launches
them (before the subprocess, the Spark session or the Ray instance): torchloom's first step and
throughput come from the wall-clock times in its metrics.jsonl. On a shared 2-core VM one launch can
run 20% slower than the next for reasons that have nothing to do with the launcher, and a single
sequential pass charges that drift to whichever engine happened to run last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))


def torchloom_run(engine: str, run_dir: Path, steps: int) -> dict:
    """Timed like the bare side: from one timestamp taken here before the launch, by wall clock over
    the same step range (steps 4..N: the bare loop's clock starts after its third step)."""
    started = time.time()
    subprocess.run([sys.executable, "-m", "torchloom", "train", "--output.dir", str(run_dir), "--engine.name", engine,
                    "--train.max_steps", str(steps), "--train.log_every", "1", "--train.warmup_ratio", "0",
                    "--train.eval_every", "100000", "--prepare.spark_master", "local[2]"],
                   check=True, cwd=ROOT, stderr=subprocess.DEVNULL)
    wall = time.time() - started
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = {x["step"]: x for x in lines if x["kind"] == "train"}
    evals = [x for x in lines if x["kind"] == "eval"]
    last = max(train)
    return {"samples_per_s": (last - 3) * 16 / (train[last]["time"] - train[3]["time"]),
            "first_step_s": train[1]["time"] - started, "total_s": wall,
            "val_accuracy": evals[-1]["accuracy"] if evals else float("nan")}


def bare_torchrun(data: Path, model: str, steps: int) -> dict:
    out = Path(tempfile.mkdtemp()) / "bare.json"
    launched = time.time()
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                    str(ROOT / "benchmarks" / "bare_ddp.py"), str(data), model, str(steps), "16", "bf16", str(out),
                    str(launched)], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return {**json.loads(out.read_text()), "total_s": time.time() - launched}


def _bare_for_spark(data: str, model: str, steps: int, launched: float) -> dict:
    from bare_ddp import bare_loop

    return bare_loop(data, model, steps, 16, "bf16", launched)


def bare_spark(data: Path, model: str, steps: int) -> dict:
    from pyspark.ml.torch.distributor import TorchDistributor

    from torchloom.config import PrepareConfig
    from torchloom.etl.session import get_spark

    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH", "")])
    launched = time.time()  # before the session starts: torchloom's clock includes its Spark start too
    spark = get_spark(PrepareConfig(spark_master="local[2]"))
    result = TorchDistributor(num_processes=2, local_mode=True, use_gpu=False).run(
        _bare_for_spark, str(data), model, steps, launched)
    spark.stop()
    return {**result, "total_s": time.time() - launched}


def _bare_for_ray(config: dict) -> None:
    import ray.train
    from bare_ddp import bare_loop

    r = bare_loop(config["data"], config["model"], config["steps"], 16, "bf16", config["launched"])
    if ray.train.get_context().get_world_rank() == 0:
        Path(config["out"]).write_text(json.dumps(r))


def bare_ray(data: Path, model: str, steps: int) -> dict:
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from torchloom.engines.ray import init_ray

    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH", "")])
    out = Path(tempfile.mkdtemp()) / "bare.json"
    launched = time.time()
    init_ray("")
    TorchTrainer(_bare_for_ray, train_loop_config={"data": str(data), "model": model, "steps": steps,
                                                   "launched": launched, "out": str(out)},
                 scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.99}),
                 run_config=RunConfig(storage_path=tempfile.mkdtemp())).fit()
    ray.shutdown()
    return {**json.loads(out.read_text()), "total_s": time.time() - launched}


def median(results: list[dict]) -> dict:
    """Each figure's median over the rounds (figures of different rounds may mix: that is the point)."""
    return {key: statistics.median(r[key] for r in results) for key in results[0]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--engines", default="local,spark,ray")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--run-dir", default=os.path.join(tempfile.gettempdir(), "torchloom-bench", "bbc"))
    a = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from torchloom.embedded import demo_model_path

    run_dir = Path(a.run_dir)
    if not (run_dir / "data" / "manifest.json").is_file():
        subprocess.run([sys.executable, "-m", "torchloom", "prepare", "--output.dir", str(run_dir), "--overwrite"],
                       check=True, cwd=ROOT)
    model, data = demo_model_path(), run_dir / "data"
    bare = {"local": ("torchrun", bare_torchrun), "spark": ("TorchDistributor.run", bare_spark),
            "ray": ("TorchTrainer.fit", bare_ray)}
    engines = a.engines.split(",")
    runs: dict[tuple[str, str], list[dict]] = {}
    for r in range(a.rounds):
        for engine in engines:
            name, fn = bare[engine]
            runs.setdefault((engine, "bare"), []).append(fn(data, model, a.steps))
            runs.setdefault((engine, "torchloom"), []).append(torchloom_run(engine, run_dir, a.steps))
        print(f"round {r + 1}: " + "  ".join(f"{e}/{k} {v[-1]['samples_per_s']:.2f}" for (e, k), v in runs.items()),
              flush=True)
    rows = [(engine, bare[engine][0], median(runs[(engine, "bare")]), median(runs[(engine, "torchloom")]))
            for engine in engines]
    print(f"\nMiniLM on BBC News, 2 workers, global batch 16, bf16, {a.steps} steps, {os.cpu_count()} cores,"
          f" median of {a.rounds} interleaved rounds")
    print(f"{'engine':7} {'launcher':22} {'first step s':>12} {'samples/s':>10} {'total s':>8} {'val acc':>8}")
    for engine, name, b, t in rows:
        label = "bare " + name
        print(f"{engine:7} {label:22} {b['first_step_s']:12.1f} {b['samples_per_s']:10.2f} {b['total_s']:8.1f}")
        print(f"{engine:7} {'torchloom':22} {t['first_step_s']:12.1f} {t['samples_per_s']:10.2f} {t['total_s']:8.1f}"
              f" {t['val_accuracy']:8.3f}")
    local = next((t for e, _, _, t in rows if e == "local"), None)
    print("\nratios")
    for engine, _, b, t in rows:
        line = f"{engine:7} start-up torchloom/bare {t['first_step_s'] / b['first_step_s']:.2f}"
        if local is not None:
            # Paired within each round too: a round's drift then hits both sides of its ratio alike.
            paired = [x["samples_per_s"] / y["samples_per_s"]
                      for x, y in zip(runs[(engine, "torchloom")], runs[("local", "torchloom")])]
            line += (f"   steady samples/s vs torchloom local {t['samples_per_s'] / local['samples_per_s']:.3f}"
                     f" (per round {', '.join(f'{x:.2f}' for x in paired)}; median {statistics.median(paired):.3f})")
        print(line)


if __name__ == "__main__":
    main()
