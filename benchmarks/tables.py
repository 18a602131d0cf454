"""prepare's rows/s from a Delta table against the same rows as plain Parquet files.

    .venv/bin/python benchmarks/tables.py [--rows 200000] [--rounds 2]

Writes --rows labelled rows (20-80 words each) as a Delta table with deltalake, then copies the table's data files
(the same bytes) into a plain directory. In one Spark session (local[*], its start-up apart), in interleaved rounds,
prepares each: the plain directory with Spark's own Parquet reader, the table through inputs/tables.py (pinned on the
driver, the version's files read by the tasks with pyarrow). Prints the best round of each, whole and its
read+clean+dedup job (where the readers differ), rows/s and the ratio Delta / Parquet (target >= 0.9), and the CPU.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import tempfile
from pathlib import Path


def cpu_model() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "?")


def make_rows(rows: int, seed: int = 0):
    import pyarrow as pa

    rng = random.Random(seed)
    words = [f"{a}{b}" for a in ("re", "un", "pre", "de", "in", "ex", "co", "sub") for b in (
        "port", "form", "struct", "ject", "tract", "dict", "spect", "duce", "mit", "press", "vert", "pose")]
    labels = ["alpha", "beta", "gamma", "delta", "epsilon"]
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(20, 80))) + f" {i}." for i in range(rows)]
    return pa.table({"text": texts, "label": [labels[i % 5] for i in range(rows)]})


def write_inputs(work: Path, rows: int) -> tuple[Path, Path]:
    """The Delta table, and a directory of the same data files without the log."""
    from deltalake import DeltaTable, WriterProperties, write_deltalake

    table, plain = work / "table", work / "plain"
    # row groups of 64k rows: more than one per core, as a writer of big tables makes them
    write_deltalake(table, make_rows(rows), writer_properties=WriterProperties(max_row_group_size=65536))
    plain.mkdir()
    for uri in DeltaTable(str(table)).file_uris():
        shutil.copy(uri, plain / Path(uri).name)
    return table, plain


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from torchloom.config import build
    from torchloom.etl.prepare import prepare
    from torchloom.etl.session import get_spark

    work = Path(tempfile.mkdtemp(prefix="torchloom-bench-tables-"))
    try:
        table, plain = write_inputs(work, a.rows)
        files = len(list(plain.iterdir()))
        rounds: dict[str, list[dict]] = {"parquet": [], "delta": []}
        spark = None
        for _ in range(a.rounds):
            for name, path in (("parquet", plain), ("delta", table)):
                cfg = build(None, ["--data.path", str(path), "--output.dir", str(work / "run"),
                                   "--output.overwrite", "true"])
                spark = spark or get_spark(cfg.prepare)
                m = prepare(cfg, str(work / "run" / "data"), spark=spark)
                rounds[name].append({"total": m.timings["total"], "read": m.timings["read_clean_dedup"],
                                     "rows": m.counts["rows_read"]})
        report(rounds, a.rows, files)
        if spark is not None:
            spark.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)


def report(rounds: dict[str, list[dict]], rows: int, files: int) -> None:
    """The best round of each input, and the median over rounds of the ratio within a round (Parquet's seconds
    over Delta's: above 1, the table is faster), which a busy machine disturbs less."""
    import statistics

    cpu = cpu_model()
    print(f"\n{rows:,} rows (20-80 words) in {files} data file(s), MiniLM tokenizer, {os.cpu_count()} cores,"
          f" {len(rounds['delta'])} interleaved rounds")
    print(f"{'input':48} {'rows':>8} {'best s':>7} {'rows/s':>9} {'x parquet':>10} {'median x':>9}  cpu")
    for name, what in (("parquet", "Parquet files (Spark's reader)"), ("delta", "Delta table (inputs/tables.py)")):
        for part, label in (("total", "prepare, whole"), ("read", "read+clean+dedup")):
            best = min(r[part] for r in rounds[name])
            ratio = min(r[part] for r in rounds["parquet"]) / best
            median = statistics.median(p[part] / r[part] for p, r in zip(rounds["parquet"], rounds[name]))
            print(f"{what + ': ' + label if part == 'total' else '  ' + label:48} {rounds[name][0]['rows']:8,}"
                  f" {best:7.1f} {rounds[name][0]['rows'] / best:9,.0f} {ratio:10.2f} {median:9.2f}  {cpu}")


if __name__ == "__main__":
    main()
