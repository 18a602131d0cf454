"""torchloom's training step against a minimal hand-written DDP loop, in one sitting.

    .venv/bin/python benchmarks/train_loop.py [--steps 40] [--workers 2] [--batch 16]
    .venv/bin/python benchmarks/train_loop.py --tiny [--workers 1,2,8] [--steps 300]

Prints one table: steady-state samples/s of the bare loop and of torchloom (bf16 and fp32), with
ratios, and the loader alone against what training consumes. Uses the embedded MiniLM and BBC News,
prepared once with `torchloom prepare` into --run-dir.

--tiny: a random 2-layer, 32-wide BERT (model/tiny.py) in fp32 instead, whose step costs almost nothing on a CPU,
so what remains is the work around the model, as on a GPU (issue 48): ms per step of the bare loop and of
torchloom at each --workers count, their ratio, and where torchloom's step time went (train_result.json's
time_split, train/clock.py). The bare loop does the same work as torchloom's defaults there: validation and a
checkpoint at each epoch end (bare_ddp.py --same-work).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TORCHLOOM = [sys.executable, "-m", "torchloom"]


def sh(cmd: list[str], quiet: bool = False, keep_stdout: bool = False) -> None:
    """Run `cmd`; quiet: its stderr (and its stdout unless keep_stdout) into a log file, whose last lines are
    printed if it fails (a bare loop that failed under torchrun used to leave nothing to read)."""
    if not quiet:
        subprocess.run(cmd, check=True, cwd=ROOT)
        return
    with tempfile.NamedTemporaryFile("w+", prefix="train-loop-", suffix=".log", delete=False) as log:
        code = subprocess.run(cmd, cwd=ROOT, stdout=None if keep_stdout else log, stderr=log).returncode
    if code:
        tail = Path(log.name).read_text(errors="replace").splitlines()[-40:]
        print("\n".join(tail), file=sys.stderr)
        raise SystemExit(f"train_loop: python {' '.join(cmd[1:4])} ... exited {code}; its output is in {log.name}"
                         " (last 40 lines above)")
    Path(log.name).unlink()


def ensure_data(run_dir: Path) -> None:
    if not (run_dir / "data" / "manifest.json").is_file():
        sh(TORCHLOOM + ["prepare", "--output.dir", str(run_dir), "--output.overwrite", "true"])


def bare(run_dir: Path, model_dir: str, steps: int, batch: int, workers: int, precision: str,
         same_work: bool = False, warmup: int = 3) -> dict:
    out = Path(tempfile.mkdtemp()) / "bare.json"
    launched = time.time()  # the same parent-side moment torchloom_train starts its clock at
    sh([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={workers}",
        str(ROOT / "benchmarks" / "bare_ddp.py"), str(run_dir / "data"), model_dir, str(steps), str(batch),
        precision, str(out), str(launched), "--warmup", str(warmup), *(["--same-work"] if same_work else [])],
       quiet=True)
    return json.loads(out.read_text())


def torchloom_train(run_dir: Path, steps: int, batch: int, workers: int, precision: str,
                    model: str | None = None, log_every: int = 1) -> dict:
    """Timed as the bare loop is: from a timestamp taken here before the launch, and by wall clock from
    the end of step 3 (or the first logged step after it) to the last step (metrics.jsonl's train lines carry
    the wall time). log_every: 1 logs every step (a small all-reduce and a file write each), the default 10
    what a user's run does."""
    started = time.time()
    sh(TORCHLOOM + ["train", "--output.dir", str(run_dir), "--train.max_steps", str(steps),
                    "--train.batch_size", str(batch), "--engine.workers", str(workers),
                    "--train.precision", precision, "--train.log_every", str(log_every), "--train.eval_every", "100000",
                    "--train.warmup_ratio", "0", "--train.budget", "off",
                    *(["--model.path", model] if model else [])], quiet=True, keep_stdout=True)
    wall = time.time() - started
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = {x["step"]: x for x in lines if x["kind"] == "train"}
    last, first = max(train), min(s for s in train if s >= 3)
    result = json.loads((run_dir / "train_result.json").read_text())
    return {"samples_per_s": (last - first) * batch / (train[last]["time"] - train[first]["time"]),
            "first_step_s": train[min(train)]["time"] - started, "total_s": wall,
            "time_split": result.get("time_split", {})}


def loader_alone(run_dir: Path, batch: int, workers: int) -> float:
    from torchloom.data.loader import ShardedLoader
    from torchloom.manifest import read

    m = read(run_dir / "data")
    ld = ShardedLoader(m, "train", rank=0, world_size=workers, batch_size=batch // workers, seed=0)
    ld.set_epoch(0)
    started, rows = time.perf_counter(), 0
    for b in ld:
        rows += len(b["labels"])
    # rows/s of one rank's loader, times the ranks: what the loaders feed the whole job
    return rows / (time.perf_counter() - started) * workers


def cpu_model() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "?")


def tiny(run_dir: Path, steps: int, batch: int, workers: list[int], rounds: int) -> None:
    """The tiny model: ms per step of the bare loop and of torchloom at each worker count (best of `rounds`)."""
    from torchloom.model.tiny import write_tiny_model

    model = write_tiny_model(Path(tempfile.mkdtemp()) / "tiny")
    print(f"\ntiny BERT (2 layers, 32 wide), fp32, global batch {batch}, {steps} steps, {cpu_model()}, best of"
          f" {rounds} interleaved rounds; both sides validate and checkpoint at each epoch end")
    print(f"{'workers':>7} {'bare ms/step':>13} {'torchloom ms/step':>18} {'x bare':>7}  torchloom's time split")
    for w in workers:
        bares, ours = [], []
        for _ in range(rounds):
            # both timed from the end of step 10 (torchloom's first log line at its default log_every)
            bares.append(bare(run_dir, model, steps, batch, w, "fp32", same_work=True, warmup=10))
            ours.append(torchloom_train(run_dir, steps, batch, w, "fp32", model=model, log_every=10))
        b = max(bares, key=lambda r: r["samples_per_s"])
        t = max(ours, key=lambda r: r["samples_per_s"])
        b_ms, t_ms = 1000 * batch / b["samples_per_s"], 1000 * batch / t["samples_per_s"]
        split = ", ".join(f"{k} {v * 100:.0f}%" for k, v in t["time_split"].items())
        print(f"{w:>7} {b_ms:13.2f} {t_ms:18.2f} {t_ms / b_ms:7.3f}  {split}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--workers", default="2", help="a number, or a comma list with --tiny")
    p.add_argument("--tiny", action="store_true", help="the tiny model, fp32: the work around the model")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--run-dir", default=os.path.join(tempfile.gettempdir(), "torchloom-bench", "bbc"))
    a = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from torchloom.embedded import demo_model_path

    run_dir = Path(a.run_dir)
    ensure_data(run_dir)
    if a.tiny:
        tiny(run_dir, a.steps, a.batch, [int(w) for w in a.workers.split(",")], a.rounds)
        return
    a.workers = int(a.workers)
    model = demo_model_path()
    # Interleaved rounds, best of each: on a 2-core machine a stray process skews one run, not all.
    runs: dict[str, list[dict]] = {"base": [], "bf16": [], "fp32": []}
    for _ in range(a.rounds):
        runs["base"].append(bare(run_dir, model, a.steps, a.batch, a.workers, "bf16"))
        runs["bf16"].append(torchloom_train(run_dir, a.steps, a.batch, a.workers, "bf16"))
        runs["fp32"].append(torchloom_train(run_dir, a.steps, a.batch, a.workers, "fp32"))
    base, tl_bf16, tl_fp32 = (max(runs[k], key=lambda r: r["samples_per_s"]) for k in ("base", "bf16", "fp32"))
    rows = [("bare DDP loop, bf16 (baseline)", base), ("torchloom train, bf16", tl_bf16),
            ("torchloom train, fp32", tl_fp32)]
    loader = loader_alone(run_dir, a.batch, a.workers)
    print(f"\nMiniLM on BBC News, {a.workers} workers, global batch {a.batch}, {a.steps} steps, max_length 128,"
          f" best of {a.rounds} interleaved rounds")
    print(f"{'what':34} {'samples/s':>10} {'x baseline':>11} {'first step s':>13} {'total s':>8}")
    for name, r in rows:
        print(f"{name:34} {r['samples_per_s']:10.2f} {r['samples_per_s'] / base['samples_per_s']:11.3f}"
              f" {r['first_step_s']:13.1f} {r['total_s']:8.1f}")
    print(f"{'bf16 / fp32 (torchloom)':34} {tl_bf16['samples_per_s'] / tl_fp32['samples_per_s']:10.2f}x")
    print(f"{'loader alone (all ranks)':34} {loader:10.0f} {'':11} -> {loader / tl_bf16['samples_per_s']:.0f}x what"
          " training consumes")


if __name__ == "__main__":
    main()
