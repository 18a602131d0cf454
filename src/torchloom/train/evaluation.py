"""Validation inside training: every rank scores its share, all ranks get the same metrics."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np
import torch

from torchloom import tag_scoring
from torchloom.data.loader import eval_batches, rank_range
from torchloom.data.packing import pack_batch
from torchloom.data.texts import to_documents
from torchloom.manifest import Manifest
from torchloom.model.forward import prepared_logits
from torchloom.scoring import classification_metrics
from torchloom.train.distributed import Dist, all_gather_objects

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


def predict_split(d: Dist, model: torch.nn.Module, manifest: Manifest, split: str, batch_size: int,
                  precision: str, par: Parallel | None = None, packing: bool = False
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """This rank's (logits in float32, labels, row indices) for its contiguous share of `split`'s rows.

    par: how training parallelised `model`. Shares go to data-parallel ranks: under FSDP every rank runs
    as many forwards as the largest share (each one all-gathers), a pipeline's stages all run the whole
    split and its last stage returns it, the others nothing. Rows are windows of texts when the data was
    prepared with truncation chunks: data.texts.to_documents turns them into one score per text. packing: each
    batch packed (train.packing), the same logits.
    """
    rank, world = (par.dp_rank, par.dp_size) if par is not None else (d.rank, d.world_size)
    batches = eval_batches(manifest, split, rank, world, batch_size)
    if packing:
        batches = map(pack_batch, batches)
    if par is not None and par.eval_in_lockstep:
        batches = in_lockstep(batches, math.ceil(rank_range(manifest.split(split).rows, world, 0)[1] / batch_size))
    return prepared_logits(model, batches, d.device, precision, manifest.num_labels,
                           par.logits if par is not None else None)


def evaluate(d: Dist, model: torch.nn.Module, manifest: Manifest, split: str, batch_size: int,
             precision: str, par: Parallel | None = None, packing: bool = False) -> dict:
    """Collective: every rank calls it and every rank returns the same metrics (one row per text)."""
    logits, labels, index = predict_split(d, model, manifest, split, batch_size, precision, par, packing)
    parts = all_gather_objects(d, (logits, labels, index))
    probs, labels, _ = to_documents(manifest, split, *(np.concatenate([part[i] for part in parts]) for i in range(3)))
    if manifest.multi_label:  # at 0.5: the thresholds are chosen once training is done (evaluate/run.py)
        return tag_scoring.evaluation(probs, labels, manifest.labels)
    return classification_metrics(probs, labels, manifest.labels)
