"""Validation inside training: every rank scores its share, all ranks get the same metrics."""

from __future__ import annotations

from contextlib import nullcontext

import numpy as np
import torch

from torchloom.data.loader import eval_batches
from torchloom.evaluate.metrics import classification_metrics
from torchloom.manifest import Manifest
from torchloom.train.distributed import Dist, all_gather_objects


def autocast(device: torch.device, precision: str):
    if precision == "fp32":
        return nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


@torch.inference_mode()
def predict_split(d: Dist, model: torch.nn.Module, manifest: Manifest, split: str, batch_size: int,
                  precision: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """This rank's (probabilities, labels, row indices) for its contiguous share of `split`."""
    was_training = model.training
    model.eval()
    probs, labels, index = [], [], []
    for batch in eval_batches(manifest, split, d.rank, d.world_size, batch_size):
        with autocast(d.device, precision):
            logits = model(
                input_ids=batch["input_ids"].to(d.device), attention_mask=batch["attention_mask"].to(d.device)
            ).logits
        probs.append(torch.softmax(logits.float(), dim=-1).cpu().numpy())
        labels.append(batch["labels"].numpy())
        index.append(batch["index"].numpy())
    model.train(was_training)
    if not probs:
        return np.zeros((0, manifest.num_labels), np.float32), np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(probs), np.concatenate(labels), np.concatenate(index)


def evaluate(d: Dist, model: torch.nn.Module, manifest: Manifest, split: str, batch_size: int,
             precision: str) -> dict:
    """Collective: every rank calls it and every rank returns the same metrics."""
    probs, labels, _ = predict_split(d, model, manifest, split, batch_size, precision)
    parts = all_gather_objects(d, (probs, labels))
    all_probs = np.concatenate([p for p, _ in parts])
    all_labels = np.concatenate([y for _, y in parts])
    return classification_metrics(all_probs, all_labels, manifest.labels)
