"""The model a server or a batch job runs: a Predictor on the chosen device and precision, plus its identity."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from torchloom.errors import UserError
from torchloom.model.device import autocast, choose_precision, resolve_device
from torchloom.model.export import check_exported

# A registered model's identity beside its downloaded directory (registry.fetch writes it): name, version, aliases.
REGISTERED_FILE = "torchloom-registered.json"


@dataclass(frozen=True)
class ModelIdentity:
    """What a client is told about the model that answered: its name, version and labels; a registered model's
    aliases (as the registry had them when it was fetched) and its registry URI too."""

    name: str
    version: str
    labels: tuple[str, ...]
    aliases: tuple[str, ...] = ()
    uri: str = ""  # models:/NAME/VERSION for a registered model, else ""

    def brief(self) -> dict[str, Any]:
        """The identity as responses carry it: name and version, a registered model's aliases and URI."""
        return {"name": self.name, "version": self.version,
                **({"aliases": list(self.aliases), "uri": self.uri} if self.uri else {})}


def model_identity(model_dir: str, info: dict[str, Any], labels: list[str]) -> ModelIdentity:
    """A registered model (REGISTERED_FILE beside it): its registry name and version. Else name: torchloom.json
    "name", else the run's name for <run>/model, else the dir name; version: torchloom.json "version", else its
    export time, else config.json's modification time."""
    import json

    path = Path(model_dir).resolve()
    try:
        registered = json.loads((path / REGISTERED_FILE).read_text())
        return ModelIdentity(name=str(registered["name"]), version=str(registered["version"]), labels=tuple(labels),
                             aliases=tuple(str(a) for a in registered.get("aliases") or ()),
                             uri=f"models:/{registered['name']}/{registered['version']}")
    except (OSError, ValueError, KeyError, TypeError):
        pass  # not a registered model's download (or a damaged note of it): the directory's own identity
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
        self.multi_label = self.predictor.multi_label  # its predictions name their tags (`labels`) too
        self.max_length = self.predictor.max_length
        self.identity = model_identity(model_dir, self.predictor.info, self.labels)
        self.model_dir = model_dir

    def encoding_key(self) -> tuple | None:
        """What this model's encoding of a text depends on (encode): two models of equal keys take each other's
        encodings (a shadow tokenized once, serve/fleet.py). None where it cannot be shared: a shipped baseline,
        whose probabilities travel with the encoding, is the model's own."""
        import hashlib

        p = self.predictor
        if p.lexical is not None:
            return None
        digest = hashlib.sha256()
        for path in sorted(Path(self.model_dir).iterdir()):
            if path.name.startswith(("tokenizer", "vocab", "special_tokens", "merges", "spiece", "sentencepiece")):
                digest.update(path.name.encode() + b"\0" + path.read_bytes())
        chunks = (p.stride, p.max_chunks) if p.truncation == "chunks" else ()
        return digest.hexdigest(), p.truncation, p.max_length, chunks, self.signals

    def _autocast(self):
        return autocast(self.device, self.precision)

    # each answer also carries its text's "tokens" and "unknown" (Predictor.predict_encoded), for a monitor
    signals = False

    def predict(self, texts: list[str]) -> list[dict[str, Any]]:
        """Predictor.predict's answers, with each text's logits (TEI's raw_scores)."""
        with self._autocast():
            return self.predictor.predict(texts, with_logits=True, with_signals=self.signals)

    def encode(self, texts: list[str]) -> list[list[dict[str, list[int]]]]:
        """Each text's model inputs (cleaned and cut like training's): the server tokenizes before queueing,
        so batches can be bounded in tokens."""
        return self.predictor.encode_windows(texts, self.signals)

    def predict_encoded(self, encoded: list[list[dict[str, list[int]]]]) -> list[dict[str, Any]]:
        with self._autocast():
            return self.predictor.predict_encoded(encoded, with_logits=True, with_signals=self.signals)

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
        lengths = self.predictor.length_buckets()
        for length in lengths:
            row = _row_of(template[0], length)
            per_text = []
            for _ in range(_rows_at(length, max_rows, max_batch_tokens)):
                item = type(template)([row])
                item.lexical = getattr(template, "lexical", None)
                per_text.append(item)
            self.predict_encoded(per_text)
        return lengths

    def tune(self, max_rows: int, max_batch_tokens: int, cores: int) -> list[str]:
        """At warm-up, on the model thread, before the buckets are warmed (torch on a CPU only): choose by
        measurement on a typical batch (max_rows rows of ~64 tokens) (1) a traced forward or eager
        (model/traced.py) and (2) on 2 or 3 cores, torch's threads: all cores, or one fewer for the event loop and
        the tokenizers. One fewer where the forward loses less a text than the front end's share of the cores
        gives back: front end ~ 2 x the tokenizer's time a text (tokenizing, and as much again for HTTP, JSON and
        the batcher: 80-110 against 100-120 us with 1-text requests, docs/benchmarks.md). The tiny model: 1 of
        2 cores (the second speeds its forward 1.4x: 172 against 119 us a text, front end ~220); MiniLM keeps
        both (26 against 14 ms). Returns the lines to log."""
        import torch

        from torchloom.model.predict import pad_batch
        from torchloom.model.traced import TracedForward, best_seconds

        if self.runtime != "torch" or self.device != "cpu":
            return []
        length = min(self.predictor.length_buckets(), key=lambda n: abs(n - 64))
        rows = _rows_at(length, max_rows, max_batch_tokens)
        row = _row_of(self.predictor.encode_windows(["warm up"])[0][0], length)
        batch = pad_batch([row] * rows, self.predictor.tokenizer, length)  # CPU tensors, as the model is here
        lines = []
        with torch.inference_mode():
            traced = self.predictor.traced = TracedForward(
                self.predictor.model, pooled=self.signals and self.predictor.sketch is not None)  # a monitor's sketch
            used, why = traced.choose(batch, self._autocast)
            lines.append(f"forward {'traced' if used else 'eager'}: {why}")
            if cores in (2, 3):
                text = " ".join(["warm up"] * (length // 2))
                tokenize = best_seconds(lambda: self.encode([text] * rows), warm=1) / rows

                def forward() -> None:
                    with self._autocast():
                        traced.logits(batch)

                times = {}
                for n in (cores, cores - 1):
                    torch.set_num_threads(n)
                    times[n] = best_seconds(forward) / rows
                fewer = times[cores - 1] <= times[cores] + 2 * tokenize / cores
                torch.set_num_threads(cores - 1 if fewer else cores)
                lines.append(f"torch threads {torch.get_num_threads()} of {cores} cores: the forward takes"
                             f" {times[cores] * 1e6:.0f} us a text on {cores}, {times[cores - 1] * 1e6:.0f} on"
                             f" {cores - 1}; tokenizing {tokenize * 1e6:.0f}")
        return lines

    def warm_up(self) -> None:
        """One short and one full-length forward, so the first client doesn't pay for lazy initialisation."""
        self.predict(["warm up"] * min(self.predictor.batch_size, 8))
        self.predict(["warm up " * self.max_length])


def _row_of(first: dict[str, list[int]], length: int) -> dict[str, list[int]]:
    """A model input of exactly `length` tokens: the special tokens of a real encoding (`first`) around its
    first word repeated."""
    return {k: (v[:1] + v[1:2] * (length - 2) + v[-1:])[:length] for k, v in first.items()}


def _rows_at(length: int, max_rows: int, max_batch_tokens: int) -> int:
    """The most rows a batch of `length`-token rows may hold: max_rows, and max_batch_tokens padded tokens
    (0: no limit), at least one."""
    return min(max_rows, max(1, max_batch_tokens // length)) if max_batch_tokens else max_rows
