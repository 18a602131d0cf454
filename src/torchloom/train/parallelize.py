"""The one place that applies parallelism to the model; the loop never calls DDP itself."""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel

from torchloom.train.distributed import Dist


def parallelize(model: torch.nn.Module, d: Dist, strategy: str) -> torch.nn.Module:
    model.to(d.device)
    if not d.enabled:
        return model
    if strategy == "ddp":
        return DistributedDataParallel(
            model,
            device_ids=[d.device.index] if d.device.type == "cuda" else None,
            # Gradients live in the all-reduce buckets: one copy fewer of every gradient.
            gradient_as_bucket_view=True,
        )
    raise ValueError(f"unknown strategy {strategy!r}")
