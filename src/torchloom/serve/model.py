"""The model a server or a batch job runs: a Predictor on the chosen device and precision, plus its identity."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from torchloom.errors import UserError
from torchloom.model.device import autocast, choose_precision, resolve_device
from torchloom.model.export import check_exported


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


class ServedModel:
    """A loaded exported model: `predict(texts)` gives label, score and probabilities per text, cleaned like training.

    Not thread-safe: call it from one thread at a time (the server runs it on a single worker thread).
    """

    def __init__(self, model_dir: str, device: str = "cpu", precision: str = "auto", batch_size: int = 32,
                 threads: int | None = None, runtime: str = "torch", length_bucket: int = 1) -> None:
        """length_bucket: each forward padded to a multiple of this many tokens (Predictor.length_bucket)."""
        import torch
        import transformers

        from torchloom.model.predict import Predictor

        check_exported(model_dir)
        transformers.utils.logging.disable_progress_bar()
        if threads:
            # One inference stream owns the cores; more threads than cores only adds contention.
            torch.set_num_threads(threads)
        self.device = resolve_device(device)
        if runtime == "onnx" and device == "auto" and self.device.startswith("cuda"):
            from torchloom.model.onnx import has_cuda_provider

            if not has_cuda_provider():  # a GPU, but an onnxruntime built for CPUs only: auto means what runs
                self.device = "cpu"
        if runtime == "onnx" and precision not in ("auto", "fp32"):
            raise UserError(f"--precision {precision}: the ONNX runtime runs the exported graph as it is (fp32, or"
                            " int8 weights with --format onnx-int8); leave --precision auto")
        choice = choose_precision(precision, self.device, key="--precision") if runtime == "torch" else None
        self.precision = choice.precision if choice else "fp32"
        self.precision_reason = choice.reason if choice else "the ONNX graph's own"
        self.warning = choice.warning if choice else None
        self.runtime = runtime
        self.predictor = Predictor(model_dir, device=self.device, batch_size=batch_size, runtime=runtime,
                                   threads=threads)
        if runtime == "onnx":
            self.precision = "int8" if self.predictor.onnx_file.name.endswith(".int8.onnx") else "fp32"
        self.predictor.length_bucket = length_bucket
        self.labels = list(self.predictor.labels)
        self.max_length = self.predictor.max_length
        self.identity = model_identity(model_dir, self.predictor.info, self.labels)

    def _autocast(self):
        return autocast(self.device, self.precision)

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

    def warm_up_buckets(self, max_rows: int, max_batch_tokens: int) -> list[int]:
        """One batch at each length bucket, as many rows as a batch of that length may hold (max_rows, and
        max_batch_tokens padded tokens; 0: no limit), through predict_encoded: a GPU (bf16 above all) pays for
        a shape the first time it sees it, here rather than on a client's request. Returns the lengths run."""
        template = self.predictor.encode_windows(["warm up"])[0]
        first = template[0]
        lengths = self.predictor.length_buckets()
        for length in lengths:
            # the special tokens of a real encoding around its first word repeated: exactly `length` tokens
            row = {k: (v[:1] + v[1:2] * (length - 2) + v[-1:])[:length] for k, v in first.items()}
            rows = min(max_rows, max(1, max_batch_tokens // length)) if max_batch_tokens else max_rows
            per_text = []
            for _ in range(rows):
                item = type(template)([row])
                item.lexical = getattr(template, "lexical", None)
                per_text.append(item)
            self.predict_encoded(per_text)
        return lengths

    def warm_up(self) -> None:
        """One short and one full-length forward, so the first client doesn't pay for lazy initialisation."""
        self.predict(["warm up"] * min(self.predictor.batch_size, 8))
        self.predict(["warm up " * self.max_length])
