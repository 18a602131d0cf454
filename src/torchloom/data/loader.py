"""The training loader: each rank streams its share of a split from Parquet, with exact resume.

One epoch, for a split of N rows on W ranks with per-rank batch size b:

1. Order. The split's row groups, in manifest order, are permuted with a generator seeded by
   (seed, epoch) (not permuted when shuffle=False). Their rows, concatenated, are the epoch's
   sequence of N rows.
2. Shares. With N = q*W + rem, rank r takes a contiguous range of that sequence: q+1 rows when
   r < rem, else q. Every row is seen exactly once per epoch across ranks; nothing is dropped,
   padded or repeated. A rank reads only the row groups overlapping its range. N < W is an error.
3. Shuffle. A rank's range is cut into windows of `shuffle_buffer` rows (rounded down to a multiple
   of b, at least b); each window is read, then permuted with a generator seeded by
   (seed, epoch, rank, window). With length_bucketing the permuted window is stably sorted by
   length, cut into runs of b rows, and the full runs are permuted (the short last run, if any,
   stays last), so a batch holds rows of similar length but batches come in random order.
4. Batches. Every rank yields the same number of batches, ceil((q + (rem > 0)) / b), because DDP
   hangs otherwise. All batches have b rows except at the end of a rank's share: the last batch
   takes what is left; a rank with one row fewer than the largest, whose rows would fill its
   batches exactly, ends with batches of b-1 and 1 rows instead of b and an empty one. So the last
   one or two batches of some ranks are smaller. batch_size 1 cannot do this when shares are
   uneven (rem > 0) and is refused. The sizes depend only on (N, W, b, rank), so every rank knows
   every rank's sizes: `global_batch_rows(i)` is the number of rows in global batch i, which the
   trainer divides the summed loss by to weight every row equally without a collective.

Resume: `state_dict()` holds (epoch, batches_yielded) plus the configuration that fixes the order;
after `load_state_dict` the next iteration starts at the window holding the first unread row, and
yields exactly the batches the uninterrupted run would have.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from torchloom.data.readahead import ReadAhead
from torchloom.data.shards import RangeReader, RowGroup, Rows, collate, split_row_groups
from torchloom.errors import UserError
from torchloom.manifest import Manifest

Batch = dict[str, torch.Tensor]
# Distinct first words of the seeds, so the row-group order and the window orders never share a stream.
_GROUP_ORDER, _WINDOW_ORDER = 0x6F72, 0x776E
_AHEAD_WINDOWS = 2  # read-ahead depth, in windows
# Keys of state_dict() that must match for a resume to yield the same batches.
_RESUME_KEYS = ("split", "fingerprint", "rows", "world_size", "batch_size", "seed", "shuffle",
                "shuffle_buffer", "length_bucketing")


def rank_range(rows: int, world_size: int, rank: int) -> tuple[int, int]:
    """(start, count) of `rank`'s contiguous share of `rows` rows split over `world_size` ranks."""
    q, rem = divmod(rows, world_size)
    return rank * q + min(rank, rem), q + (rank < rem)


def batch_sizes(rows: int, world_size: int, batch_size: int, rank: int) -> np.ndarray:
    """Rank `rank`'s batch sizes for one epoch; the same count on every rank (see module doc)."""
    q, rem = divmod(rows, world_size)
    largest = q + (rem > 0)
    count = rank_range(rows, world_size, rank)[1]
    num_batches = math.ceil(largest / batch_size)
    sizes = np.full(num_batches, batch_size, np.int64)
    if num_batches:
        sizes[-1] = count - (num_batches - 1) * batch_size
        if sizes[-1] == 0:  # one row fewer than the largest rank, which has one row in its last batch
            sizes[-2:] = (batch_size - 1, 1)
    return sizes


@dataclass(frozen=True)
class _Plan:
    """What one rank reads in one epoch; plain data, so the read-ahead thread holds no loader."""

    uris: list[str]
    groups: list[RowGroup]  # in the epoch's order
    start: int  # the rank's range in the epoch's sequence
    rows: int
    window: int
    sizes: np.ndarray
    order_seed: tuple[int, ...] | None  # (seed, epoch, rank) when windows are shuffled
    batch_size: int
    length_bucketing: bool
    pad_id: int


def _window_order(plan: _Plan, window: int, lengths: np.ndarray) -> np.ndarray | None:
    n = len(lengths)
    rng = None
    order = None
    if plan.order_seed is not None:
        rng = np.random.default_rng([_WINDOW_ORDER, *plan.order_seed, window])
        order = rng.permutation(n)
    if plan.length_bucketing:
        order = np.arange(n) if order is None else order
        order = order[np.argsort(lengths[order], kind="stable")]
        full = n // plan.batch_size * plan.batch_size
        runs = order[:full].reshape(-1, plan.batch_size)
        if rng is not None:
            runs = runs[rng.permutation(len(runs))]
        order = np.concatenate([runs.ravel(), order[full:]])
    return order


def _windows(plan: _Plan, reader: RangeReader, first_window: int) -> Iterator[Rows]:
    for w in range(first_window, math.ceil(plan.rows / plan.window)):
        table = reader.read(plan.start + w * plan.window, plan.start + min(plan.rows, (w + 1) * plan.window))
        rows = Rows.from_table(table)
        order = _window_order(plan, w, rows.lengths())
        yield rows if order is None else Rows.from_table(table.take(order))


def _batches(plan: _Plan, first_batch: int) -> Iterator[Batch]:
    """Batches first_batch, first_batch+1, ... of the plan, reading from the window of the first."""
    reader = RangeReader(plan.uris, plan.groups)
    try:
        position = int(plan.sizes[:first_batch].sum())
        windows = _windows(plan, reader, position // plan.window)
        pending = next(windows).slice(position % plan.window, plan.window) if first_batch < len(plan.sizes) else None
        for size in plan.sizes[first_batch:]:
            while len(pending) < size:  # a batch crossing a window boundary
                pending = Rows.concat(pending, next(windows))
            yield collate(pending.slice(0, size), plan.pad_id)
            pending = pending.slice(size, len(pending))
    finally:
        reader.close()


class ShardedLoader:
    """Rank `rank`'s batches of one split, streamed from the manifest's Parquet shards.

    batch_size: rows per batch on this rank (the micro-batch). Iterating yields dicts of int64
    tensors: input_ids and attention_mask [B, L] padded with pad_id to the batch's longest row,
    labels [B], index [B] (each row's position in the split, manifest order).
    Iteration continues from the current position: call set_epoch(e + 1) after an epoch ends.
    """

    def __init__(self, manifest: Manifest, split: str, *, rank: int, world_size: int, batch_size: int,
                 seed: int, shuffle: bool = True, shuffle_buffer: int = 4096, length_bucketing: bool = False,
                 pad_id: int = 0):
        if world_size < 1 or not 0 <= rank < world_size:
            raise UserError(f"rank {rank} with world_size {world_size}: need 0 <= rank < world_size")
        if batch_size < 1:
            raise UserError(f"batch_size {batch_size}: must be >= 1")
        if seed < 0:
            raise UserError(f"seed {seed}: must be >= 0")
        self._uris, self._groups = split_row_groups(manifest, split)
        rows = manifest.split(split).rows
        if rows < world_size:
            raise UserError(
                f"split {split!r} of {manifest.root} has {rows} rows, fewer than the {world_size} workers;"
                " use fewer workers or more data"
            )
        if batch_size == 1 and rows % world_size:
            raise UserError(
                f"split {split!r} has {rows} rows over {world_size} workers, so ranks get unequal shares, and"
                " with batch_size 1 they cannot all get the same number of batches; use batch_size >= 2"
            )
        self.split, self.rank, self.world_size, self.batch_size = split, rank, world_size, batch_size
        self.seed, self.shuffle, self.length_bucketing, self.pad_id = seed, shuffle, length_bucketing, pad_id
        self.rows = rows
        self.fingerprint = manifest.fingerprint
        self.window = max(batch_size, shuffle_buffer // batch_size * batch_size)
        self._sizes = [batch_sizes(rows, world_size, batch_size, r) for r in range(world_size)]
        self._global_rows = np.sum(self._sizes, axis=0)
        self.epoch = 0
        self._batches_yielded = 0
        self._active: ReadAhead | None = None
        self._generation = 0  # bumped when an iteration is stopped, so it stops counting

    def __len__(self) -> int:
        return len(self._global_rows)

    @property
    def num_batches(self) -> int:
        return len(self._global_rows)

    @property
    def epoch_finished(self) -> bool:
        return self._batches_yielded >= self.num_batches

    def batch_sizes(self, rank: int | None = None) -> list[int]:
        """Batch sizes of `rank` (default: this rank) for every epoch."""
        return self._sizes[self.rank if rank is None else rank].tolist()

    def global_batch_rows(self, batch_index: int) -> int:
        """Rows in batch `batch_index` summed over all ranks."""
        return int(self._global_rows[batch_index])

    def set_epoch(self, epoch: int) -> None:
        """Go to the start of `epoch`; the same epoch as now keeps the position (e.g. after a resume)."""
        self._stop_active()
        if epoch != self.epoch:
            self.epoch = epoch
            self._batches_yielded = 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "batches_yielded": self._batches_yielded,
            "num_batches": self.num_batches,
            "epoch_finished": self.epoch_finished,
            "split": self.split,
            "fingerprint": self.fingerprint,
            "rows": self.rows,
            "world_size": self.world_size,
            "batch_size": self.batch_size,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "shuffle_buffer": self.window,
            "length_bucketing": self.length_bucketing,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state`; refuses one whose data or settings would give other batches."""
        mine = self.state_dict()
        missing = [k for k in (*_RESUME_KEYS, "epoch", "batches_yielded") if k not in state]
        if missing:
            raise UserError(f"loader state is missing {', '.join(missing)}; it is not from a torchloom loader")
        differ = [f"{k} {state[k]!r} (saved) vs {mine[k]!r} (now)" for k in _RESUME_KEYS if state[k] != mine[k]]
        if differ:
            raise UserError(
                "cannot resume the data loader: " + "; ".join(differ) +
                ". Resume with the same data and settings, or start a new run"
            )
        if not 0 <= state["batches_yielded"] <= self.num_batches:
            raise UserError(f"loader state: batches_yielded {state['batches_yielded']} is outside"
                            f" 0..{self.num_batches}; the checkpoint is damaged")
        self._stop_active()
        self.epoch = int(state["epoch"])
        self._batches_yielded = int(state["batches_yielded"])

    def _plan(self) -> _Plan:
        groups = self._groups
        if self.shuffle:
            order = np.random.default_rng([_GROUP_ORDER, self.seed, self.epoch]).permutation(len(groups))
            groups = [groups[i] for i in order]
        start, count = rank_range(self.rows, self.world_size, self.rank)
        return _Plan(self._uris, groups, start, count, self.window, self._sizes[self.rank],
                     (self.seed, self.epoch, self.rank) if self.shuffle else None, self.batch_size,
                     self.length_bucketing, self.pad_id)

    def __iter__(self) -> Iterator[Batch]:
        self._stop_active()
        generation = self._generation
        if self.epoch_finished:
            return
        ahead = ReadAhead(_batches(self._plan(), self._batches_yielded),
                          max_ahead=_AHEAD_WINDOWS * self.window // self.batch_size)
        self._active = ahead
        try:
            for batch in ahead:
                if generation != self._generation:
                    return
                self._batches_yielded += 1
                yield batch
        finally:
            ahead.close()
            if self._active is ahead:
                self._active = None

    def _stop_active(self) -> None:
        """Stop the running iteration, if any; it yields nothing more and no longer moves the position."""
        if getattr(self, "_active", None) is not None:  # __del__ may run on a half-built loader
            self._generation += 1
            self._active.close()
            self._active = None

    def __del__(self) -> None:
        self._stop_active()


def eval_batches(manifest: Manifest, split: str, rank: int, world_size: int, batch_size: int, *,
                 pad_id: int = 0) -> Iterator[Batch]:
    """Rank `rank`'s contiguous share of `split` in manifest order, unshuffled, for evaluation.

    Batches have batch_size rows, the last may be smaller, and ranks may get different numbers of
    batches (or none, when the split has fewer rows than ranks): evaluation needs no collective per
    batch. Same dict format as ShardedLoader.
    """
    if batch_size < 1:
        raise UserError(f"batch_size {batch_size}: must be >= 1")
    uris, groups = split_row_groups(manifest, split)
    start, count = rank_range(manifest.split(split).rows, world_size, rank)
    sizes = np.full(math.ceil(count / batch_size), batch_size, np.int64)
    if len(sizes):
        sizes[-1] = count - (len(sizes) - 1) * batch_size
    window = max(batch_size, 4096 // batch_size * batch_size)
    plan = _Plan(uris, groups, start, count, window, sizes, None, batch_size, False, pad_id)
    ahead = ReadAhead(_batches(plan, 0), max_ahead=_AHEAD_WINDOWS * window // batch_size)
    try:
        yield from ahead
    finally:
        ahead.close()
