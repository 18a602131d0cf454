"""Export a trained classifier as a plain Hugging Face directory that any transformers user can load.

The directory holds safetensors weights, a config whose id2label/label2id name the classes, the
tokenizer files, and torchloom.json (labels, version, plus what the caller adds: data fingerprint,
metrics, max_length). Nothing in it needs torchloom to load.
"""

from __future__ import annotations

import json
import os
import shutil
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from torchloom.errors import UserError, first_line

EXPORT_INFO_FILE = "torchloom.json"
EXPORT_FORMAT_VERSION = 1
WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def is_exported(path: str | Path) -> bool:
    """A Hugging Face model directory (what `torchloom export` writes): it has a config.json."""
    return (Path(path) / "config.json").is_file()


def check_exported(model_dir: str | Path,
                   fix: str = "pass a directory written by torchloom export (usually <run>/model)") -> Path:
    """The one check every reader of an exported model makes; `fix` says what to do instead."""
    if not is_exported(model_dir):
        raise UserError(f"model dir {model_dir}: no config.json there; {fix}")
    check_weights(model_dir)
    return Path(model_dir)


WEIGHTS_FIX = "export the model again (torchloom export) or point at another model directory"


def check_weights(model_dir: str | Path) -> None:
    """Every *.safetensors file of the model reads whole: a truncated or damaged one (an interrupted copy,
    a full disk) is one line here, before a server binds or a job starts. Reads the headers only."""
    from safetensors import SafetensorError, safe_open

    refuse_pickled_weights(model_dir, "model dir")
    for weights in sorted(Path(model_dir).glob("*.safetensors")):
        try:
            with safe_open(str(weights), framework="numpy"):
                pass
        except (SafetensorError, OSError) as e:
            raise weights_error(weights, e) from None


PICKLED = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl", "*.pickle")


def refuse_pickled_weights(model_dir: str | Path, key: str) -> None:
    """A model whose weights are not safetensors (pytorch_model.bin and kin are pickles: loading one runs whatever
    code it holds) is refused in one line; torchloom loads safetensors only (use_safetensors=True everywhere)."""
    root = Path(model_dir)
    if any(root.glob("*.safetensors")):
        return
    pickled = sorted(p.name for pattern in PICKLED for p in root.glob(pattern))
    if pickled:
        raise UserError(f"{key} {model_dir}: its weights are in {pickled[0]}, a pickle (loading one can run code);"
                        " torchloom loads safetensors only: convert it where you trust it"
                        " (AutoModel.from_pretrained(dir).save_pretrained(dir, safe_serialization=True)) or export"
                        " the model again")


def weights_error(weights: str | Path, e: BaseException) -> UserError:
    return UserError(f"model {weights}: {Path(weights).name} is truncated or corrupt ({first_line(e)});"
                     f" {WEIGHTS_FIX}")


def unwrap_model(model):
    """The plain model inside DDP / DataParallel (`.module`) and torch.compile (`._orig_mod`) wrappers."""
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    while True:
        if isinstance(model, (DistributedDataParallel, DataParallel)):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


def strip_wrapper_prefixes(state_dict: dict[str, Any]) -> dict[str, Any]:
    """Keys without the leading `module.` / `_orig_mod.` that wrappers add (DDP around compile adds both)."""
    out = {}
    for key, value in state_dict.items():
        stripped = True
        while stripped:
            stripped = False
            for prefix in WRAPPER_PREFIXES:
                if key.startswith(prefix):
                    key, stripped = key[len(prefix):], True
        out[key] = value
    return out


def _check_unchanged(out: Path, replaceable: dict[str, tuple] | None) -> None:
    if replaceable is None:
        return
    found = {p.relative_to(out).as_posix(): (p.lstat().st_size, p.lstat().st_mtime_ns) for p in out.rglob("*")
             if p.is_file() or p.is_symlink()}
    changed = sorted(rel for rel, st in found.items() if replaceable.get(rel) != st)
    if changed:
        raise UserError(f"model dir {out}: {', '.join(changed[:3])} came or changed there while exporting, and"
                        " torchloom did not write it; nothing replaced; move it away and export again")


def export_model(
    model,
    tokenizer_dir: str,
    labels: list[str],
    out_dir: str,
    extra_info: dict[str, Any] | None = None,
    state_dict: dict[str, Any] | None = None,
    extra_dirs: dict[str, Path] | None = None,
    replaceable: dict[str, tuple] | None = None,
) -> str:
    """Write `model` (wrappers removed) with the tokenizer from `tokenizer_dir` to `out_dir`; returns out_dir.

    labels: class names by id. extra_info: merged into torchloom.json (e.g. data_fingerprint, metrics,
    max_length). state_dict: a full state dict to save instead of the model's own (FSDP gathers one).
    extra_dirs: {name: directory} copied in as they are (the baseline's arrays of the shipped mix).
    replaceable: {path under out_dir: (size, mtime ns)} of the earlier export's files the run's ledger vouched for
    (stages/export.py): checked once more right before the swap, so a file put there meanwhile is never deleted.
    The new directory is complete before it replaces an existing `out_dir`.
    """
    model = unwrap_model(model)
    tokenizer = _checked_tokenizer(model, tokenizer_dir, labels)

    import transformers

    transformers.utils.logging.disable_progress_bar()  # "Writing model shards" on the user's terminal
    out = Path(out_dir).absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        _write_export(tmp, model, tokenizer, labels, extra_info, state_dict)
        for name, directory in (extra_dirs or {}).items():
            shutil.copytree(directory, tmp / name)
        # Two renames: the old export stays whole until the new one is in place.
        if out.exists():
            _check_unchanged(out, replaceable)
            os.replace(out, old)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    return str(out)


def _checked_tokenizer(model, tokenizer_dir: str, labels: list[str]):
    """The tokenizer to export beside `model`, once the labels fit the model's output classes."""
    from transformers import AutoTokenizer

    num_labels = getattr(model.config, "num_labels", None)
    if num_labels != len(labels):
        raise ValueError(f"the model has {num_labels} output classes but {len(labels)} labels were given")
    if len(set(labels)) != len(labels):
        raise ValueError(f"labels are not unique: {labels}")
    try:
        return AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    except (OSError, ValueError) as e:
        raise UserError(
            f"tokenizer {tokenizer_dir}: cannot load it ({first_line(e)}); pass the model.path the run trained from"
        ) from None


def _write_export(tmp: Path, model, tokenizer, labels: list[str], extra_info: dict[str, Any] | None,
                  state_dict: dict[str, Any] | None) -> None:
    """The whole export in `tmp`: weights, the config naming the labels, tokenizer, torchloom.json."""
    from transformers import AutoConfig

    import torchloom

    if state_dict is not None:
        state_dict = strip_wrapper_prefixes(state_dict)
    model.save_pretrained(tmp, state_dict=state_dict)
    # Labels go into the saved config, not the caller's model: exporting must not change the model.
    config = AutoConfig.from_pretrained(tmp, local_files_only=True)
    config.id2label = dict(enumerate(labels))
    config.label2id = {label: i for i, label in enumerate(labels)}
    config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    _check_weight_keys(tmp)
    info = {
        "format_version": EXPORT_FORMAT_VERSION,
        "torchloom_version": torchloom.__version__,
        "exported_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "labels": list(labels),
        **(extra_info or {}),
    }
    (tmp / EXPORT_INFO_FILE).write_text(json.dumps(info, indent=2, ensure_ascii=False, default=str) + "\n",
                                        encoding="utf-8")


def read_export_info(model_dir: str | Path) -> dict[str, Any]:
    """torchloom.json of an exported model; {} for a plain Hugging Face directory without one."""
    path = Path(model_dir) / EXPORT_INFO_FILE
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: not valid JSON ({e}); export the model again") from None


def _check_weight_keys(model_dir: Path) -> None:
    from safetensors import safe_open

    for weights in model_dir.glob("*.safetensors"):
        with safe_open(str(weights), framework="pt") as f:
            bad = [k for k in f.keys() if _wrapped(k)]  # noqa: SIM118 (safe_open is not a dict)
        if bad:
            raise RuntimeError(f"{weights.name}: wrapper prefixes leaked into weight names, e.g. {bad[0]}")


def _wrapped(key: str) -> bool:
    # A submodule may legitimately be called "module", but never "_orig_mod".
    return key.startswith(WRAPPER_PREFIXES) or "._orig_mod." in key
