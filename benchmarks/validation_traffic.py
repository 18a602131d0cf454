"""What validation inside training moves between ranks: the metrics reduced as sums (train/evaluation.py now)
against every rank's logits, labels and indices gathered to every rank (what it did before issue 77), on real gloo
processes on this host, at a val split of --rows rows.

    .venv/bin/python benchmarks/validation_traffic.py [--rows 1000000] [--classes 20] [--world 2] [--no-write]

Each rank holds its contiguous share of the split's logits (random, float32: what the model would give; the forward
is the same on both sides and left out) and runs both sides from one barrier: the reduce (reduced_metrics) first,
then the gather (all_gather_objects, the texts' probabilities, classification_metrics on all rows). Bytes are what
one rank hands to the collectives (its tensors; an object's pickled size), counted by wrapping torch.distributed's
calls; a gather also brings every other rank's share back to each rank. Peak memory is the rank's resident peak
after each side (the reduce runs first, so its peak is not the gather's). The metrics of both sides are compared.
Writes the table to docs/benchmarks.md under '## Validation in training: reduced, not gathered (issue 77)'.
"""

from __future__ import annotations

import argparse
import os
import pickle
import resource
import socket
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

TITLE = "Validation in training: reduced, not gathered (issue 77)"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(rank: int, world: int, port: int, rows: int, classes: int, out) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist

    from torchloom.data.loader import rank_range
    from torchloom.data.texts import to_documents
    from torchloom.manifest import Manifest, Split
    from torchloom.scoring import classification_metrics
    from torchloom.train.distributed import Dist, all_gather_objects
    from torchloom.train.evaluation import reduced_metrics

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    sent = {"n": 0}
    real_reduce, real_gather = dist.all_reduce, dist.all_gather_object

    def all_reduce(t, *args, **kwargs):
        sent["n"] += t.numel() * t.element_size()
        return real_reduce(t, *args, **kwargs)

    def all_gather_object(lst, obj, *args, **kwargs):
        sent["n"] += len(pickle.dumps(obj))
        return real_gather(lst, obj, *args, **kwargs)

    dist.all_reduce, dist.all_gather_object = all_reduce, all_gather_object
    labels = [f"class-{i}" for i in range(classes)]
    m = Manifest(labels=labels, splits={"val": Split(rows=rows, shards=[])}, tokenizer={"truncation": "head"},
                 fingerprint="bench")
    start, count = rank_range(rows, world, rank)
    rng = np.random.default_rng(rank)
    logits = (rng.normal(size=(count, classes)) * 3).astype(np.float32)
    truth = rng.integers(0, classes, count)
    index = np.arange(start, start + count)
    d = Dist(rank, world, rank, torch.device("cpu"), False)
    row = {"rank": rank}
    for side in ("reduce", "gather"):
        dist.barrier()
        sent["n"] = 0
        began = time.perf_counter()
        if side == "reduce":
            metrics = reduced_metrics(d, m, "val", logits, truth, index)
        else:
            parts = all_gather_objects(d, (logits, truth, index))
            probs, got, _ = to_documents(m, "val", *(np.concatenate([p[i] for p in parts]) for i in range(3)))
            metrics = classification_metrics(probs, got, labels)
        row[side] = {"s": time.perf_counter() - began, "sent": sent["n"],
                     "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                     "accuracy": metrics["accuracy"], "macro_f1": metrics["macro_f1"], "loss": metrics["loss"]}
    out.put(row)
    dist.destroy_process_group()


def table(rows: int, classes: int, world: int, ranks: list[dict]) -> str:
    from serve_front import cpu_name

    lines = [f"{rows:,} val rows, {classes} classes, {world} gloo ranks on one host; {cpu_name()};"
             f" {datetime.now(UTC):%Y-%m-%d}.", "",
             "| side | bytes a rank sends (max over ranks) | held by each rank after (all shares) |"
             " seconds (slowest rank) | peak RSS MB (max) | accuracy | macro-F1 | loss |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for side in ("gather", "reduce"):
        sent = max(r[side]["sent"] for r in ranks)
        received = sum(r[side]["sent"] for r in ranks) if side == "gather" else sent
        r0 = ranks[0][side]
        lines.append(f"| {side} | {sent:,} | {received:,} | {max(r[side]['s'] for r in ranks):.3f} |"
                     f" {max(r[side]['peak_mb'] for r in ranks):.0f} | {r0['accuracy']:.6f} | {r0['macro_f1']:.6f} |"
                     f" {r0['loss']:.6f} |")
    g, r = (max(x[s]["sent"] for x in ranks) for s in ("gather", "reduce"))
    gs, rs = (max(x[s]["s"] for x in ranks) for s in ("gather", "reduce"))
    lines += ["", f"reduce / gather: bytes {r / g:.2e}, seconds {rs / gs:.3f}. The ring all-reduce of the"
              " sums moves about twice their size per rank whatever the world; the gather hands every rank's"
              " share to every rank."]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--classes", type=int, default=20)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    a = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, a.world, port, a.rows, a.classes, out)) for r in range(a.world)]
    for proc in procs:
        proc.start()
    ranks = sorted((out.get(timeout=600) for _ in procs), key=lambda r: r["rank"])
    for proc in procs:
        proc.join(60)
    for side in ("accuracy", "macro_f1", "loss"):
        assert abs(ranks[0]["reduce"][side] - ranks[0]["gather"][side]) < 1e-9, (side, ranks[0])
    body = table(a.rows, a.classes, a.world, ranks)
    print(body)
    if not a.no_write:
        from serve import write_doc

        write_doc(body, TITLE)


if __name__ == "__main__":
    main()
