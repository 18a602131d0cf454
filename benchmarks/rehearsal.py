"""A rehearsal of every stage at 1 and 10 million rows: where the time and the memory go as the rows grow.

    .venv/bin/python benchmarks/rehearsal.py [--sizes 1000000,10000000] [--steps 300] [--workdir DIR] [--no-write]

For each size N, one after the other, as a new user would run it (every default but the tiny model and the steps):
N rows of generated labelled text (benchmarks/scale.make_csv: 5 labels, 4-64 words) in one CSV, then each stage as
its own command: `prepare` (which fits the baseline too, auto picking Spark MLlib past 200,000 train texts: its ETL
and baseline parts are read from the manifest's timings and baseline.json), `train` (the tiny random BERT of
torchloom.model.tiny, --train.max_steps --steps, the local engine), `export` (with its monitoring profile and the
mix's weight on val), `evaluate` (the baseline's scores reused), `predict --score-with spark` over the N rows, and
`monitor --read-with spark --labels topic` over them. Measured per stage: wall seconds from the command's start,
rows/s (N over the wall time; the split's rows for train, export and evaluate are capped, so theirs is N / s too, to
compare sizes), and the
peak resident memory of the command's process (the driver) and of its descendants together (Spark's JVM and Python
workers, the training ranks), sampled every 0.2 s. Prints the table with the growth of the cost per row and of the
peaks from the first size to the last, and writes it to docs/benchmarks.md under '## Rehearsal' (that section only).
Run under soak, not in CI: 10 M rows take hours on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import scale  # noqa: E402

SECTION = "## Rehearsal"
STAGES = ("prepare", "train", "export", "evaluate", "predict", "monitor")


def cpu_name() -> str:
    """The CPU with its family, model and bf16 kind (lscpu's bare "AMD EPYC" names no machine)."""
    from torchloom.machine import cpu

    c = cpu()
    return f"{c.model} (family {c.family}, model {c.model_id}, {c.bf16_how or 'no native bf16'}, {c.vector})"


def watched(cmd: list[str]) -> dict:
    """Run cmd; its wall seconds and the peaks (MB) of its own process and of its descendants."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    started, driver, workers = time.perf_counter(), 0.0, 0.0
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True)
    reader.start()
    while proc.poll() is None:
        driver = max(driver, scale.rss_mb(proc.pid))
        workers = max(workers, sum(scale.rss_mb(p) for p in scale.descendants(proc.pid)))
        time.sleep(0.2)
    seconds = time.perf_counter() - started
    reader.join(5)
    if proc.returncode not in (0, 3):  # monitor's 3: drift found, a verdict
        raise SystemExit(f"{' '.join(cmd[2:4])} failed ({proc.returncode}):\n{''.join(out)[-3000:]}")
    return {"wall_s": seconds, "driver_mb": driver, "workers_mb": workers}


def stage_commands(n: int, work: Path, tiny: str, steps: int) -> dict[str, list[str]]:
    tl = [sys.executable, "-m", "torchloom"]
    csv_path, run = work / f"text-{n}.csv", work / f"run-{n}"
    common = ["--output.dir", str(run), "--tracking.enabled", "false", "--model.path", tiny]
    return {
        "prepare": [*tl, "prepare", "--data.path", str(csv_path), "--data.label_column", "topic", *common],
        "train": [*tl, "train", *common, "--train.max_steps", str(steps)],
        "export": [*tl, "export", *common],
        "evaluate": [*tl, "evaluate", *common],
        "predict": [*tl, "predict", str(run / "model"), "--input", str(csv_path), "--output",
                    str(work / f"predicted-{n}"), "--score-with", "spark"],
        "monitor": [*tl, "monitor", "--model", str(run / "model"), "--input", str(csv_path), "--output",
                    str(work / f"monitor-{n}"), "--read-with", "spark", "--labels", "topic"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1000000,10000000")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--workdir", help="where the data goes (default: a temporary directory, removed after)")
    p.add_argument("--no-write", action="store_true")
    a = p.parse_args()
    work = Path(a.workdir) if a.workdir else Path(tempfile.mkdtemp(prefix="torchloom-rehearsal-"))
    work.mkdir(parents=True, exist_ok=True)
    from torchloom.model.tiny import write_tiny_model

    tiny = str(write_tiny_model(work / "tiny"))
    started_at, results = datetime.now(UTC), []
    try:
        for n in (int(s) for s in a.sizes.split(",")):
            scale.make_csv(work / f"text-{n}.csv", n, label_column="topic")  # predict adds a label column
            r = {"rows": n}
            for stage, cmd in stage_commands(n, work, tiny, a.steps).items():
                r[stage] = watched(cmd)
                s = r[stage]
                if stage == "prepare":  # prepare fits the baseline too: its part, as baseline.json times it
                    run = work / f"run-{n}"
                    s["etl_s"] = json.loads((run / "data" / "manifest.json").read_text())["timings"]["total"]
                    s["baseline_s"] = (json.loads((run / "baseline.json").read_text()).get("seconds", 0.0)
                                       if (run / "baseline.json").is_file() else 0.0)
                print(f"{n:>11,} rows: {stage} {s['wall_s']:.0f} s, {n / s['wall_s']:,.0f} rows/s, peak driver"
                      f" {s['driver_mb']:.0f} MB, workers {s['workers_mb']:.0f} MB", flush=True)
            results.append(r)
            for leftover in (f"text-{n}.csv", f"run-{n}", f"predicted-{n}", f"monitor-{n}"):
                path = work / leftover
                path.unlink() if path.is_file() else shutil.rmtree(path, ignore_errors=True)
    finally:
        if not a.workdir:
            shutil.rmtree(work, ignore_errors=True)
    text = report(results, started_at, a.steps)
    print("\n" + text)
    if not a.no_write:
        scale.write_section(text, SECTION)


def report(results: list[dict], started_at: datetime, steps: int) -> str:
    lines = [f"Measured {started_at:%Y-%m-%d %H:%M} UTC with `benchmarks/rehearsal.py` on {cpu_name()},"
             f" {os.cpu_count()} cores, no GPU; Spark local[*], the tiny random BERT, {steps} training steps, every"
             " other setting default. Each stage is its own command, timed from its start (a Spark stage's includes"
             " its session's start). µs/row: wall time over the input's rows.", "",
             "| rows | stage | wall s | µs/row | peak driver MB | peak workers MB |", "|---:|---|---:|---:|---:|---:|"]
    for r in results:
        for stage in STAGES:
            s = r[stage]
            lines.append(f"| {r['rows']:,} | {stage} | {s['wall_s']:.0f} | {1e6 * s['wall_s'] / r['rows']:.1f} |"
                         f" {s['driver_mb']:.0f} | {s['workers_mb']:.0f} |")
            if stage == "prepare":
                for part, key in (("of it, the ETL (manifest timings)", "etl_s"),
                                  ("of it, the baseline (baseline.json)", "baseline_s")):
                    lines.append(f"| {r['rows']:,} | {part} | {s[key]:.0f} | {1e6 * s[key] / r['rows']:.1f} | | |")
        p = r["prepare"]
        around = p["baseline_s"] + sum(r[s]["wall_s"] for s in STAGES if s not in ("prepare", "train"))
        lines.append(f"| {r['rows']:,} | around training (the baseline, export, evaluate, predict, monitor), against"
                     f" prepare's ETL | {around:.0f} | {around / max(p['etl_s'], 1e-9):.2f}x | | |")
    if len(results) > 1:
        first, last = results[0], results[-1]
        lines += ["", f"From {first['rows']:,} to {last['rows']:,} rows (x{last['rows'] / first['rows']:g}):", "",
                  "| stage | µs/row, ratio | peak driver, ratio | peak workers, ratio |", "|---|---:|---:|---:|"]
        for stage in STAGES:
            a, b = first[stage], last[stage]
            per = (b["wall_s"] / last["rows"]) / (a["wall_s"] / first["rows"])
            lines.append(f"| {stage} | {per:.2f} | {b['driver_mb'] / max(a['driver_mb'], 1):.2f} |"
                         f" {b['workers_mb'] / max(a['workers_mb'], 1):.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
