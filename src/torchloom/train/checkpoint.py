"""Checkpoints: everything needed to resume exactly, written atomically.

Layout of `<run>/checkpoints/step-N/`:
  model.safetensors   the unwrapped model's weights (no `module.` prefixes)
  optimizer.pt        optimizer state
  trainer.pt          scheduler, grad scaler, loader position, counters, best metric
  rng-rank{R}.pt      each rank's RNG states (dropout draws differ per rank)
  meta.json           step, epoch, world size, metric values (for people and tools)

A checkpoint is written under `.step-N.tmp` and renamed when every rank has finished writing,
so a directory named `step-N` is always complete.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from torchloom.errors import UserError
from torchloom.train.distributed import Dist

STEP_DIR = re.compile(r"^step-(\d+)$")


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    while True:
        if hasattr(model, "module"):  # DDP
            model = model.module
        elif hasattr(model, "_orig_mod"):  # torch.compile
            model = model._orig_mod
        else:
            return model


def model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().contiguous() for k, v in unwrap(model).state_dict().items()}


def rng_state() -> dict[str, Any]:
    state = {
        "python": list(random.getstate()[1]),
        "python_version": random.getstate()[0],
        "python_gauss": random.getstate()[2],
        "numpy": np.random.get_state()[1].tolist(),
        "numpy_pos": int(np.random.get_state()[2]),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate((state["python_version"], tuple(state["python"]), state["python_gauss"]))
    np.random.set_state(("MT19937", np.array(state["numpy"], dtype=np.uint32), state["numpy_pos"], 0, 0.0))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def list_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = STEP_DIR.match(p.name)
        if m and (p / "meta.json").is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest(root: str | Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1][1] if found else None


def save(d: Dist, root: str | Path, step: int, *, model, optimizer, trainer_state: dict, meta: dict,
         keep_last: int, keep: set[int]) -> Path:
    """Collective: every rank calls it. Returns the final directory."""
    root = Path(root)
    final = root / f"step-{step}"
    tmp = root / f".step-{step}.tmp"
    if d.is_main:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    d.barrier()
    torch.save(rng_state(), tmp / f"rng-rank{d.rank}.pt")
    if d.is_main:
        save_file(model_state(model), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(trainer_state, tmp / "trainer.pt")
        (tmp / "meta.json").write_text(json.dumps({"step": step, "world_size": d.world_size, **meta}, indent=2))
    d.barrier()
    if d.is_main:
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        prune(root, keep_last, keep | {step})
    d.barrier()
    return final


def prune(root: Path, keep_last: int, keep: set[int]) -> None:
    found = list_checkpoints(root)
    recent = {s for s, _ in found[-keep_last:]}
    for s, p in found:
        if s not in recent and s not in keep:
            shutil.rmtree(p, ignore_errors=True)


def resolve(resume: str, root: str | Path) -> Path | None:
    """`latest` or a path -> a complete checkpoint directory (None: latest requested, none there)."""
    if not resume:
        return None
    if resume == "latest":
        return latest(root)
    p = Path(resume)
    if not (p / "meta.json").is_file():
        raise UserError(
            f"train.resume {resume}: not a complete checkpoint directory (no meta.json);"
            f" pass 'latest' or a checkpoints/step-N directory"
        )
    return p


def load(d: Dist, path: Path, *, model, optimizer) -> dict:
    """Load weights, optimizer and this rank's RNG; returns the trainer state."""
    meta = json.loads((path / "meta.json").read_text())
    unwrap(model).load_state_dict(load_file(str(path / "model.safetensors"), device=str(d.device)))
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location=d.device, weights_only=True))
    trainer_state = torch.load(path / "trainer.pt", map_location="cpu", weights_only=True)
    rng_file = path / f"rng-rank{d.rank}.pt"
    if meta.get("world_size") == d.world_size and rng_file.is_file():
        set_rng_state(torch.load(rng_file, map_location="cpu", weights_only=True))
    return trainer_state


def load_weights(path: str | Path) -> dict[str, torch.Tensor]:
    return load_file(str(Path(path) / "model.safetensors"))
