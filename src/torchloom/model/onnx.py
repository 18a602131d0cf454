"""ONNX exports of an exported model, each behind a parity gate, and the ONNX Runtime session that runs them.

`export_onnx` writes model.onnx (fp32) and, for onnx-int8, model.int8.onnx (ONNX Runtime's dynamic
quantization: int8 weights of every MatMul and fused Attention, activations quantized per batch).
model.onnx is traced from the model loaded with its eager attention (the plain matmul-softmax-matmul
subgraph) by torch's TorchScript exporter (dynamic batch and sequence axes, opset 17), which ONNX Runtime's
transformer optimizer fuses into one Attention op per layer beside LayerNorm/residual and bias/GELU:
faster than the unfused torch.export graph, fp32 and int8 (docs/benchmarks.md). When that exporter is
missing or fails (a newer torch, a family it cannot trace), torch.export (opset 18) is the fallback.
Before either file is kept, the gate scores held-out prepared rows with PyTorch (the model as it trains
and serves, SDPA attention) and with ONNX Runtime:

- fp32: the largest |logit difference| must be <= FP32_MAX_LOGIT_DIFF and every row's argmax equal;
- int8: accuracy (per text, so chunked texts count once) may drop by at most INT8_MAX_ACCURACY_LOSS.

A failed gate writes nothing and is a one-line error with the numbers; a passed one is recorded in
torchloom.json ("onnx") with the file `--runtime onnx` loads, the exporter and the fused ops.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import secrets
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from torchloom.errors import UserError, first_line, missing_extra
from torchloom.model.export import EXPORT_INFO_FILE, check_exported, read_export_info
from torchloom.scoring import text_scores

FORMATS = ("hf", "onnx", "onnx-int8")
ONNX_FILE = "model.onnx"
INT8_FILE = "model.int8.onnx"
OPSET = 18  # torch.export
TORCHSCRIPT_OPSET = 17  # the TorchScript exporter
FP32_MAX_LOGIT_DIFF = 1e-3
INT8_MAX_ACCURACY_LOSS = 0.01
GATE_BATCH = 32


@dataclass
class GateRows:
    """Held-out prepared rows: token ids as prepare cut them, label ids, and (truncation chunks) the text
    each row is a window of, numbered from 0; None when every row is a text."""

    split: str
    input_ids: list[list[int]]
    labels: np.ndarray
    docs: np.ndarray | None = None


def require_onnxruntime():
    try:
        import onnxruntime
    except ImportError:
        raise missing_extra("the ONNX runtime", "onnx") from None
    return onnxruntime


def session(path: str | Path, threads: int | None = None, device: str = "cpu"):
    """An ONNX Runtime session for `path`: CPU, or CUDA when device is cuda and this onnxruntime has it."""
    ort = require_onnxruntime()
    options = ort.SessionOptions()
    options.log_severity_level = 3  # errors only: no per-node placement chatter on the user's terminal
    if threads:
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
    providers = ["CPUExecutionProvider"]
    if device.startswith("cuda"):
        if "CUDAExecutionProvider" not in ort.get_available_providers():
            raise UserError("--runtime onnx --device cuda: this onnxruntime has no CUDA provider; install"
                            " onnxruntime-gpu in place of onnxruntime, or use --device cpu")
        index = device.split(":", 1)[1] if ":" in device else "0"
        providers = [("CUDAExecutionProvider", {"device_id": int(index)}), "CPUExecutionProvider"]
    return ort.InferenceSession(str(path), options, providers=providers)


def has_cuda_provider() -> bool:
    """Whether this onnxruntime can run on CUDA (onnxruntime-gpu), without failing where it is not installed."""
    try:
        return "CUDAExecutionProvider" in require_onnxruntime().get_available_providers()
    except UserError:
        return False


def onnx_file(model_dir: str | Path) -> Path:
    """The ONNX file `--runtime onnx` runs for this exported model (int8 when that was exported)."""
    info = read_export_info(model_dir).get("onnx") or {}
    path = Path(model_dir) / info.get("file", "")
    if not info.get("file") or not path.is_file():
        raise UserError(f"model dir {model_dir}: no ONNX export there; run torchloom export --format onnx (or"
                        " onnx-int8) on the run first, or use --runtime torch")
    return path


def logits_of(run: Callable[[np.ndarray, np.ndarray], np.ndarray], input_ids: list[list[int]], pad_id: int,
              batch: int = GATE_BATCH) -> np.ndarray:
    """`run(ids, mask)` over rows of different lengths: sorted by length into padded batches, logits back in
    row order (float32)."""
    order = sorted(range(len(input_ids)), key=lambda i: len(input_ids[i]))
    out: np.ndarray | None = None
    for start in range(0, len(order), batch):
        take = order[start:start + batch]
        width = max(len(input_ids[i]) for i in take)
        ids = np.full((len(take), width), pad_id, np.int64)
        mask = np.zeros((len(take), width), np.int64)
        for row, i in enumerate(take):
            ids[row, :len(input_ids[i])] = input_ids[i]
            mask[row, :len(input_ids[i])] = 1
        logits = np.asarray(run(ids, mask), np.float32)
        if out is None:
            out = np.zeros((len(input_ids), logits.shape[1]), np.float32)
        out[take] = logits
    return out if out is not None else np.zeros((0, 0), np.float32)


def text_accuracy(logits: np.ndarray, rows: GateRows) -> float:
    """Accuracy per text: a chunked text's windows' logits are averaged first, as every inference path does."""
    if not len(logits):
        return 0.0
    scores = text_scores(logits, rows.docs)
    top, truth = scores.logits.argmax(1), rows.labels[scores.first]
    if truth.ndim == 2:  # tag ids: the most probable tag is one of the text's
        return float(np.mean((truth == top[:, None]).any(axis=1)))
    return float(np.mean(top == truth))


def _torch_model(model_dir: Path, attention: str | None = None):
    """(module(input_ids, attention_mask) -> logits, pad id, config); attention: the attn_implementation
    to load with (None: the model's default, SDPA)."""
    import torch
    import transformers
    from transformers import AutoModelForSequenceClassification

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    kwargs = {"attn_implementation": attention} if attention else {}
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, local_files_only=True, use_safetensors=True,
                                                               **kwargs).eval()

    class Logits(torch.nn.Module):  # the graph's one output, named: logits
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask):
            return self.inner(input_ids=input_ids, attention_mask=attention_mask).logits

    return Logits(model), int(getattr(model.config, "pad_token_id", None) or 0), model.config


@contextlib.contextmanager
def _quiet():
    """torch.onnx and the quantizer print progress lines and warnings meant for their developers."""
    import warnings

    loggers = [logging.getLogger(name) for name in ("", "torch.onnx", "torch._dynamo", "torch.export", "onnxscript")]
    levels = [lg.level for lg in loggers]
    buffer = io.StringIO()
    try:
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        with warnings.catch_warnings(), contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
            warnings.simplefilter("ignore")
            yield buffer
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


EXPORTERS = ("auto", "torchscript", "torch.export")


def _to_onnx(model_dir: Path, path: Path, exporter: str = "auto") -> str:
    """Write the fp32 graph to `path`; returns the exporter that wrote it ("torchscript" or "torch.export").
    exporter "auto": TorchScript, else torch.export; the other two: only that one.

    The TorchScript exporter traces a fresh copy of the model loaded with eager attention (it changes the
    module it traces, and SDPA traces to a graph ONNX Runtime does not fuse); torch.export is the fallback."""
    import torch

    example = (torch.randint(1000, 2000, (2, 16)), torch.ones(2, 16, dtype=torch.int64))
    names = {"input_names": ["input_ids", "attention_mask"], "output_names": ["logits"]}
    first = "not tried"
    if exporter != "torch.export":
        with _quiet():
            try:
                try:
                    traced, _, _ = _torch_model(model_dir, attention="eager")
                except Exception:  # a family without eager attention: trace its default
                    traced, _, _ = _torch_model(model_dir)
                with torch.no_grad():
                    torch.onnx.export(traced, example, str(path), dynamo=False, opset_version=TORCHSCRIPT_OPSET,
                                      do_constant_folding=True, **names,
                                      dynamic_axes={"input_ids": {0: "batch", 1: "seq"},
                                                    "attention_mask": {0: "batch", 1: "seq"}, "logits": {0: "batch"}})
                return "torchscript"
            except Exception as e:  # no TorchScript exporter in this torch, or it could not trace this model
                path.unlink(missing_ok=True)
                first = first_line(e)
                if exporter == "torchscript":
                    raise UserError(f"export --format onnx: the TorchScript exporter failed ({first}); export with"
                                    " the default exporter") from None
    wrapper, _, config = _torch_model(model_dir)
    positions = int(getattr(config, "max_position_embeddings", 0) or 512)
    batch, seq = torch.export.Dim("batch", min=1, max=65536), torch.export.Dim("seq", min=2, max=positions)
    with _quiet() as said:
        try:
            torch.onnx.export(wrapper, example, str(path), dynamo=True, opset_version=OPSET, verbose=False,
                              external_data=False, dynamic_shapes=({0: batch, 1: seq}, {0: batch, 1: seq}), **names)
            return "torch.export"
        except Exception as e:
            lines = [line for line in (str(e) or said.getvalue()).splitlines() if line.strip()]
            why = f"{type(e).__name__}: {lines[0] if lines else 'no message'}"
            raise UserError(f"export --format onnx: torch.onnx.export failed ({why}; the TorchScript exporter:"
                            f" {first}); export with --export.format hf") from None


# ONNX Runtime's transformer optimizer knows these families' subgraphs (LayerNorm + residual, bias + GELU)
OPTIMIZER_TYPES = {"bert": "bert", "roberta": "bert", "xlm-roberta": "bert", "camembert": "bert",
                   "distilbert": "bert", "electra": "bert", "mpnet": "bert"}


def _fuse(path: Path, config) -> dict[str, int]:
    """Fuse the graph's attention, LayerNorm/residual and bias/GELU subgraphs in place (ONNX Runtime's
    transformer optimizer); returns the fused ops by count. Empty, and the file untouched, for a family it
    does not know or when it fails: the plain graph is still correct, and the gate judges the fused one."""
    kind = OPTIMIZER_TYPES.get(str(getattr(config, "model_type", "")))
    if kind is None:
        return {}
    heads = int(getattr(config, "num_attention_heads", 0) or 0)
    hidden = int(getattr(config, "hidden_size", 0) or 0)
    try:
        from onnxruntime.transformers.optimizer import optimize_model

        with _quiet():
            optimized = optimize_model(str(path), model_type=kind, num_heads=heads, hidden_size=hidden)
            staged = path.with_name(path.name + ".fused")
            optimized.save_model_to_file(str(staged))
            fused = {op: int(n) for op, n in (optimized.get_fused_operator_statistics() or {}).items() if n}
        os.replace(staged, path)
        return fused
    except Exception:  # an unknown layout: the plain graph is still correct
        return {}


def fused_ops(fused: dict[str, int]) -> str:
    """The fused ops as one line ("6 Attention, 6 BiasGelu, ..."); empty when nothing was fused."""
    return ", ".join(f"{n} {op}" for op, n in sorted(fused.items()))


def _quantize(src: Path, dest: Path) -> None:
    require_onnxruntime()
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with _quiet():  # fused ops (SkipLayerNormalization, ...) have no inferred type: say they are float
        quantize_dynamic(str(src), str(dest), weight_type=QuantType.QInt8,
                         extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})


def export_onnx(model_dir: str | Path, rows: GateRows, fmt: str, threads: int | None = None,
                say: Callable[[str], None] = lambda msg: None, exporter: str = "auto") -> dict[str, Any]:
    """Write the ONNX file(s) of `fmt` into the exported `model_dir` if they pass the gate on `rows`;
    returns what torchloom.json's "onnx" then holds. exporter: see _to_onnx (benchmarks compare them)."""
    if fmt not in ("onnx", "onnx-int8") or exporter not in EXPORTERS:
        raise ValueError(f"format {fmt!r}, exporter {exporter!r}")
    require_onnxruntime()
    model_dir = check_exported(model_dir)
    if not rows.input_ids:
        raise UserError(f"export --format {fmt}: the {rows.split} split has no rows to check the ONNX model on;"
                        " prepare with a non-zero prepare.test_fraction or val_fraction")
    started = time.perf_counter()
    tmp = model_dir / f".onnx-tmp-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        say("onnx: exporting (dynamic batch and sequence axes)")
        exporter = _to_onnx(model_dir, tmp / ONNX_FILE, exporter)
        wrapper, pad_id, config = _torch_model(model_dir)  # the reference: the model as it serves
        fused = _fuse(tmp / ONNX_FILE, config)
        opset = TORCHSCRIPT_OPSET if exporter == "torchscript" else OPSET
        say(f"onnx: {exporter} exporter, opset {opset}; fused: {fused_ops(fused) or 'nothing (the plain graph runs)'}")
        reference = _torch_logits(wrapper, rows, pad_id)
        gate = _fp32_gate(tmp / ONNX_FILE, reference, rows, pad_id, threads, fmt, say)
        files = [ONNX_FILE]
        if fmt == "onnx-int8":
            _quantize(tmp / ONNX_FILE, tmp / INT8_FILE)
            gate["int8"] = _int8_gate(tmp / INT8_FILE, reference, rows, pad_id, threads, gate, say)
            files.append(INT8_FILE)
        onnx_info = {"format": fmt, "file": files[-1], "files": files, "opset": opset, "exporter": exporter,
                     "fused": fused,
                     "gate": gate, "limits": {"fp32_max_abs_logit_diff": FP32_MAX_LOGIT_DIFF,
                                              "int8_max_accuracy_loss": INT8_MAX_ACCURACY_LOSS},
                     "seconds": round(time.perf_counter() - started, 2)}
        _install(tmp, model_dir, files, onnx_info)
        return onnx_info
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _torch_logits(wrapper, rows: GateRows, pad_id: int) -> np.ndarray:
    """The gate's reference: PyTorch's logits of `rows`."""
    import torch

    with torch.inference_mode():
        def run_torch(ids, mask):
            return wrapper(torch.from_numpy(ids), torch.from_numpy(mask)).float().numpy()

        return logits_of(run_torch, rows.input_ids, pad_id)


def _fp32_gate(path: Path, reference: np.ndarray, rows: GateRows, pad_id: int, threads: int | None, fmt: str,
               say: Callable[[str], None]) -> dict[str, Any]:
    """The gate's numbers once the fp32 graph at `path` gave PyTorch's logits and argmax on every row."""
    fp32 = logits_of(_runner(path, threads), rows.input_ids, pad_id)
    texts = int(len(np.unique(rows.docs))) if rows.docs is not None else len(rows.input_ids)
    torch_accuracy = text_accuracy(reference, rows)
    gate: dict[str, Any] = {
        "split": rows.split, "rows": len(rows.input_ids), "texts": texts, "torch_accuracy": torch_accuracy,
        "fp32": _compare(reference, fp32, rows, torch_accuracy),
    }
    diff, agree = gate["fp32"]["max_abs_logit_diff"], gate["fp32"]["argmax_agreement"]
    if diff > FP32_MAX_LOGIT_DIFF or agree < 1.0:
        raise UserError(f"export --format {fmt}: the ONNX model failed its parity gate on {len(rows.input_ids)}"
                        f" {rows.split} rows (max |logit difference| {diff:.2e}, limit {FP32_MAX_LOGIT_DIFF:g};"
                        f" argmax agreement {agree:.4f}, must be 1); nothing was written; serve with"
                        " --runtime torch")
    say(f"onnx: fp32 gate passed on {len(rows.input_ids)} {rows.split} rows: max |logit difference| {diff:.1e}"
        f" (limit {FP32_MAX_LOGIT_DIFF:g}), argmax agreement {agree:.4f}")
    return gate


def _int8_gate(path: Path, reference: np.ndarray, rows: GateRows, pad_id: int, threads: int | None,
               gate: dict[str, Any], say: Callable[[str], None]) -> dict[str, float]:
    """The int8 numbers once the quantized graph at `path` lost at most INT8_MAX_ACCURACY_LOSS accuracy;
    `gate`: the fp32 gate's (texts, PyTorch's accuracy)."""
    texts, torch_accuracy = gate["texts"], gate["torch_accuracy"]
    int8 = logits_of(_runner(path, threads), rows.input_ids, pad_id)
    result = _compare(reference, int8, rows, torch_accuracy)
    loss = result["accuracy_loss"]
    if loss > INT8_MAX_ACCURACY_LOSS:
        raise UserError(f"export --format onnx-int8: the int8 model failed its gate on {texts} {rows.split}"
                        f" texts (accuracy {result['accuracy']:.4f} against PyTorch's"
                        f" {torch_accuracy:.4f}: {100 * loss:.2f} points lost, limit"
                        f" {100 * INT8_MAX_ACCURACY_LOSS:g}); nothing was written; use --export.format onnx")
    say(f"onnx: int8 gate passed on {texts} {rows.split} texts: accuracy {result['accuracy']:.4f}"
        f" against PyTorch's {torch_accuracy:.4f} ({100 * loss:+.2f} points lost, limit"
        f" {100 * INT8_MAX_ACCURACY_LOSS:g})")
    return result


def _install(tmp: Path, model_dir: Path, files: list[str], onnx_info: dict[str, Any]) -> None:
    """Move the gated `files` from `tmp` into `model_dir` and record them in its torchloom.json."""
    for name in (ONNX_FILE, INT8_FILE):  # an older export's files go; the new ones come in whole
        if (model_dir / name).exists() and name not in files:
            (model_dir / name).unlink()
    for name in files:
        os.replace(tmp / name, model_dir / name)
    info = read_export_info(model_dir)
    info["onnx"] = onnx_info
    staged = tmp / EXPORT_INFO_FILE
    staged.write_text(json.dumps(info, indent=2, ensure_ascii=False, default=str) + "\n", encoding="utf-8")
    os.replace(staged, model_dir / EXPORT_INFO_FILE)


def _runner(path: Path, threads: int | None):
    s = session(path, threads)

    def run(ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        return s.run(["logits"], {"input_ids": ids, "attention_mask": mask})[0]

    return run


def _compare(reference: np.ndarray, got: np.ndarray, rows: GateRows, torch_accuracy: float) -> dict[str, float]:
    accuracy = text_accuracy(got, rows)
    return {"max_abs_logit_diff": float(np.abs(got - reference).max()),
            "argmax_agreement": float(np.mean(got.argmax(1) == reference.argmax(1))),
            "accuracy": accuracy, "accuracy_loss": round(torch_accuracy - accuracy, 6)}
