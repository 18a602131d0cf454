"""The model a server or a batch job runs: a Predictor on the chosen device and precision, plus its identity."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from torchloom.errors import UserError
from torchloom.model.export import check_exported

DEVICES = ("auto", "cpu", "cuda")
PRECISIONS = ("auto", "fp32", "bf16", "fp16")
_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


@dataclass(frozen=True)
class ModelIdentity:
    """What a client is told about the model that answered: its name, version and labels."""

    name: str
    version: str
    labels: tuple[str, ...]


def model_identity(model_dir: str, info: dict[str, Any], labels: list[str]) -> ModelIdentity:
    """name: torchloom.json "name", else the run's name for <run>/model, else the dir name.
    version: torchloom.json "version", else its export time, else config.json's modification time."""
    path = Path(model_dir).resolve()
    name = info.get("name") or (path.parent.name if path.name == "model" and path.parent.name else path.name)
    version = info.get("version") or info.get("exported_at")
    if not version:
        mtime = (path / "config.json").stat().st_mtime
        version = datetime.fromtimestamp(mtime, UTC).isoformat(timespec="seconds")
    return ModelIdentity(name=str(name), version=str(version), labels=tuple(labels))


def resolve_device(device: str) -> str:
    """cpu, cuda or cuda:N; auto is cuda when a CUDA device is visible."""
    import torch

    kind = device.split(":", 1)[0]
    if kind not in DEVICES or (kind == "auto" and device != "auto"):
        raise UserError(f"--device {device}: unknown; use one of {', '.join(DEVICES)} (or cuda:N)")
    if kind == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {device}: no CUDA device is visible to torch; use --device cpu or auto")
    return device


def resolve_precision(precision: str, device: str) -> str:
    """fp32, bf16 or fp16; auto is fp32 on CPU (identical to training-time evaluation), bf16 or fp16 on CUDA."""
    import torch

    if precision not in PRECISIONS:
        raise UserError(f"--precision {precision}: unknown; use one of {', '.join(PRECISIONS)}")
    on_cuda = device.startswith("cuda")
    if precision == "auto":
        if not on_cuda:
            return "fp32"
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    if precision == "fp16" and not on_cuda:
        raise UserError("--precision fp16: float16 autocast is for CUDA; on CPU use fp32 or bf16")
    return precision


class ServedModel:
    """A loaded exported model: `predict(texts)` gives label, score and probabilities per text, cleaned like training.

    Not thread-safe: call it from one thread at a time (the server runs it on a single worker thread).
    """

    def __init__(self, model_dir: str, device: str = "cpu", precision: str = "auto", batch_size: int = 32,
                 threads: int | None = None, runtime: str = "torch") -> None:
        import torch
        import transformers

        from torchloom.model.predict import Predictor

        check_exported(model_dir)
        transformers.utils.logging.disable_progress_bar()
        if threads:
            # One inference stream owns the cores; more threads than cores only adds contention.
            torch.set_num_threads(threads)
        self.device = resolve_device(device)
        if runtime == "onnx" and precision not in ("auto", "fp32"):
            raise UserError(f"--precision {precision}: the ONNX runtime runs the exported graph as it is (fp32, or"
                            " int8 weights with --format onnx-int8); leave --precision auto")
        self.precision = resolve_precision(precision, self.device) if runtime == "torch" else "fp32"
        self.runtime = runtime
        self.predictor = Predictor(model_dir, device=self.device, batch_size=batch_size, runtime=runtime,
                                   threads=threads)
        if runtime == "onnx":
            self.precision = "int8" if self.predictor.onnx_file.name.endswith(".int8.onnx") else "fp32"
        self.labels = list(self.predictor.labels)
        self.max_length = self.predictor.max_length
        self.identity = model_identity(model_dir, self.predictor.info, self.labels)

    def _autocast(self):
        import torch

        if self.precision in ("fp32", "int8"):
            return contextlib.nullcontext()
        device_type = self.device.split(":", 1)[0]
        return torch.autocast(device_type=device_type, dtype=getattr(torch, _DTYPES[self.precision]))

    def predict(self, texts: list[str]) -> list[dict[str, Any]]:
        """Predictor.predict's answers, with each text's logits (TEI's raw_scores)."""
        with self._autocast():
            return self.predictor.predict(texts, with_logits=True)

    def encode(self, texts: list[str]) -> list[list[dict[str, list[int]]]]:
        """Each text's model inputs (cleaned and cut like training's): the server tokenizes before queueing,
        so batches can be bounded in tokens."""
        return self.predictor.encode_windows(texts)

    def predict_encoded(self, encoded: list[list[dict[str, list[int]]]]) -> list[dict[str, Any]]:
        with self._autocast():
            return self.predictor.predict_encoded(encoded, with_logits=True)

    @staticmethod
    def cost(encoded: list[dict[str, list[int]]]) -> tuple[int, int]:
        """(rows, tokens of the longest) one encoded text adds to a batch: a padded batch computes
        rows x longest tokens."""
        return len(encoded), max(len(f["input_ids"]) for f in encoded)

    def warm_up(self) -> None:
        """One short and one full-length forward, so the first client doesn't pay for lazy initialisation."""
        self.predict(["warm up"] * min(self.predictor.batch_size, 8))
        self.predict(["warm up " * self.max_length])


def default_threads() -> int:
    """The cores this process may use (its CPU affinity where the OS tells it)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
