"""Checkpoints: everything needed to resume exactly, written atomically.

Layout of `<run>/checkpoints/step-N/`:
  model.safetensors   the unwrapped model's weights (no `module.` prefixes)
  optimizer.pt        optimizer state
  sharded/            instead of the two above when each rank holds part of the model (train.strategy
                      fsdp or pipeline): a torch.distributed.checkpoint directory, one file per rank,
                      with "model.<name>" and "optimizer.<state|param_groups>.<name>.<key>" entries
  trainer.pt          scheduler, grad scaler, loader position, counters, best metric
  rng-rank{R}.pt      each rank's RNG states (dropout draws differ per rank)
  meta.json           step, epoch, world size, strategy, metric values (for people and tools), and
                      the size and sha256 of every other file ("files"); written last

A checkpoint is written under `.step-N.tmp` and renamed when every rank has finished writing,
so a directory named `step-N` is always complete. Resume and export check the recorded sizes and
hashes: a damaged or truncated checkpoint (a full disk, a copy cut short) is skipped with a warning
for the newest intact one, or refused with one line. The optimizer, trainer and RNG files are read
with torch.load(weights_only=True), but a sharded checkpoint's metadata is unpickled inside torch:
resume only checkpoints you wrote.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file
from safetensors.torch import save as safetensors_bytes

from torchloom.errors import UserError
from torchloom.jsonio import sha256_file, write_atomic
from torchloom.runs.ledger_markers import remove_written
from torchloom.runs.rundir import STEP_DIR, step_name
from torchloom.runs.runfiles import RunFiles
from torchloom.train.distributed import Dist, broadcast_from_main

SHARDED_DIR = "sharded"
META = "meta.json"  # written last: a directory without it is not a checkpoint


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
        # one state per device the writer saw; a process that sees fewer (another machine, CUDA_VISIBLE_DEVICES)
        # restores those it has, where set_rng_state_all would raise IndexError
        for index, device_state in enumerate(state["cuda"][:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(device_state, index)


def list_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = STEP_DIR.match(p.name)
        if m and (p / META).is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest(root: str | Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1][1] if found else None


def sharded_options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # One entry per parameter in the optimizer's state too: pipeline stages hold different parameters,
    # and entries under one name (the param_groups list) would be written by one rank only.
    return StateDictOptions(flatten_optimizer_state_dict=True)


def sharded_state(model, optimizer) -> dict[str, Any]:
    """This rank's shards of the model and optimizer state, under the model's own parameter names."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer, options=sharded_options())
    return {"model": model_state, "optimizer": optimizer_state}


def save(d: Dist, root: str | Path, step: int, *, model, optimizer, trainer_state: dict, meta: dict,
         keep_last: int, keep: set[int], sharded: bool = False, files: RunFiles | None = None) -> Path:
    """Collective: every rank calls it. Returns the final directory.

    sharded: every rank writes its part of the model and optimizer (torch.distributed.checkpoint).
    files: the run's files; on a store (hosts share no directory) each rank but 0 writes its own files
    on its host and uploads them itself before the barrier after which rank 0 completes the checkpoint
    (rank 0's files go up in the background, meta.json last: RunFiles.checkpoints.uploader).
    """
    root = Path(root)
    final = root / step_name(step)
    tmp = root / f".{final.name}.tmp"
    if d.is_main:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    d.io_barrier()
    tmp.mkdir(parents=True, exist_ok=True)  # a host that does not share rank 0's directory has its own
    written: dict[str, dict] = {}  # rank 0's files, hashed as they were written (never read back)
    _write_torch(rng_state(), tmp, f"rng-rank{d.rank}.pt", written)
    if sharded:
        from torch.distributed import checkpoint as dcp

        dcp.save(sharded_state(model, optimizer), checkpoint_id=tmp / SHARDED_DIR)
    if d.is_main:
        if not sharded:
            _write_bytes(safetensors_bytes(model_state(model), metadata={"format": "pt"}), tmp, "model.safetensors",
                         written)
            _write_torch(optimizer.state_dict(), tmp, "optimizer.pt", written)
        _write_torch(trainer_state, tmp, "trainer.pt", written)
    if files is not None and not d.is_main:  # on a store: this rank's part goes up from here (nothing locally)
        files.checkpoints.publish_part(tmp, final,
                                       lambda rel: rel.name.startswith("rng-rank") or SHARDED_DIR in rel.parts)
    d.io_barrier()
    if d.is_main:
        # Last, once every rank's files are there: their sizes and hashes, which resume and export check.
        (tmp / META).write_text(json.dumps({"step": step, "world_size": d.world_size, "sharded": sharded,
                                            **meta, "files": file_digests(tmp, written)}, indent=2))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        prune(root, keep_last, keep | {step})
    d.io_barrier()
    if files is not None and not d.is_main:
        files.checkpoints.drop_part(tmp)
    return final


def clear_earlier(files: RunFiles) -> None:
    """Rank 0 of a fresh training (no train.resume) in a run that was trained before: the earlier training's
    checkpoints go, here and on the store, once a worker has started (a launch that fails first keeps them), so
    that neither `export` nor a later --resume takes one of them for this training's."""
    rd = files.rd
    found = sorted({*(step for step, _ in list_checkpoints(rd.checkpoints)), *files.checkpoints.steps()})
    files.place.remove_recorded(rd.checkpoints)  # only what the run's ledger vouches for: all of it, or one line
    if found:
        print(f"torchloom: a fresh training (no --resume): the {len(found)} checkpoint(s) of the earlier training in"
              f" {rd.home(rd.checkpoints)} (steps {', '.join(map(str, found))}) are removed", flush=True)


def prune(root: Path, keep_last: int, keep: set[int]) -> None:
    found = list_checkpoints(root)
    recent = {s for s, _ in found[-keep_last:]}
    for s, p in found:
        if s not in recent and s not in keep:
            remove_written(p)  # by its meta.json: a file of someone else's there stays
            _stamp(p).unlink(missing_ok=True)


_HASHER: list[ThreadPoolExecutor] = []
_CHUNK = 64 << 20
_INLINE = 1 << 20  # writes smaller than this are hashed on the writing thread


class _Digesting:
    """A file being written that hashes and counts its bytes on the way (torch.save writes to it). Each
    chunk is hashed on a helper thread while this one writes it (both release the GIL), so the hash costs
    next to nothing beside the write, and the file is never read back."""

    def __init__(self, path: Path) -> None:
        self.file = open(path, "wb")
        self.sha = hashlib.sha256()
        self.size = 0
        if not _HASHER:
            _HASHER.append(ThreadPoolExecutor(max_workers=1, thread_name_prefix="torchloom-hash"))

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        if len(view) < _INLINE:  # torch.save's headers and small tensors: a hand-off would cost more than the hash
            self.sha.update(view)
            self.file.write(view)
            self.size += len(view)
            return len(view)
        for start in range(0, len(view), _CHUNK):
            chunk = view[start:start + _CHUNK]
            hashed = _HASHER[0].submit(self.sha.update, chunk)
            try:
                self.file.write(chunk)
            finally:
                hashed.result()  # in order, and before the caller may reuse its buffer
        self.size += len(view)
        return len(view)

    def flush(self) -> None:
        self.file.flush()

    def digest(self) -> dict:
        self.file.close()
        return {"size": self.size, "sha256": self.sha.hexdigest()}


def _write_torch(obj: Any, directory: Path, name: str, written: dict[str, dict]) -> None:
    out = _Digesting(directory / name)
    try:
        torch.save(obj, out)
    finally:
        written[name] = out.digest()


def _write_bytes(data: bytes, directory: Path, name: str, written: dict[str, dict]) -> None:
    out = _Digesting(directory / name)
    try:
        out.write(data)
    finally:
        written[name] = out.digest()


def file_digests(directory: Path, written: dict[str, dict] | None = None) -> dict[str, dict]:
    """{relative path: {size, sha256}} of every file in a checkpoint directory but meta.json: `written`'s
    (hashed while this process wrote them) as they are, the rest (other ranks' files: RNG states, shards)
    read and hashed here."""
    written = written or {}
    return {rel: written.get(rel) or {"size": p.stat().st_size, "sha256": sha256_file(p)}
            for p in sorted(directory.rglob("*")) if p.is_file() and p.name != META
            for rel in [str(p.relative_to(directory))]}


def damage(path: str | Path) -> str | None:
    """What is wrong with this checkpoint, naming the file (None: intact as recorded).

    The files are hashed once per copy: a checkpoint found intact gets a stamp beside it (`.step-N.verified`)
    keyed by its meta.json and its files' sizes, times and inodes, so the driver's check before a resume and
    rank 0's at it read the checkpoint once; a file rewritten since (a new copy from the store, a truncation)
    changes the key and is hashed again. A checkpoint written before checkpoints recorded their files has nothing
    to check against."""
    path = Path(path)
    try:
        raw = (path / META).read_bytes()
        files = json.loads(raw).get("files") or {}
    except (OSError, ValueError) as e:
        return f"{path / META} is unreadable ({type(e).__name__})"
    for name, want in files.items():
        f = path / name
        if not f.is_file():
            return f"{f} is missing"
        size = f.stat().st_size
        if size != want["size"]:
            return f"{f} has {size} bytes, {want['size']} when written"
    stamp, key = _stamp(path), _stat_key(path, raw, files)
    if stamp.is_file() and stamp.read_text() == key:
        return None
    for name, want in files.items():
        if sha256_file(path / name) != want["sha256"]:
            return f"{path / name} differs from what was written"
    try:
        write_atomic(stamp, key)
    except OSError:  # a copy this process may not write to: it is hashed again next time
        pass
    return None


def _stamp(path: Path) -> Path:
    return path.parent / f".{path.name}.verified"


def _stat_key(path: Path, meta: bytes, files: dict) -> str:
    h = hashlib.sha256(meta)
    for name in sorted(files):
        st = (path / name).stat()
        h.update(f"{name} {st.st_size} {st.st_mtime_ns} {st.st_ino}\n".encode())
    return h.hexdigest()


def newest_intact(root: str | Path, what: str, warn: bool,
                  fix: str = "start afresh without train.resume") -> Path | None:
    """The newest checkpoint in root that is intact (None: there is none at all); each damaged newer
    one gets a warning line (when `warn`); all damaged is a one-line error naming the directory."""
    found = list_checkpoints(root)
    if not found:
        return None
    newest_damage = None
    for _, path in reversed(found):
        why = damage(path)
        if why is None:
            return path
        newest_damage = newest_damage or why.replace(f"{Path(root)}/", "", 1)
        if warn:
            print(f"torchloom: warning: {what}: skipping {path.name}: {why}", file=sys.stderr, flush=True)
    raise UserError(f"{what}: no intact checkpoint in {root} (newest: {newest_damage}); {fix}")


def read_meta(path: str | Path) -> dict:
    """A checkpoint's meta.json: step, epoch, world size, strategy, best step, validation metrics."""
    return json.loads((Path(path) / META).read_text())


def is_checkpoint(path: str | Path) -> bool:
    return (Path(path) / META).is_file()


def select(root: str | Path, which: str) -> Path:
    """The checkpoint to export: `best` (by the validation metric; the last when none was best) or `last`."""
    root = Path(root)
    last = newest_intact(root, "export", warn=True, fix="train again, or restore the checkpoints from a copy")
    if last is None:
        raise UserError(f"{root}: no checkpoint; run torchloom train first")
    if which == "best":
        best_step = read_meta(last).get("best_step", -1)
        best = root / step_name(best_step)
        if best_step >= 0 and is_checkpoint(best):
            why = damage(best)
            if why:
                raise UserError(f"export: the best checkpoint is damaged: {why}; export train.select last instead")
            return best
    return last


def resolve(resume: str, root: str | Path, warn: bool = True) -> Path | None:
    """`latest` (the newest intact checkpoint) or a path -> a checkpoint directory whose files are as
    written (None: latest requested, none there). warn: say which damaged checkpoints were skipped."""
    if not resume:
        return None
    if resume == "latest":
        return newest_intact(root, "train.resume latest", warn)
    p = Path(resume)
    if not (p / META).is_file():
        raise UserError(
            f"train.resume {resume}: not a complete checkpoint directory (no meta.json);"
            f" pass 'latest' or a checkpoints/step-N directory"
        )
    why = damage(p)
    if why:
        raise UserError(f"train.resume {resume}: damaged: {why}; resume from another checkpoint"
                        " ('latest' takes the newest intact one)")
    return p


def resolve_once(d: Dist, resume: str, root: str | Path) -> Path | None:
    """Collective: `resolve` on rank 0 alone (the hashes read once, not once per rank), its answer on every
    rank, so a flaky read on one rank cannot send the ranks to different checkpoints. `latest` travels as a
    name under `root`, which each host has (a run on a store: its own copy); rank 0's error is every rank's."""
    answer: tuple[str, str] = ("none", "")
    if d.is_main:
        try:
            path = resolve(resume, root, warn=True)
            if path is not None:
                answer = ("latest", path.name) if resume == "latest" else ("path", str(path))
        except UserError as e:
            answer = ("error", str(e))
    kind, value = broadcast_from_main(d, answer)
    if kind == "error":
        raise UserError(value)
    if kind == "none":
        return None
    return Path(root) / value if kind == "latest" else Path(value)


def load(d: Dist, path: Path, *, model, optimizer, sharded: bool = False) -> dict:
    """Load weights, optimizer and this rank's RNG; returns the trainer state.

    sharded: the run holds the model in parts (see save); the checkpoint must be sharded too.
    """
    meta = read_meta(path)
    if meta.get("sharded", False) != sharded:
        written = meta.get("strategy", "ddp")
        raise UserError(f"train.resume {path}: written by train.strategy {written} on {meta.get('world_size')}"
                        f" workers, which this run cannot load; resume with train.strategy {written}")
    if sharded:
        from torch.distributed import checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        state = sharded_state(model, optimizer)  # the shapes and shards to load into
        dcp.load(state, checkpoint_id=path / SHARDED_DIR)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                       options=sharded_options())
    else:
        try:
            unwrap(model).load_state_dict(load_file(str(path / "model.safetensors"), device=str(d.device)))
        except RuntimeError as e:  # another architecture: a different model.path than the run's
            if "size mismatch" not in str(e) and "Missing key" not in str(e) and "Unexpected key" not in str(e):
                raise
            raise UserError(f"train.resume {path}: the checkpoint holds another model's weights than model.path"
                            " builds; resume with the model.path of the run that wrote it (its config.toml)"
                            ) from None
        optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location=d.device, weights_only=True))
    trainer_state = torch.load(path / "trainer.pt", map_location="cpu", weights_only=True)
    rng_file = path / f"rng-rank{d.rank}.pt"
    if meta.get("world_size") == d.world_size and rng_file.is_file():
        set_rng_state(torch.load(rng_file, map_location="cpu", weights_only=True))
    return trainer_state


def load_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The whole model's weights from a checkpoint, gathered into this process when it is sharded."""
    path = Path(path)
    if not (path / SHARDED_DIR).is_dir():
        return load_file(str(path / "model.safetensors"))
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(path / SHARDED_DIR))
    entries = reader.read_metadata().state_dict_metadata
    state = {name: torch.empty(entry.size, dtype=entry.properties.dtype) for name, entry in entries.items()
             if name.startswith("model.") and isinstance(entry, TensorStorageMetadata)}
    with warnings.catch_warnings():
        # no_dist: this process reads every rank's file itself; torch warns that it assumes so even when told.
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(state, storage_reader=reader, no_dist=True)
    return {name.removeprefix("model."): tensor for name, tensor in state.items()}
