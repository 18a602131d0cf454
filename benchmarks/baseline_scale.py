"""The baseline at scale: what the Spark baseline costs against prepare, and how close it is to scikit-learn.

    .venv/bin/python benchmarks/baseline_scale.py [--sizes 100000,300000] [--driver-up-to 300000]
                                                  [--vocab-texts N] [--workdir DIR] [--no-write]

For each size N, one after the other on this machine, from the same moment each:
1. N rows of generated text (benchmarks/scale.make_csv: 5 labels, 4-64 words) and `torchloom prepare` with every
   default but `--eval.baseline false` (a subprocess): prepare's own time, the reference;
2. the Spark baseline on the prepared rows (baseline.fit_and_score, engine spark, local[*], a subprocess): C chosen
   on a sample of GRID_TEXTS train and GRID_VAL_TEXTS val texts past them, then one MLlib fit on every train text;
2b. with --vocab-texts N, the Spark baseline again with its vocabulary and idf counted on N train texts (VOCAB_TEXTS,
   1,000,000 by default, set lower to see at a size this machine can run what counting on a sample costs and keeps);
3. the driver's scikit-learn baseline on the same rows (engine driver, the whole grid on every train text, a
   subprocess), at sizes up to --driver-up-to.
Each: wall seconds, its ratio to prepare's, the peak resident memory of the process and its children (sampled
every 0.2 s), the chosen C, and the val and test accuracy. Prints one table with the machine and the date, and
writes it to docs/benchmarks.md under '## The baseline at scale' (replacing only that section, the prose under
its table too: keep that in the commit that records a new run).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import scale  # noqa: E402  (benchmarks/scale.py: the generated text, the memory sampling)

ROOT = Path(__file__).resolve().parent.parent
SECTION = "## The baseline at scale"

CHILD = r"""
import json, sys, time
from torchloom import baseline
from torchloom.manifest import read
m, engine = read(sys.argv[1]), sys.argv[2]
if len(sys.argv) > 3:
    from torchloom.baseline import spark as baseline_spark
    baseline_spark.VOCAB_TEXTS = int(sys.argv[3])
spark = None
if engine == "spark":
    from torchloom.config.schema import PrepareConfig
    from torchloom.etl.session import get_spark
    spark = get_spark(PrepareConfig())
    spark.sparkContext.setLogLevel("ERROR")
started = time.perf_counter()
r = baseline.fit_and_score(spark, m, ["val", "test"], engine=engine)
seconds = time.perf_counter() - started
print(json.dumps({"seconds": seconds, "C": r["C"], "C_from": r["C_from"], "features": r["num_features"],
                  "vocabulary_texts": r.get("vocabulary_texts", r["train_rows"]),
                  "val": r["splits"]["val"]["accuracy"], "test": r["splits"]["test"]["accuracy"]}))
"""


def watched(cmd: list[str]) -> tuple[float, float, str]:
    """Run cmd; (wall seconds, peak MB of it and its descendants together, its output)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    started, peak = time.perf_counter(), 0.0
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True)
    reader.start()
    while proc.poll() is None:
        peak = max(peak, scale.rss_mb(proc.pid) + sum(scale.rss_mb(p) for p in scale.descendants(proc.pid)))
        time.sleep(0.2)
    seconds = time.perf_counter() - started
    reader.join(5)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd[:4])} failed ({proc.returncode}):\n{''.join(out)[-3000:]}")
    return seconds, peak, "".join(out)


def baseline_run(data: Path, engine: str, vocab_texts: int = 0) -> dict:
    seconds, peak, out = watched([sys.executable, "-c", CHILD, str(data), engine,
                                  *([str(vocab_texts)] if vocab_texts else [])])
    result = json.loads(next(line for line in reversed(out.splitlines()) if line.startswith("{")))
    return {**result, "wall_s": seconds, "peak_mb": peak}


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return re.search(r"Model name:\s*(.+)", out).group(1).strip()
    except Exception:
        return platform.processor() or platform.machine()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="100000,300000")
    p.add_argument("--driver-up-to", type=int, default=300_000)
    p.add_argument("--vocab-texts", type=int, default=0,
                   help="also the Spark baseline with its vocabulary counted on this many train texts (VOCAB_TEXTS)")
    p.add_argument("--workdir", help="where the data goes (default: a temporary directory, removed after)")
    p.add_argument("--no-write", action="store_true")
    a = p.parse_args()
    work = Path(a.workdir) if a.workdir else Path(tempfile.mkdtemp(prefix="torchloom-baseline-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    started_at, results = datetime.now(UTC), []
    try:
        for n in (int(s) for s in a.sizes.split(",")):
            csv_path, run = work / f"text-{n}.csv", work / f"run-{n}"
            scale.make_csv(csv_path, n)
            shutil.rmtree(run, ignore_errors=True)
            seconds, peak, _ = watched([sys.executable, "-m", "torchloom", "prepare", "--data.path", str(csv_path),
                                        "--output.dir", str(run), "--eval.baseline", "false",
                                        "--tracking.enabled", "false"])
            r = {"rows": n, "prepare": {"wall_s": seconds, "peak_mb": peak}}
            print(f"{n:>9,} rows: prepare {seconds:.0f} s", flush=True)
            for engine in ("spark", "spark-vocab", "driver"):
                if (engine == "driver" and n > a.driver_up_to) or (engine == "spark-vocab" and not a.vocab_texts):
                    continue
                r[engine] = baseline_run(run / "data", engine.split("-")[0], a.vocab_texts * (engine != "spark"))
                print(f"{n:>9,} rows: {engine} baseline {r[engine]['wall_s']:.0f} s, C={r[engine]['C']:g},"
                      f" test {r[engine]['test']:.4f}", flush=True)
            results.append(r)
            csv_path.unlink()
            shutil.rmtree(run, ignore_errors=True)
    finally:
        if not a.workdir:
            shutil.rmtree(work, ignore_errors=True)
    text = report(results, started_at)
    print("\n" + text)
    if not a.no_write:
        scale.write_section(text, SECTION)


def report(results: list[dict], started_at: datetime) -> str:
    lines = [f"Measured {started_at:%Y-%m-%d %H:%M} UTC with `benchmarks/baseline_scale.py` on {cpu_name()},"
             f" {os.cpu_count()} cores, no GPU; Spark local[*]. Generated text (benchmarks/scale.make_csv), the"
             " default split (val and test 10 %). Seconds are each process's wall time from its start (a Spark"
             " baseline's includes its session's start), x prepare the ratio to prepare's in the same run.", "",
             "| rows | what | wall s | x prepare | peak MB | C (chosen on) | val accuracy | test accuracy |",
             "|---:|---|---:|---:|---:|---|---:|---:|"]
    for r in results:
        ref = r["prepare"]["wall_s"]
        lines.append(f"| {r['rows']:,} | prepare (the reference) | {ref:.0f} | 1.00 | {r['prepare']['peak_mb']:.0f}"
                     " | | | |")
        for engine, name in (("spark", "Spark baseline"), ("spark-vocab", "Spark baseline, vocabulary counted on"),
                             ("driver", "scikit-learn on the driver")):
            if engine in r:
                e = r[engine]
                name += f" {e['vocabulary_texts']:,} train texts" if engine == "spark-vocab" else ""
                lines.append(f"| {r['rows']:,} | {name} | {e['wall_s']:.0f} | {e['wall_s'] / ref:.2f} |"
                             f" {e['peak_mb']:.0f} | {e['C']:g} ({e['C_from']}) | {e['val']:.4f} | {e['test']:.4f} |")
        if "driver" in r:
            lines.append(f"| {r['rows']:,} | Spark - scikit-learn, test accuracy | | | | | |"
                         f" {100 * (r['spark']['test'] - r['driver']['test']):+.2f} pt |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
