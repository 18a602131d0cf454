"""Writing and resuming a BERT-base-size checkpoint: hash-while-writing and resolve-once against the old way.

    .venv/bin/python benchmarks/checkpoint_io.py [--ranks 2] [--rounds 3] [--dir /tmp/ckpt-bench]

A randomly initialised BERT-base classifier (110 M parameters) with AdamW's state after one step: a
checkpoint of ~1.3 GB (weights 0.44 GB, optimizer 0.88 GB). Same process, same checkpoint contents, sides
alternating, each timed from the same clock:
  save    old: write the files, then read them all back to hash them for meta.json (torchloom before
               issue 30); new: train/checkpoint.save, hashing each file as it is written.
  resume  old: every rank checks every file's hash on its own (`--ranks` processes at once, as the ranks of
               one host do); new: rank 0 checks once and hands the path to the others (loop._resolve_once),
               so the others wait for one check. Bytes read are counted, and extrapolated to 64 ranks.
The page cache is dropped before each resume when this runs as root (echo 3 > /proc/sys/vm/drop_caches), so
reads come from the disk as on a fresh host; otherwise both sides read from memory and the table says so.
"""

import argparse
import multiprocessing as mp
import os
import shutil
import statistics
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from torchloom.jsonio import sha256_file
from torchloom.machine import cpu
from torchloom.train import checkpoint
from torchloom.train.distributed import Dist


def build():
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(num_labels=5))  # bert-base: 12 layers, hidden 768
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    model(input_ids=torch.randint(0, 1000, (2, 16)), labels=torch.tensor([0, 1])).loss.backward()
    optimizer.step()
    return model, optimizer


def save_old(root: Path, step: int, model, optimizer, trainer_state: dict) -> Path:
    """The write as it was: files by path, then every file read back for its sha256."""
    final = root / f"step-{step}"
    final.mkdir(parents=True)
    torch.save(checkpoint.rng_state(), final / "rng-rank0.pt")
    save_file(checkpoint.model_state(model), str(final / "model.safetensors"), metadata={"format": "pt"})
    torch.save(optimizer.state_dict(), final / "optimizer.pt")
    torch.save(trainer_state, final / "trainer.pt")
    files = {p.name: {"size": p.stat().st_size, "sha256": sha256_file(p)} for p in sorted(final.iterdir())}
    (final / checkpoint.META).write_text(__import__("json").dumps({"step": step, "files": files}))
    return final


def drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def _check(path: str, start: float, out) -> None:
    while time.perf_counter() < start:
        time.sleep(0.001)
    out.put(checkpoint.damage(path))


def resume_check(path: Path, checkers: int) -> float:
    """Seconds from one moment until `checkers` processes have each verified the checkpoint."""
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    start = time.perf_counter() + 0.5
    procs = [ctx.Process(target=_check, args=(str(path), start, out)) for _ in range(checkers)]
    for p in procs:
        p.start()
    results = [out.get() for _ in procs]
    elapsed = time.perf_counter() - start
    for p in procs:
        p.join()
    assert results == [None] * checkers, results
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/torchloom-ckpt-bench")
    a = ap.parse_args()
    root = Path(a.dir)
    shutil.rmtree(root, ignore_errors=True)
    model, optimizer = build()
    d = Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), owns_group=False)
    trainer_state = {"step": 1}
    times: dict[str, list[float]] = {"save old": [], "save new": [], "resume old": [], "resume new": []}
    cold = True
    for r in range(a.rounds):
        for side in ("old", "new"):
            step = 2 * r + (side == "new")
            started = time.perf_counter()
            if side == "old":
                path = save_old(root / side, step, model, optimizer, trainer_state)
            else:
                path = checkpoint.save(d, root / side, step, model=model, optimizer=optimizer,
                                       trainer_state=trainer_state, meta={}, keep_last=1, keep=set())
            times[f"save {side}"].append(time.perf_counter() - started)
            cold = drop_caches() and cold
            times[f"resume {side}"].append(resume_check(path, a.ranks if side == "old" else 1))
            size = sum(f.stat().st_size for f in path.iterdir())
            shutil.rmtree(path)
    c = cpu()
    gb = size / 1e9
    print(f"BERT-base classifier + AdamW state: {gb:.2f} GB checkpoint; {a.ranks} ranks; {c.model}, {c.cores} cores;"
          f" median of {a.rounds} rounds; resume reads {'from disk (page cache dropped)' if cold else 'cached'}")
    print("| phase | old s | new s | new / old | GB read old | GB read new | at 64 ranks: old GB, new GB |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    so, sn = statistics.median(times["save old"]), statistics.median(times["save new"])
    ro, rn = statistics.median(times["resume old"]), statistics.median(times["resume new"])
    print(f"| save (write + hashes) | {so:.2f} | {sn:.2f} | {sn / so:.2f} | {gb:.2f} | 0 | - |")
    print(f"| resume check | {ro:.2f} | {rn:.2f} | {rn / ro:.2f} | {gb * a.ranks:.2f} | {gb:.2f} |"
          f" {gb * 64:.0f}, {gb:.2f} |")
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
