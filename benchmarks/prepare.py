"""`torchloom prepare` against the raw `tokenizers` batch encoder writing the same Parquet.

    .venv/bin/python benchmarks/prepare.py [--rows 200000]

Generates a CSV of --rows labelled rows (20-80 words each), then measures in one sitting:
  - two baselines: one Python process reading the CSV with pyarrow, encoding with the model's fast
    tokenizer (Rust threads on all cores), writing Parquet: with `encode_batch_fast` (ids without
    character offsets, what torchloom calls; the baseline) and with the classic `encode_batch`;
  - torchloom prepare on local[*] (Spark start-up timed apart), whole and its split+tokenize+write job.
Prints a table with rows/s and ratios against both.
"""

from __future__ import annotations

import argparse
import csv
import os
import random
import tempfile
import time
from pathlib import Path


def make_csv(path: Path, rows: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    words = [f"{a}{b}" for a in ("re", "un", "pre", "de", "in", "ex", "co", "sub") for b in (
        "port", "form", "struct", "ject", "tract", "dict", "spect", "duce", "mit", "press", "vert", "pose")]
    labels = ["alpha", "beta", "gamma", "delta", "epsilon"]
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["text", "label"])
        for i in range(rows):
            n = rng.randint(20, 80)
            w.writerow([" ".join(rng.choice(words) for _ in range(n)) + f" {i}.", labels[i % 5]])


def baseline(csv_path: Path, out: Path, tokenizer_json: str, max_length: int, fast: bool) -> float:
    import pyarrow as pa
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer

    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    started = time.perf_counter()
    table = pacsv.read_csv(csv_path)
    tok = Tokenizer.from_str(tokenizer_json)
    tok.enable_truncation(max_length)
    tok.no_padding()
    texts = table.column("text").to_pylist()
    writer = None
    for i in range(0, len(texts), 10_000):
        # encode_batch_fast skips character offsets (torchloom uses it); encode_batch is the classic call
        enc = (tok.encode_batch_fast if fast else tok.encode_batch)(texts[i:i + 10_000])
        ids = [e.ids for e in enc]
        chunk = pa.table({"text": texts[i:i + 10_000], "label": table.column("label").slice(i, 10_000),
                          "input_ids": pa.array(ids, pa.list_(pa.int32())),
                          "length": pa.array([len(x) for x in ids], pa.int32())})
        writer = writer or pq.ParquetWriter(out, chunk.schema)
        writer.write_table(chunk, row_group_size=1024)
    writer.close()
    return time.perf_counter() - started


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=200_000)
    a = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from torchloom.config import build
    from torchloom.embedded import demo_model_path
    from torchloom.etl.prepare import prepare
    from torchloom.etl.session import get_spark

    work = Path(tempfile.mkdtemp(prefix="torchloom-bench-prepare-"))
    csv_path = work / "rows.csv"
    make_csv(csv_path, a.rows)
    tokenizer_json = (Path(demo_model_path()) / "tokenizer.json").read_text()
    classic_s = baseline(csv_path, work / "classic.parquet", tokenizer_json, 128, fast=False)
    base_s = baseline(csv_path, work / "baseline.parquet", tokenizer_json, 128, fast=True)

    cfg = build(None, ["--data.path", str(csv_path), "--output.dir", str(work / "run")])
    started = time.perf_counter()
    spark = get_spark(cfg.prepare)
    spark.range(1).count()  # the session really up
    spark_s = time.perf_counter() - started
    manifest = prepare(cfg, str(work / "run" / "data"), spark=spark)
    t = manifest.timings
    rows = manifest.counts["rows_read"]
    print(f"\n{a.rows:,} generated rows (20-80 words), MiniLM tokenizer, max_length 128, {os.cpu_count()} cores")
    print(f"{'what':50} {'seconds':>8} {'rows/s':>9} {'x baseline':>11} {'x classic':>10}")
    print(f"{'tokenizers encode_batch_fast + Parquet (baseline)':50} {base_s:8.1f} {a.rows / base_s:9,.0f} {1:11.2f}"
          f" {classic_s / base_s:10.2f}")
    print(f"{'tokenizers encode_batch + Parquet (classic)':50} {classic_s:8.1f} {a.rows / classic_s:9,.0f}"
          f" {base_s / classic_s:11.2f} {1:10.2f}")
    print(f"{'torchloom prepare, whole':50} {t['total']:8.1f} {rows / t['total']:9,.0f}"
          f" {base_s / t['total']:11.2f} {classic_s / t['total']:10.2f}")
    tok_s = t["tokenize_write"]
    print(f"{'torchloom prepare, split+tokenize+write':50} {tok_s:8.1f} {rows / tok_s:9,.0f} {base_s / tok_s:11.2f}"
          f" {classic_s / tok_s:10.2f}")
    print(f"{'  of which read+clean+dedup+counts':50} {t['read_clean_dedup']:8.1f}")
    print(f"{'  of which rejected rows written':50} {t['write_rejected']:8.1f}")
    print(f"{'Spark session start-up (apart)':50} {spark_s:8.1f}")
    spark.stop()


if __name__ == "__main__":
    main()
