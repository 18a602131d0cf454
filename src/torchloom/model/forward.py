"""Logits of prepared batches: the forward loop validation in training and evaluate share."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np
import torch

from torchloom.model.device import autocast
from torchloom.model.packing import packed_logits
from torchloom.tag_scoring import concat_labels


@torch.inference_mode()
def prepared_logits(model: torch.nn.Module, batches: Iterable[dict], device: torch.device, precision: str,
                    num_labels: int, forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor | None] | None = None
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(logits in float32, labels, row indices) of `batches` (data.eval_batches' dicts), the model in eval mode
    under `precision`; the model's train/eval mode is restored after.

    forward(input_ids, attention_mask): how to run the model (default: its own forward's logits). A forward
    that returns None (a pipeline stage before the last) and a batch without labels (a filler that keeps
    ranks in lockstep) give no rows."""
    was_training = model.training
    model.eval()
    logits_out, labels, index = [], [], []
    for batch in batches:
        ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
        with autocast(device, precision):
            if "cls_index" in batch:  # a packed batch (train.packing): the model itself, one logit row per sequence
                logits = packed_logits(model, model, batch, device)
            else:
                logits = forward(ids, mask) if forward is not None else model(input_ids=ids, attention_mask=mask).logits
        if logits is None or not len(batch["labels"]):
            continue
        logits_out.append(logits.float().cpu().numpy())
        labels.append(batch["labels"].numpy())
        index.append(batch["index"].numpy())
    model.train(was_training)
    if not logits_out:
        return np.zeros((0, num_labels), np.float32), np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(logits_out), concat_labels(labels), np.concatenate(index)
