"""Held-out rows for scoring, unshuffled and in file order: a rank's contiguous share of a split (in-training
validation), or a range of it given by its first row and count (a Spark task's share of evaluate's split,
evaluate/spark_scoring.py). A range that starts at a multiple of the batch size yields the very batches one process
scoring the whole split yields there, so the logits are the same whoever computes them."""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

from torchloom.data.loader import Batch, rank_range
from torchloom.data.readahead import ReadAhead
from torchloom.data.shards import RangeReader, RowGroup, Rows, collate, split_row_groups
from torchloom.errors import UserError
from torchloom.manifest import Manifest


def _eval_batches(uris: list[str], groups: list[RowGroup], start: int, sizes: np.ndarray, pad_id: int
                  ) -> Iterator[Batch]:
    reader = RangeReader(uris, groups, [(start, start + int(sizes.sum()))])
    try:
        for size in sizes:
            yield collate(Rows.from_table(reader.read(start, start + int(size))), pad_id)
            start += int(size)
    finally:
        reader.close()


def range_batches(manifest: Manifest, split: str, start: int, count: int, batch_size: int, *,
                  pad_id: int = 0) -> Iterator[Batch]:
    """Rows [start, start + count) of `split`, in batches of batch_size rows (the last may be smaller)."""
    if batch_size < 1:
        raise UserError(f"batch_size {batch_size}: must be >= 1")
    rows = manifest.split(split).rows
    if start < 0 or count < 0 or start + count > rows:
        raise ValueError(f"rows [{start}, {start + count}) of split {split!r}: it has {rows}")
    uris, groups = split_row_groups(manifest, split)
    sizes = np.full(math.ceil(count / batch_size), batch_size, np.int64)
    if len(sizes):
        sizes[-1] = count - (len(sizes) - 1) * batch_size
    ahead = ReadAhead(_eval_batches(uris, groups, start, sizes, pad_id), max_ahead=max(1, 4096 // batch_size))
    try:
        yield from ahead
    finally:
        ahead.close()


def eval_batches(manifest: Manifest, split: str, rank: int, world_size: int, batch_size: int, *,
                 pad_id: int = 0) -> Iterator[Batch]:
    """Rank `rank`'s contiguous share of `split` in manifest order, unshuffled, for evaluation.

    Batches have batch_size rows, the last may be smaller, and ranks may get different numbers of
    batches (or none, when the split has fewer rows than ranks): evaluation needs no collective per
    batch. Same dict format as ShardedLoader.
    """
    start, count = rank_range(manifest.split(split).rows, world_size, rank)
    yield from range_batches(manifest, split, start, count, batch_size, pad_id=pad_id)
