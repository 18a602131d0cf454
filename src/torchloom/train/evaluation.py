"""Validation inside training: every rank scores its share, all ranks get the same metrics."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np
import torch

from torchloom.data.loader import eval_batches, rank_range
from torchloom.evaluate.metrics import classification_metrics
from torchloom.manifest import Manifest
from torchloom.train.distributed import Dist, all_gather_objects
from torchloom.train.precision import autocast

if TYPE_CHECKING:
    from torchloom.train.parallelize import Parallel


def in_lockstep(batches: Iterator[dict], count: int) -> Iterator[dict]:
    """`batches`, then one-token filler batches (no labels) up to `count` in all."""
    n = 0
    for batch in batches:
        n += 1
        yield batch
    empty = torch.zeros(0, dtype=torch.int64)
    for _ in range(count - n):
        yield {"input_ids": torch.zeros(1, 1, dtype=torch.int64), "attention_mask": torch.ones(1, 1, dtype=torch.int64),
               "labels": empty, "index": empty}


@torch.inference_mode()
def predict_split(d: Dist, model: torch.nn.Module, manifest: Manifest, split: str, batch_size: int,
                  precision: str, par: Parallel | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """This rank's (probabilities, labels, row indices) for its contiguous share of `split`.

    par: how training parallelised `model`. Shares go to data-parallel ranks: under FSDP every rank runs
    as many forwards as the largest share (each one all-gathers), a pipeline's stages all run the whole
    split and its last stage returns it, the others nothing.
    """
    rank, world = (par.dp_rank, par.dp_size) if par is not None else (d.rank, d.world_size)
    batches = eval_batches(manifest, split, rank, world, batch_size)
    if par is not None and par.eval_in_lockstep:
        batches = in_lockstep(batches, math.ceil(rank_range(manifest.split(split).rows, world, 0)[1] / batch_size))
    was_training = model.training
    model.eval()
    probs, labels, index = [], [], []
    for batch in batches:
        ids, mask = batch["input_ids"].to(d.device), batch["attention_mask"].to(d.device)
        with autocast(d.device, precision):
            logits = par.logits(ids, mask) if par is not None else model(input_ids=ids, attention_mask=mask).logits
        if logits is None or not len(batch["labels"]):
            continue  # not the last pipeline stage, or a filler batch
        probs.append(torch.softmax(logits.float(), dim=-1).cpu().numpy())
        labels.append(batch["labels"].numpy())
        index.append(batch["index"].numpy())
    model.train(was_training)
    if not probs:
        return np.zeros((0, manifest.num_labels), np.float32), np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(probs), np.concatenate(labels), np.concatenate(index)


def evaluate(d: Dist, model: torch.nn.Module, manifest: Manifest, split: str, batch_size: int,
             precision: str, par: Parallel | None = None) -> dict:
    """Collective: every rank calls it and every rank returns the same metrics."""
    probs, labels, _ = predict_split(d, model, manifest, split, batch_size, precision, par)
    parts = all_gather_objects(d, (probs, labels))
    all_probs = np.concatenate([p for p, _ in parts])
    all_labels = np.concatenate([y for _, y in parts])
    return classification_metrics(all_probs, all_labels, manifest.labels)
