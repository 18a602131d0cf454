"""The trainer's counters (saved in every checkpoint) and the small pieces of the loop around them: the seed, the
class weights, which metric is better, the window of losses between two log lines."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from torchloom.data.shards import IGNORE_LABEL
from torchloom.manifest import Manifest


@dataclass
class TrainState:
    """The trainer's own counters; saved in every checkpoint."""

    step: int = 0  # optimizer steps done
    epoch: int = 0  # epoch in progress
    samples_seen: int = 0
    best_metric: float | None = None
    best_step: int = -1
    evals_without_improvement: int = 0
    stopped_early: bool = False
    stop_reason: str = ""  # why training ended before total_steps: early_stopping, or who asked (e.g. pruned)
    last_eval_step: int = -1
    last_checkpoint_step: int = -1


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def class_weights(manifest: Manifest, mode: str, device: torch.device) -> torch.Tensor | None:
    """The loss's weights: per class for a single-label run; a multi-label run's positive weights per tag
    (negatives / positives of its train rows: a rare tag's few positives weigh as much as its many negatives)."""
    if mode == "none":
        return None
    counts = manifest.split("train").per_class
    if manifest.multi_label:
        split = manifest.split("train")
        texts = split.documents or split.rows
        n = np.array([max(1, counts.get(label, 0)) for label in manifest.labels], dtype=np.float64)
        return torch.tensor(np.maximum(texts - n, 1.0) / n, dtype=torch.float32, device=device)
    n = np.array([max(1, counts.get(label, 0)) for label in manifest.labels], dtype=np.float64)
    # "balanced" as in scikit-learn: n_samples / (n_classes * n_c).
    return torch.tensor(n.sum() / (len(n) * n), dtype=torch.float32, device=device)


# train.tag_loss: (gamma on a positive, gamma on a negative, margin shifted off a negative's probability).
# focal: Lin et al. 2017's gamma 2 on both; asymmetric: Ridnik et al. 2021's ASL defaults, the easy negatives (most
# of a text's tags) weighed down hard and the ones under 0.05 dropped, the positives left as plain cross-entropy.
TAG_LOSSES = {"bce": (0.0, 0.0, 0.0), "focal": (2.0, 2.0, 0.0), "asymmetric": (0.0, 4.0, 0.05)}


def logits_and_targets(logits: torch.Tensor, masks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows that count (a filler row left out) and their 0/1 targets [rows, K], from tag ids [B, width] padded
    with -1 (text/tags.py), or from int64 masks [B] of older shards and a filler's -100."""
    k = logits.shape[1]
    if masks.dim() == 2:
        valid = masks[:, 0] > IGNORE_LABEL
        ids = masks[valid]
        hot = torch.zeros(len(ids), k + 1, dtype=logits.dtype, device=logits.device)  # column k takes the padding
        hot.scatter_(1, torch.where(ids >= 0, ids, k), 1.0)
        return logits[valid], hot[:, :k]
    valid = masks >= 0
    bits = torch.arange(k, device=masks.device, dtype=torch.int64)
    return logits[valid], ((masks[valid].unsqueeze(1) >> bits) & 1).to(logits.dtype)


def tag_loss(logits: torch.Tensor, masks: torch.Tensor, pos_weight: torch.Tensor | None, kind: str = "bce"
             ) -> torch.Tensor:
    """A multi-label batch's summed loss: each row's mean loss over the tags, summed over the rows (a filler row's
    negative id left out), as cross-entropy is summed for a single-label batch. kind: TAG_LOSSES (bce is binary
    cross-entropy; pos_weight scales each tag's positive term in every kind)."""
    import torch.nn.functional as F

    x, targets = logits_and_targets(logits, masks)
    if kind == "bce":
        per_tag = F.binary_cross_entropy_with_logits(x, targets, pos_weight=pos_weight, reduction="none")
        return per_tag.mean(dim=1).sum()
    gamma_pos, gamma_neg, margin = TAG_LOSSES[kind]
    p = torch.sigmoid(x)
    positive = -F.logsigmoid(x)  # -log p
    if gamma_pos:
        positive = positive * (1 - p).pow(gamma_pos)
    if pos_weight is not None:
        positive = positive * pos_weight
    if margin:  # the shifted probability p_m = max(p - m, 0): -log(1 - p_m), its gradient through p
        p_neg = (p - margin).clamp(min=0)
        negative = -torch.log((1 - p_neg).clamp(min=1e-8))
    else:
        p_neg, negative = p, -F.logsigmoid(-x)  # -log(1 - p)
    if gamma_neg:
        negative = negative * p_neg.pow(gamma_neg)
    per_tag = targets * positive + (1 - targets) * negative
    return per_tag.mean(dim=1).sum()


def better(metric: str, new: float, best: float | None) -> bool:
    if best is None:
        return True
    return new < best if metric == "loss" else new > best


@dataclass
class LogWindow:
    """Loss and rows since the last log step (the loss stays on the device until it is logged)."""

    loss: torch.Tensor
    rows: int = 0
    steps: int = 0
    start: float = field(default_factory=time.perf_counter)

    def add(self, loss_sum: torch.Tensor, rows: int) -> None:
        self.loss += loss_sum
        self.rows += rows
        self.steps += 1

    def reset(self) -> None:
        self.loss.zero_()
        self.rows, self.steps, self.start = 0, 0, time.perf_counter()
