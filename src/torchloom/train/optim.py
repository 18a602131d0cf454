"""AdamW with decay only on weight matrices, and the learning rate as a pure function of the step."""

from __future__ import annotations

import math

import torch


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    # Biases and LayerNorm weights are 1-D; decaying them hurts fine-tuning and helps nothing.
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.ndim >= 2 else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def lr_factor(step: int, total_steps: int, warmup_steps: int, schedule: str) -> float:
    """Multiplier of the peak lr for optimizer step `step` (0-based): linear warm-up, then decay."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    return max(0.0, 1.0 - progress)


def build(model: torch.nn.Module, lr: float, weight_decay: float, total_steps: int, warmup_steps: int,
          schedule: str, device: torch.device):
    # The fused kernel exists for CPU and CUDA: on this CPU it is 4.95x faster than foreach for MiniLM
    # (0.027 s against 0.136 s a step on one thread, benchmarks/step_parts.py), on GPUs the usual win.
    optimizer = torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, total_steps, warmup_steps, schedule)
    )
    return optimizer, scheduler
