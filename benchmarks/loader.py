"""Throughput of the data loader alone (no model): rows/s and batches/s per rank.

    .venv/bin/python benchmarks/loader.py [--rows 200000] [--batch-size 8] [--world-size 2]

Writes a synthetic prepared split (max_len 128) to a temporary directory, then iterates one epoch
of each rank in turn in this process, as a DDP rank would.
"""

from __future__ import annotations

import argparse
import tempfile
import time

from torchloom.data import ShardedLoader, eval_batches
from torchloom.data.synthetic import write_synthetic_dataset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        manifest = write_synthetic_dataset(tmp, rows={"train": args.rows}, max_len=128, vocab_size=30522,
                                           rows_per_group=2048, rows_per_shard=50_000)
        print(f"wrote {args.rows} rows in {time.perf_counter() - started:.1f}s;"
              f" batch_size {args.batch_size}, {args.world_size} ranks run one after another\n")
        cases = {
            "shuffle": {},
            "shuffle + length_bucketing": {"length_bucketing": True},
            "no shuffle": {"shuffle": False},
        }
        print(f"{'loader':<28} {'rank':>4} {'rows':>8} {'batches':>8} {'seconds':>8} {'rows/s':>10} {'batches/s':>10}")
        for name, kw in cases.items():
            for rank in range(args.world_size):
                loader = ShardedLoader(manifest, "train", rank=rank, world_size=args.world_size,
                                       batch_size=args.batch_size, seed=0, **kw)
                row(name, rank, loader)
        for rank in range(args.world_size):
            row("eval_batches", rank, eval_batches(manifest, "train", rank, args.world_size, args.batch_size))


def row(name: str, rank: int, batches) -> None:
    started = time.perf_counter()
    rows = count = 0
    for batch in batches:
        rows += len(batch["labels"])
        count += 1
    seconds = time.perf_counter() - started
    print(f"{name:<28} {rank:>4} {rows:>8} {count:>8} {seconds:>8.2f} {rows / seconds:>10,.0f}"
          f" {count / seconds:>10,.0f}")


if __name__ == "__main__":
    main()
