"""The one device and precision rule, with torch's answers: train, evaluate, serve, predict, Spark batch
scoring and `plan --calibrate` all ask here (the rule itself is torchloom.machine.choose_precision)."""

from __future__ import annotations

import os
from contextlib import nullcontext

import torch

from torchloom import machine
from torchloom.errors import UserError
from torchloom.machine import PrecisionChoice

DEVICES = ("auto", "cpu", "cuda")
# Overrides the CPU's bf16 probe: "0" (treat bf16 as emulated) or a name such as "AMX" (treat it as native).
CPU_BF16_ENV = "TORCHLOOM_CPU_BF16"


def cpu_bf16() -> str | None:
    """How this CPU runs bf16 natively (AMX, AVX512-BF16, Arm BF16), or None where torch emulates it.

    The CPU's flags say what the hardware has; oneDNN (what torch's CPU matmuls run on) must agree.
    """
    forced = os.environ.get(CPU_BF16_ENV, "").strip()
    if forced:
        return None if forced.lower() in ("0", "no", "false", "none") else forced
    how = machine.cpu().bf16_how
    if how is None:
        init_amx = getattr(torch._C._cpu, "_init_amx", None)  # True only where AMX tiles are usable
        how = "AMX" if init_amx is not None and init_amx() else None
    try:
        onednn = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        onednn = False
    return how if onednn else None


def cuda_bf16() -> bool:
    """The visible GPU runs bf16 in hardware (Ampere and later), not by emulation."""
    if not torch.cuda.is_available():
        return False
    try:
        return bool(torch.cuda.is_bf16_supported(including_emulation=False))
    except TypeError:  # older torch: no including_emulation
        return bool(torch.cuda.is_bf16_supported())


def gpu_count() -> int:
    """CUDA devices torch can use here (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_device(device: str, key: str = "--device") -> str:
    """cpu, cuda or cuda:N; auto is cuda when a CUDA device is visible."""
    kind = device.split(":", 1)[0]
    if kind not in DEVICES or (kind == "auto" and device != "auto"):
        raise UserError(f"{key} {device}: unknown; use one of {', '.join(DEVICES)} (or cuda:N)")
    if kind == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda" and not torch.cuda.is_available():
        raise UserError(f"{key} {device}: no CUDA device is visible to torch; use {key} cpu or auto")
    if kind == "cuda" and ":" in device:
        index, count = device.split(":", 1)[1], torch.cuda.device_count()
        if not index.isdigit() or int(index) >= count:
            raise UserError(f"{key} {device}: this machine shows torch {count} CUDA device(s), cuda:0 to"
                            f" cuda:{count - 1}; pick one of those, or {key} cuda")
    return device


def choose_precision(setting: str, device: str | torch.device, key: str = "train.precision",
                     scaler_ok: bool = True) -> PrecisionChoice:
    """The precision to run in on `device`, and why (see torchloom.machine.choose_precision)."""
    where = str(device)
    on_cuda = where.startswith("cuda")
    return machine.choose_precision(setting, where, cpu_bf16=None if on_cuda else cpu_bf16(),
                                    cuda_bf16=cuda_bf16() if on_cuda else False, key=key, scaler_ok=scaler_ok)


def autocast(device: torch.device, precision: str):
    """The autocast context for a chosen precision (fp32, and int8 ONNX graphs, need none)."""
    if precision in ("fp32", "int8"):
        return nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=torch.device(device).type, dtype=dtype)


def grad_scaler(precision: str, device: torch.device) -> torch.amp.GradScaler | None:
    """fp16 on CUDA needs loss scaling (its range is too small for small gradients); bf16 and fp32 do not."""
    return torch.amp.GradScaler("cuda") if precision == "fp16" and torch.device(device).type == "cuda" else None
