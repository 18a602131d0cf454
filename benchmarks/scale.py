"""Scale: prepare and one loader epoch at 100 thousand, 1 million and 10 million rows, in one run.

    .venv/bin/python benchmarks/scale.py [--sizes 100000,1000000,10000000] [--prepare-up-to 10000000]
                                         [--workdir DIR] [--no-write]

For each size N, one after the other on this machine:
1. prepare (sizes <= --prepare-up-to): N rows of labelled text generated in chunks of a million
   (5 labels, 4-64 words each, lengths uniform, from a 2,000-word vocabulary; vectorised, no Python
   loop per row) into one CSV, then `torchloom prepare` (local[*], the embedded MiniLM tokenizer,
   max_length 128, every other setting default) in a subprocess. Measured: wall time, rows/s, and the
   peak resident memory of the driver (the Python process) and of Spark (the JVM, which in local mode
   holds the executors, and its Python workers together), sampled from /proc every 0.2 s.
2. loader: the same N rows as a prepared split (token ids from the synthetic generator of
   torchloom.data.synthetic, 4-128 tokens, row groups of 1024 rows and shards of a million rows, as
   prepare writes them), then one epoch of rank 0 of 2 through ShardedLoader (global batch 16,
   micro-batch 8, shuffle on, shuffle_buffer 4096), in a fresh subprocess. Measured: rows/s and the
   rank's peak resident memory (VmHWM). Generated rather than prepared so every size has the same
   length distribution and 10 M rows do not need the prepare step.

Prints a table and the growth from 1 M to 10 M rows (rows/s ratio and peak-memory ratio), and writes
them to docs/benchmarks.md under '## Scale' (replacing only that section).
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

ROOT = Path(__file__).resolve().parent.parent
CHUNK = 1_000_000
LABELS = ["alpha", "beta", "gamma", "delta", "epsilon"]


def make_csv(path: Path, rows: int, seed: int = 0, label_column: str = "label") -> None:
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.csv as pacsv

    vocab = pa.array([f"{a}{b}{c}" for a in ("re", "un", "pre", "de", "in", "ex", "co", "sub", "pro", "dis")
                      for b in ("port", "form", "struct", "ject", "tract", "dict", "spect", "duce", "mit", "press")
                      for c in ("", "s", "ed", "ing", "ion", "or", "ive", "al", "ly", "er", "ment", "ure", "ant",
                                "ent", "ism", "ist", "ize", "ful", "less", "ness")])
    writer = None
    for first in range(0, rows, CHUNK):
        n = min(CHUNK, rows - first)
        rng = np.random.default_rng([seed, first])
        label = rng.integers(0, len(LABELS), n)
        length = rng.integers(4, 65, n)
        offsets = np.zeros(n + 1, np.int64)
        np.cumsum(length, out=offsets[1:])
        # words lean towards a band of the vocabulary per label, so the labels can be learnt
        band = len(vocab) // len(LABELS)
        row = np.repeat(np.arange(n), length)
        words = np.where(rng.random(int(offsets[-1])) < 0.3, label[row] * band + rng.integers(0, band, row.size),
                         rng.integers(0, len(vocab), row.size))
        text = pc.binary_join(pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)),
                                                       vocab.take(pa.array(words))), " ")
        # a unique tail per row: prepare removes duplicate texts, and none of these should go
        text = pc.binary_join_element_wise(text, pa.array(np.char.mod("%d.", np.arange(first, first + n))), " ")
        table = pa.table({"text": text, label_column: pa.array(LABELS).take(pa.array(label))})
        if writer is None:
            writer = pacsv.CSVWriter(str(path), table.schema)
        writer.write_table(table)
    writer.close()


def write_prepared(out: Path, rows: int) -> None:
    """A prepared train split of `rows` rows, a million-row shard at a time (bounded memory)."""
    import hashlib

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from torchloom.data.synthetic import _split_table
    from torchloom.manifest import Manifest, Shard, Split

    (out / "train").mkdir(parents=True)
    labels = [f"label_{k}" for k in range(5)]
    words = pa.array([f"w{i}" for i in range(30522)])
    shards, counts = [], np.zeros(5, np.int64)
    for number, first in enumerate(range(0, rows, CHUNK)):
        n = min(CHUNK, rows - first)
        table = _split_table(np.random.default_rng([0, first]), n, labels, words, 4, 128, 30522)
        rel = f"train/part-{number:05d}.parquet"
        pq.write_table(table, out / rel, row_group_size=1024)
        meta = pq.read_metadata(out / rel)
        groups = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
        shards.append(Shard(path=rel, rows=n, row_groups=groups))
        counts += np.bincount(table.column("label_id").to_numpy(), minlength=5)
        del table
    Manifest(
        labels=labels, splits={"train": Split(rows=rows, shards=shards, per_class=dict(zip(labels, counts.tolist())))},
        tokenizer={"path": "", "hash": "synthetic", "max_length": 128, "vocab_size": 30522},
        fingerprint=hashlib.sha256(f"scale-{rows}".encode()).hexdigest()[:16],
        inputs={"synthetic": {"rows": rows}}, counts={"rows_read": rows, "rows_rejected": {}, "duplicates_removed": 0},
    ).write(out)


LOADER_CHILD = """
import json, sys, time
from torchloom.data import ShardedLoader
from torchloom.manifest import read
m = read(sys.argv[1])
loader = ShardedLoader(m, "train", rank=0, world_size=2, batch_size=8, global_batch=16, seed=0)
started = time.perf_counter()
rows = 0
for b in loader:
    rows += int((b["index"] >= 0).sum())
seconds = time.perf_counter() - started
hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM"))
print(json.dumps({"rows": rows, "seconds": seconds, "peak_rss_mb": hwm / 1024}))
"""


def rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def descendants(pid: int) -> list[int]:
    children = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(d))
            except (OSError, ValueError, IndexError):
                continue
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for c in children.get(p, []):
            out.append(c)
            todo.append(c)
    return out


def run_prepare(csv_path: Path, run: Path) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "torchloom", "prepare", "--data.path", str(csv_path), "--output.dir", str(run),
           "--tracking.enabled", "false"]
    peaks = {"driver": 0.0, "jvm": 0.0, "total": 0.0}
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True)
    reader.start()
    while proc.poll() is None:
        driver = rss_mb(proc.pid)
        jvm = sum(rss_mb(p) for p in descendants(proc.pid))
        peaks = {"driver": max(peaks["driver"], driver), "jvm": max(peaks["jvm"], jvm),
                 "total": max(peaks["total"], driver + jvm)}
        time.sleep(0.2)
    seconds = time.perf_counter() - started
    reader.join(5)
    if proc.returncode:
        raise SystemExit(f"prepare failed ({proc.returncode}):\n{''.join(out)[-3000:]}")
    manifest = json.loads((run / "data" / "manifest.json").read_text())
    kept = sum(s["rows"] for s in manifest["splits"].values())
    return {"seconds": seconds, "rows_kept": kept, **{f"{k}_mb": v for k, v in peaks.items()}}


def run_loader(data: Path) -> dict:
    proc = subprocess.run([sys.executable, "-c", LOADER_CHILD, str(data)], capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"loader failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="100000,1000000,10000000")
    p.add_argument("--prepare-up-to", type=int, default=10_000_000, help="run prepare only at sizes up to this")
    p.add_argument("--workdir", help="where the data goes (default: a temporary directory, removed after)")
    p.add_argument("--no-write", action="store_true")
    a = p.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")]
    work = Path(a.workdir) if a.workdir else Path(tempfile.mkdtemp(prefix="torchloom-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    started_at = datetime.now(UTC)
    results = []
    try:
        for n in sizes:
            r = {"rows": n}
            if n <= a.prepare_up_to:
                csv_path = work / f"text-{n}.csv"
                t = time.perf_counter()
                make_csv(csv_path, n)
                print(f"{n:>11,} rows: text generated in {time.perf_counter() - t:.0f} s", flush=True)
                r["prepare"] = run_prepare(csv_path, work / f"run-{n}")
                pr = r["prepare"]
                print(f"{n:>11,} rows: prepare {pr['seconds']:.0f} s, {n / pr['seconds']:,.0f} rows/s, peak driver"
                      f" {pr['driver_mb']:.0f} MB, Spark {pr['jvm_mb']:.0f} MB", flush=True)
                csv_path.unlink()
                shutil.rmtree(work / f"run-{n}", ignore_errors=True)
            data = work / f"loader-{n}"
            write_prepared(data, n)
            r["loader"] = run_loader(data)
            lr = r["loader"]
            print(f"{n:>11,} rows: loader rank 0 of 2: {lr['rows']:,} rows in {lr['seconds']:.1f} s,"
                  f" {lr['rows'] / lr['seconds']:,.0f} rows/s, peak {lr['peak_rss_mb']:.0f} MB", flush=True)
            shutil.rmtree(data, ignore_errors=True)
            results.append(r)
    finally:
        if not a.workdir:
            shutil.rmtree(work, ignore_errors=True)
    text = report(results, started_at)
    print("\n" + text)
    if not a.no_write:
        write_section(text)


def report(results: list[dict], started_at: datetime) -> str:
    import torch

    lines = [f"Measured {started_at:%Y-%m-%d %H:%M} UTC with `benchmarks/scale.py` on {os.cpu_count()} cores"
             f" ({platform.machine()}), no GPU, torch {torch.__version__}, Python {platform.python_version()}."
             " prepare: local[*], MiniLM tokenizer, max_length 128, generated text of 4-64 words; loader: rank 0"
             " of 2, global batch 16, micro-batch 8, shuffle_buffer 4096, one epoch, generated token ids of 4-128"
             " tokens.", "",
             "| rows | prepare s | prepare rows/s | driver peak MB | Spark peak MB | loader rows/s (rank 0) |"
             " loader peak MB |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        pr, lr = r.get("prepare"), r["loader"]
        prep = (f"{pr['seconds']:.0f} | {r['rows'] / pr['seconds']:,.0f} | {pr['driver_mb']:.0f} | {pr['jvm_mb']:.0f}"
                if pr else "- | - | - | -")
        lines.append(f"| {r['rows']:,} | {prep} | {lr['rows'] / lr['seconds']:,.0f} | {lr['peak_rss_mb']:.0f} |")
    by = {r["rows"]: r for r in results}
    lines.append("")
    if 1_000_000 in by and 10_000_000 in by:
        a, b = by[1_000_000], by[10_000_000]
        rate = lambda r: r["loader"]["rows"] / r["loader"]["seconds"]  # noqa: E731
        lines.append(f"Loader, 1 M -> 10 M rows: rows/s x{rate(b) / rate(a):.2f} (target within 20 %), peak memory"
                     f" x{b['loader']['peak_rss_mb'] / a['loader']['peak_rss_mb']:.2f} (target <= 1.2).")
        if a.get("prepare") and b.get("prepare"):
            pa_, pb = a["prepare"], b["prepare"]
            lines.append(f"Prepare, 1 M -> 10 M rows: rows/s x{(10 * pa_['seconds']) / pb['seconds']:.2f}, driver"
                         f" peak x{pb['driver_mb'] / pa_['driver_mb']:.2f},"
                         f" Spark peak x{pb['jvm_mb'] / pa_['jvm_mb']:.2f}.")
    return "\n".join(lines)


def write_section(text: str, title: str = "## Scale") -> None:
    """docs/benchmarks.md's section `title` replaced by text (only it), or added at the end."""
    path = ROOT / "docs" / "benchmarks.md"
    doc = path.read_text()
    section = f"{title}\n\n{text}\n"
    if f"{title}\n" in doc:
        doc = re.sub(rf"{re.escape(title)}\n.*?(?=\n## |\Z)", lambda _: section, doc, count=1, flags=re.S)
    else:
        doc = doc.rstrip("\n") + "\n\n" + section
    path.write_text(doc)
    print(f"written to {path}")

if __name__ == "__main__":
    main()
