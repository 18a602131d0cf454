"""The reference job the engine tests share: a tiny model, 103 training rows, trained by the local engine.

103 rows, 2 ranks, micro-batch 4: 13 steps per epoch, checkpoints every 5. CPU, fp32, one thread per
rank, so every engine (and every set of hosts) must end at these weights bit for bit.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from torchloom.config import build
from torchloom.data.synthetic import write_synthetic_dataset
from torchloom.engines import local
from torchloom.model.tiny import write_tiny_model
from torchloom.train import checkpoint

COMMON = ["--train.precision", "fp32", "--train.batch_size", "8", "--train.lr", "1e-3", "--engine.workers", "2",
          "--engine.threads_per_worker", "1", "--train.epochs", "1", "--train.checkpoint_every", "5",
          "--train.keep_last", "5", "--engine.device", "cpu"]
LAST = "step-13"


def reference(root: Path) -> dict:
    """{root, model, data, ref}: the tiny model, the prepared data, and the local engine's run on them."""
    model = write_tiny_model(root / "tiny")
    data = root / "data"
    write_synthetic_dataset(data, rows={"train": 103, "val": 21, "test": 19})
    ref = new_run(root, data, "ref")
    local.train(build(None, ["--output.dir", str(ref), "--model.path", model, *COMMON]), ref, quiet=True)
    return {"root": root, "model": model, "data": data, "ref": ref}


def new_run(root: Path, data: Path, name: str) -> Path:
    rd = root / name
    rd.mkdir()
    shutil.copytree(data, rd / "data")
    return rd


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = checkpoint.load_weights(a), checkpoint.load_weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


def traced_rows(rd: Path) -> dict[int, list[int]]:
    """Step -> the row ids of its global batch, ranks in order (train.trace_rows)."""
    steps: dict[int, list[int]] = {}
    for path in sorted((rd / "logs").glob("rows-rank*.jsonl"), key=lambda p: int(p.stem.removeprefix("rows-rank"))):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            steps.setdefault(record["step"], []).extend(record["rows"])
    return steps


def train_losses(rd: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (rd / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}
