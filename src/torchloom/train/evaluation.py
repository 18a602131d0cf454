"""Validation inside training: every rank scores its share, all ranks get the same metrics.

The metrics are reduced, not gathered: each rank turns its texts' probabilities into sums (scoring.class_sums,
tag_scoring.evaluation_sums: a confusion matrix, the summed loss, calibration bins, per-tag counts) and one
all-reduce of that vector gives every rank the totals. What crosses between ranks is the size of the label set, not
of the split (10 M val rows were ~0.8 GB of logits per rank for 20 classes). Only a text whose windows (truncation
chunks) lie in two ranks' shares travels as its rows' summed logits: at most one at each edge of a share. ROC AUC is
not a sum and is left to evaluate/ (None here); no training decision reads it."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np
import torch

from torchloom import tag_scoring
from torchloom.data.eval_rows import eval_batches
from torchloom.data.loader import rank_range
from torchloom.data.packing import pack_batch
from torchloom.data.texts import chunk_documents, to_documents
from torchloom.manifest import Manifest
from torchloom.model.forward import prepared_logits
from torchloom.scoring import class_sums, metrics_from_sums, text_scores
from torchloom.train.distributed import Dist, all_gather_objects, all_reduce_array

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
    return reduced_metrics(d, manifest, split, logits, labels, index)


def reduced_metrics(d: Dist, manifest: Manifest, split: str, logits: np.ndarray, labels: np.ndarray,
                    index: np.ndarray) -> dict:
    """Collective: the metrics of `split` from every rank's (logits, labels, row indices) of its rows, by one
    all-reduce of their sums (the module's docstring); the same numbers as of all the rows in one process."""
    probs, labels = own_texts(d, manifest, split, logits, labels, index)
    if manifest.multi_label:
        return tag_metrics(d, manifest, probs, labels)
    return metrics_from_sums(all_reduce_array(d, class_sums(probs, labels, manifest.num_labels)), manifest.labels)


def tag_metrics(d: Dist, manifest: Manifest, probs: np.ndarray, masks: np.ndarray) -> dict:
    """Collective: a multi-label split's metrics at the thresholds export would choose on it (tag_scoring's rule,
    the same thresholds as choose_thresholds on all the rows), so the checkpoint kept and early stopping read what
    ships, not a fixed 0.5 that a rare tag's sigmoid seldom reaches. Two all-reduces: the rule's counts at every
    threshold of its grid, then the metrics' sums at the thresholds chosen (with the tags' own and without)."""
    k = manifest.num_labels
    at_least_one = not manifest.tags.get("keep_untagged", False)
    truth = tag_scoring.multi_hot(masks, k)
    grid = all_reduce_array(d, tag_scoring.grid_sums(probs.reshape(-1, k), truth, at_least_one))
    chosen, micro_global = tag_scoring.thresholds_from_grid(grid, k, at_least_one=at_least_one)
    plain = tag_scoring.Thresholds(chosen.default, at_least_one=at_least_one)
    options = [chosen, plain] if chosen.per_label else [chosen]
    sums = all_reduce_array(d, np.concatenate([tag_scoring.evaluation_sums(probs.reshape(-1, k), masks, k, t)
                                               for t in options]))
    parts = np.split(sums, len(options))
    if chosen.per_label:
        with_own = tag_scoring.metrics_from_sums(parts[0], manifest.labels)["micro_f1"]
        if tag_scoring.keep_own(chosen, with_own, micro_global) is not chosen:
            return tag_scoring.evaluation_from_sums(parts[1], manifest.labels, plain)
    return tag_scoring.evaluation_from_sums(parts[0], manifest.labels, chosen)


def own_texts(d: Dist, manifest: Manifest, split: str, logits: np.ndarray, labels: np.ndarray, index: np.ndarray
              ) -> tuple[np.ndarray, np.ndarray]:
    """(probabilities in float32, labels) of the texts this rank counts: each whole text among its rows, and each
    text split between ranks' shares (truncation chunks) on the lowest rank holding a part of it, scored from the
    parts' summed logits, which is all that is gathered."""
    docs = chunk_documents(manifest, split)
    if docs is None:
        return to_documents(manifest, split, logits, labels, index)[:2]
    doc = docs[index]
    windows = np.bincount(docs, minlength=int(docs.max()) + 1 if len(docs) else 0)
    here = np.bincount(doc, minlength=len(windows))
    whole = here[doc] == windows[doc]
    probs, text_labels, _ = to_documents(manifest, split, logits[whole], labels[whole], index[whole])
    parts = {int(t): (logits[doc == t].astype(np.float64).sum(axis=0), int(here[t]), labels[doc == t][0])
             for t in np.unique(doc[~whole])}
    split_texts: dict[int, list] = {}
    for rank, theirs in enumerate(all_gather_objects(d, parts)):
        for t, (summed, count, label) in theirs.items():
            split_texts.setdefault(t, [rank, np.zeros_like(summed), 0, label])
            split_texts[t][1] += summed
            split_texts[t][2] += count
    mine = [(summed / count, label) for rank, summed, count, label in split_texts.values() if rank == d.rank]
    if mine:
        merged = text_scores(np.stack([m for m, _ in mine]), multi_label=manifest.multi_label).probs
        probs = np.concatenate([probs, merged.astype(np.float32)])
        text_labels = tag_scoring.concat_labels([text_labels,
                                                 *(np.asarray(label, np.int64)[None] for _, label in mine)])
    return probs, text_labels


def eval_summary(metrics: dict | None) -> dict:
    """The validation numbers a result and a tracker keep: loss, accuracy, macro-F1."""
    return {k: metrics[k] for k in ("loss", "accuracy", "macro_f1") if k in metrics} if metrics else {}


def eval_record(metrics: dict, step: int, epoch: float) -> dict:
    """metrics.jsonl's line of one validation; a tagger's adds micro-F1 and the thresholds it was scored at
    (chosen on val as export chooses them: the global one and how many tags got their own)."""
    record = {"kind": "eval", "step": step, "epoch": epoch, **eval_summary(metrics),
              "weighted_f1": metrics["weighted_f1"]}
    if "thresholds" in metrics:
        record.update(micro_f1=metrics["micro_f1"], threshold=metrics["thresholds"]["default"],
                      own_thresholds=len(metrics["thresholds"]["per_label"]))
    return record
