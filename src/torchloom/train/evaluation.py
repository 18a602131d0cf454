"""Validation inside training: every rank scores its share, all ranks get the same metrics."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np
import pyarrow.parquet as pq
import torch

from torchloom.data.loader import eval_batches, rank_range
from torchloom.evaluate.metrics import classification_metrics, mean_by_text
from torchloom.manifest import Manifest
from torchloom.model.device import autocast
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


@torch.inference_mode()
def predict_split(d: Dist, model: torch.nn.Module, manifest: Manifest, split: str, batch_size: int,
                  precision: str, par: Parallel | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """This rank's (logits in float32, labels, row indices) for its contiguous share of `split`'s rows.

    par: how training parallelised `model`. Shares go to data-parallel ranks: under FSDP every rank runs
    as many forwards as the largest share (each one all-gathers), a pipeline's stages all run the whole
    split and its last stage returns it, the others nothing. Rows are windows of texts when the data was
    prepared with truncation chunks: to_documents turns them into one score per text.
    """
    rank, world = (par.dp_rank, par.dp_size) if par is not None else (d.rank, d.world_size)
    batches = eval_batches(manifest, split, rank, world, batch_size)
    if par is not None and par.eval_in_lockstep:
        batches = in_lockstep(batches, math.ceil(rank_range(manifest.split(split).rows, world, 0)[1] / batch_size))
    was_training = model.training
    model.eval()
    logits_out, labels, index = [], [], []
    for batch in batches:
        ids, mask = batch["input_ids"].to(d.device), batch["attention_mask"].to(d.device)
        with autocast(d.device, precision):
            logits = par.logits(ids, mask) if par is not None else model(input_ids=ids, attention_mask=mask).logits
        if logits is None or not len(batch["labels"]):
            continue  # not the last pipeline stage, or a filler batch
        logits_out.append(logits.float().cpu().numpy())
        labels.append(batch["labels"].numpy())
        index.append(batch["index"].numpy())
    model.train(was_training)
    if not logits_out:
        return np.zeros((0, manifest.num_labels), np.float32), np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(logits_out), np.concatenate(labels), np.concatenate(index)


def chunk_documents(manifest: Manifest, split: str) -> np.ndarray | None:
    """The text each row of `split` (file order) is a window of, numbered from 0, when it was prepared with
    truncation chunks (a text's windows are consecutive rows, chunk 0 first); else None."""
    if manifest.tokenizer.get("truncation") != "chunks":
        return None
    starts = [pq.read_table(manifest.shard_uri(shard), columns=["chunk"]).column("chunk").to_numpy() == 0
              for shard in manifest.split(split).shards]
    return np.cumsum(np.concatenate(starts) if starts else np.zeros(0, bool)) - 1


def softmax(logits: np.ndarray) -> np.ndarray:
    shifted = np.exp(logits - logits.max(axis=1, keepdims=True)) if len(logits) else logits
    return shifted / shifted.sum(axis=1, keepdims=True) if len(logits) else shifted


def to_documents(manifest: Manifest, split: str, logits: np.ndarray, labels: np.ndarray, index: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(probabilities, labels, row indices) per text: the softmax of the mean of its windows' logits with
    truncation chunks (index: its first window's row), else of each row's logits. The rows may come
    in any order (several ranks' shares)."""
    docs = chunk_documents(manifest, split)
    if docs is None or not len(logits):
        return softmax(logits.astype(np.float64)).astype(np.float32), labels, index
    doc = docs[index]
    mean, first = mean_by_text(logits, doc)
    starts = np.nonzero(np.r_[True, docs[1:] != docs[:-1]])[0]  # each text's first row
    return softmax(mean).astype(np.float32), labels[first], starts[doc[first]]


def evaluate(d: Dist, model: torch.nn.Module, manifest: Manifest, split: str, batch_size: int,
             precision: str, par: Parallel | None = None) -> dict:
    """Collective: every rank calls it and every rank returns the same metrics (one row per text)."""
    logits, labels, index = predict_split(d, model, manifest, split, batch_size, precision, par)
    parts = all_gather_objects(d, (logits, labels, index))
    probs, labels, _ = to_documents(manifest, split, *(np.concatenate([part[i] for part in parts]) for i in range(3)))
    return classification_metrics(probs, labels, manifest.labels)
