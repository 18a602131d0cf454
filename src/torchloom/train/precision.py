"""Mixed precision: the autocast context for a configured precision (fp32 is none at all)."""

from __future__ import annotations

from contextlib import nullcontext

import torch


def autocast(device: torch.device, precision: str):
    if precision == "fp32":
        return nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def grad_scaler(precision: str, device: torch.device) -> torch.amp.GradScaler | None:
    """fp16 on CUDA needs loss scaling (its range is too small for small gradients); bf16 and fp32 do not."""
    return torch.amp.GradScaler("cuda") if precision == "fp16" and device.type == "cuda" else None


def eval_precision(setting: str, device: torch.device) -> str:
    """The autocast scoring uses (eval.precision): auto is what `serve --precision auto` answers with,
    fp32 on CPU and bf16 (fp16 where the GPU lacks bf16) on CUDA; fp16 has no CPU autocast, so bf16 there."""
    if setting == "auto":
        if device.type != "cuda":
            return "fp32"
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    if setting == "fp16" and device.type != "cuda":
        return "bf16"
    return setting
