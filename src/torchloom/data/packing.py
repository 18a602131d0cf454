"""Packed batches (train.packing): a padded micro-batch's sequences laid end to end in fewer rows.

A padded batch of B rows is L wide (its longest row), so a batch of short texts with one long one is mostly
padding. Packed, its sequences fill rows of the same width L, first-fit by decreasing length: each row holds
several whole sequences, none is ever cut, and the rows (R <= B) are what the model computes. Position ids
restart at 0 for each sequence and `sequence_ids` number the sequences within a row (1, 2, ...; 0 for the
padding at a row's end), from which model/packing.py builds the attention mask that keeps each sequence to
itself. Labels, index and the order of the sequences do not change: `cls_index` is where each sequence's first
token (BERT's [CLS]) lies in the flattened [R * L] tokens, so the logits come back one per sequence, in order.
A batch in which no two sequences share a row (R = B: similar lengths, as train.length_bucketing makes them, or
texts that fill max_length) stays padded: packed, it would compute as many tokens behind a mask.

Packing changes the tensors' shape only, never the rows: the loader yields as many micro-batches, with the same
rows, as unpacked; the loss and its normalisation are per sequence, as before.
"""

from __future__ import annotations

import numpy as np
import torch

Batch = dict[str, torch.Tensor]
PACKED_KEYS = ("position_ids", "sequence_ids", "cls_index", "lengths")


def first_fit(lengths: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """(row, offset) of each sequence packed first-fit by decreasing length into rows of `width` tokens.

    First-fit decreasing uses at most 11/9 of the optimal number of rows plus one; for short texts next to a long
    one it nearly always reaches the optimum. Ties keep the input order (a stable sort), so the layout is a
    function of the lengths alone."""
    row, offset = np.zeros(len(lengths), np.int64), np.zeros(len(lengths), np.int64)
    free = np.zeros(0, np.int64)  # tokens left in each row so far
    for i in np.argsort(-lengths, kind="stable"):
        fits = np.flatnonzero(free >= lengths[i])
        r = int(fits[0]) if len(fits) else len(free)
        if r == len(free):
            free = np.append(free, width)
        row[i], offset[i] = r, width - free[r]
        free[r] -= lengths[i]
    return row, offset


def pack_batch(batch: Batch, pad_id: int = 0) -> Batch:
    """The packed form of a padded batch (data.shards.collate's): input_ids and attention_mask [R, L] (the mask
    marks real tokens, so tokens/s and padding count what the model computes), position_ids and sequence_ids
    [R, L], cls_index and lengths [B], labels and index [B] unchanged. Right-padded rows are assumed (collate's)."""
    mask = batch["attention_mask"].numpy().astype(bool)
    ids = batch["input_ids"].numpy()
    lengths = mask.sum(axis=1).astype(np.int64)
    width = ids.shape[1]
    row, offset = first_fit(lengths, width)
    rows = int(row.max(initial=-1)) + 1
    if rows == len(lengths):  # nothing shares a row (a length-bucketed batch, long texts): padded is as cheap
        return batch
    packed_ids = np.full((rows, width), pad_id, np.int64)
    positions = np.zeros((rows, width), np.int64)
    sequence_ids = np.zeros((rows, width), np.int64)
    # Token t of sequence i goes to flat position row[i] * width + offset[i] + t, in one scatter for the batch.
    starts = row * width + offset
    within = np.arange(width)[None, :]
    target = (starts[:, None] + within)[mask]
    packed_ids.reshape(-1)[target] = ids[mask]
    positions.reshape(-1)[target] = np.broadcast_to(within, ids.shape)[mask]
    # A row's sequences numbered 1, 2, ... in offset order: their rank among the row's sequences.
    order = np.lexsort((offset, row))
    number = np.empty(len(order), np.int64)
    number[order] = np.arange(len(order)) - np.searchsorted(row[order], row[order])
    sequence_ids.reshape(-1)[target] = np.repeat(number + 1, lengths)
    return {
        "input_ids": torch.from_numpy(packed_ids),
        "attention_mask": torch.from_numpy((sequence_ids > 0).astype(np.int64)),
        "position_ids": torch.from_numpy(positions),
        "sequence_ids": torch.from_numpy(sequence_ids),
        "cls_index": torch.from_numpy(starts),
        "lengths": torch.from_numpy(lengths),
        "labels": batch["labels"],
        "index": batch["index"],
    }


def is_packed(batch: Batch) -> bool:
    return "cls_index" in batch
