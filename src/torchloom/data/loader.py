"""The training loader: every rank streams its slice of the same global batches from Parquet.

The order of an epoch depends on (data, seed, epoch, G, shuffle settings) only, never on the number
of ranks W, so a run can stop on W ranks and go on with any other W that divides G, yielding the
same global batches as row ids. G is the global batch (train.batch_size: rows per optimizer step).
For a split of N rows, N = q*G + rem:

1. Order. The split's row groups, in manifest order, are permuted with a generator seeded by
   (seed, epoch) (kept in order when shuffle=False). Their rows, concatenated, are the epoch's
   sequence.
2. Partitions. That sequence is cut into G contiguous partitions (canonical, as MosaicML Streaming
   calls its fixed node count, but fixed by G). Partition p holds q rows, plus one when
   floor((p+1)*rem/G) > floor(p*rem/G): the rem extra rows are spread evenly, so every block of
   G/W consecutive partitions holds floor or ceil of rem/W of them, whatever W.
3. Global batches. Global batch i is position i of every partition, in partition order: q full
   batches of G rows, then (rem > 0) one of rem rows, the partitions' extra rows. Rank r of W
   takes partitions [r*G/W, (r+1)*G/W), i.e. a contiguous G/W slice of every global batch, and
   reads only those partitions' rows: no rank reads another's data.
4. Shuffle. Positions are cut into windows of m = max(1, shuffle_buffer // G) (so shuffle_buffer
   rows over all ranks are held at once, shuffle_buffer / W per rank); a partition's rows at the
   full positions of window w are permuted with a generator seeded by (seed, epoch, partition, w).
   With length_bucketing they are then stably sorted by length, and one permutation seeded by
   (seed, epoch, w), shared by all partitions, orders the positions: a global batch takes the k-th
   shortest row of every partition's window, so its rows have similar lengths, in random order
   of k. The extra rows stay last.
5. Micro-batches. A rank's slice of a global batch (c rows; G/W for a full batch) is cut into
   accum = G / (W * batch_size) micro-batches, of rank_range(c, accum, j) rows: every rank yields
   the same number of micro-batches (DDP and FSDP hang otherwise), all of batch_size rows except in
   the last, partial global batch; where a rank has fewer rows than micro-batches there, the empty
   ones are placeholders that add nothing (see shards.collate). Sizes depend only on
   (N, G, W, batch_size, rank): `global_batch_rows(i)` is the rows of micro-batch i summed over
   all ranks, which the trainer divides the summed loss by to weight every row equally.

Resume is O(1): the state is one global cursor (epoch, global batches done) plus what fixes the
order. A loader of any W that divides G starts at the window holding the next global batch: it
reads at most one window (its partitions' m rows each) it does not yield, wherever in the epoch
the cursor is. A change of G, seed, shuffle settings or data is refused with one line.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from torchloom.data.packing import pack_batch
from torchloom.data.readahead import ReadAhead
from torchloom.data.shards import RangeReader, RowGroup, Rows, collate, pad_to_multiple, split_row_groups
from torchloom.errors import UserError
from torchloom.manifest import Manifest

Batch = dict[str, torch.Tensor]
# Distinct first words of the seeds, so the row-group order and the window orders never share a stream.
_GROUP_ORDER, _WINDOW_ORDER, _POSITION_ORDER = 0x6F72, 0x776E, 0x706F
_AHEAD_WINDOWS = 2  # read-ahead depth, in windows
ORDER_VERSION = 2  # the global order above; version 1 (per-rank shares) depended on the world size
# Keys of state_dict() that must match for a resume to yield the same global batches.
_RESUME_KEYS = ("split", "fingerprint", "rows", "global_batch", "seed", "shuffle", "shuffle_buffer",
                "length_bucketing")


def rank_range(rows: int, world_size: int, rank: int) -> tuple[int, int]:
    """(start, count) of `rank`'s contiguous share of `rows` rows split over `world_size` ranks."""
    q, rem = divmod(rows, world_size)
    return rank * q + min(rank, rem), q + (rank < rem)


def spread(n: int, parts: int, p: int) -> int:
    """Part p's share of n items spread evenly over `parts` (floor((p+1)n/parts) - floor(pn/parts)): any
    run of k consecutive parts gets floor or ceil of k*n/parts, so every divisor's blocks are even too."""
    return (p + 1) * n // parts - p * n // parts


def partition_range(rows: int, parts: int, p: int) -> tuple[int, int]:
    """(start, count) of partition p of `rows` rows cut into `parts`, the remainder spread evenly."""
    q, rem = divmod(rows, parts)
    return p * q + p * rem // parts, q + spread(rem, parts, p)


def global_steps(rows: int, global_batch: int) -> int:
    """Global batches (optimizer steps) in one epoch."""
    return math.ceil(rows / global_batch)


def rank_step_rows(rows: int, global_batch: int, world_size: int, rank: int) -> np.ndarray:
    """Rows of each global batch that rank `rank` of `world_size` takes."""
    q, rem = divmod(rows, global_batch)
    out = np.full(global_steps(rows, global_batch), global_batch // world_size, np.int64)
    if rem:
        out[-1] = spread(rem, world_size, rank)  # the partial batch's rows: its partitions' extra rows
    return out


def batch_sizes(rows: int, world_size: int, batch_size: int, rank: int, global_batch: int | None = None) -> np.ndarray:
    """Rank `rank`'s micro-batch sizes for one epoch (0: a placeholder); the same count on every rank."""
    global_batch = global_batch or batch_size * world_size
    accum = global_batch // (world_size * batch_size)
    per_step = rank_step_rows(rows, global_batch, world_size, rank)
    return np.array([rank_range(int(c), accum, j)[1] for c in per_step for j in range(accum)], np.int64)


@dataclass(frozen=True)
class _Epoch:
    """What one rank reads in one epoch; plain data, so the read-ahead thread holds no loader."""

    uris: list[str]
    groups: list[RowGroup]  # in the epoch's order
    parts: list[tuple[int, int, int]]  # (partition number, start, count) of this rank's partitions
    full_steps: int  # q: global batches with a row from every partition
    steps: int  # q, plus 1 when the split does not divide into global batches
    window: int  # m positions
    accum: int
    seed: tuple[int, int] | None  # (seed, epoch) when shuffled
    length_bucketing: bool
    pad_id: int


def _positions(e: _Epoch, w: int, full: int, lengths: list[np.ndarray] | None) -> np.ndarray:
    """[full, partitions]: each partition's row (index into its part of window w) at each full position."""
    cols = []
    for i, (p, _, _) in enumerate(e.parts):
        order = np.arange(full)
        if e.seed is not None:
            order = np.random.default_rng([_WINDOW_ORDER, *e.seed, p, w]).permutation(full)
        if lengths is not None:
            order = order[np.argsort(lengths[i][order], kind="stable")]
        cols.append(order)
    matrix = np.stack(cols, axis=1)
    if lengths is not None and e.seed is not None:
        matrix = matrix[np.random.default_rng([_POSITION_ORDER, *e.seed, w]).permutation(full)]
    return matrix


def _window_rows(e: _Epoch, reader: RangeReader, w: int) -> tuple[Rows, np.ndarray]:
    """This rank's rows of window w in position-major order, and how many rows each position holds."""
    lo = w * e.window
    full = max(0, min(lo + e.window, e.full_steps) - lo)  # full positions in the window
    tail = e.full_steps < e.steps and lo <= e.full_steps < lo + e.window  # the partial batch is in it
    tables, lengths, starts, extra = [], [], [], []
    offset = 0
    for slot, (_, start, count) in enumerate(e.parts):
        n = full + (tail and count > e.full_steps)
        starts.append(offset)
        if n:
            table = reader.read(start + lo, start + lo + n, slot)
            tables.append(table)
        if e.length_bucketing:
            lengths.append(np.diff(table.column("input_ids").combine_chunks().offsets.to_numpy())[:full]
                           if n else np.zeros(0, np.int64))
        if n > full:
            extra.append(offset + full)
        offset += n
    take = _positions(e, w, full, lengths if e.length_bucketing else None) + np.array(starts, np.int64)
    take = np.concatenate([take.ravel(), np.array(extra, np.int64)])
    sizes = np.array([len(e.parts)] * full + ([len(extra)] if tail else []), np.int64)
    if not tables:  # only the partial batch, with no extra row on this rank
        return Rows(np.zeros(0, np.int32), np.zeros(1, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)), sizes
    return Rows.from_table(pa.concat_tables(tables).take(pa.array(take, pa.int64()))), sizes


def _micro_batches(e: _Epoch, first_step: int) -> Iterator[Batch]:
    """The micro-batches of global batches first_step, first_step+1, ...: whole windows read, one at a time."""
    reader = RangeReader(e.uris, e.groups, [(start, start + count) for _, start, count in e.parts])
    try:
        for w in range(first_step // e.window, math.ceil(e.steps / e.window)):
            rows, sizes = _window_rows(e, reader, w)
            ends = np.cumsum(sizes)
            for k, (end, size) in enumerate(zip(ends, sizes)):
                if w * e.window + k < first_step:
                    continue
                step = rows.slice(int(end - size), int(end))
                for j in range(e.accum):
                    a, n = rank_range(int(size), e.accum, j)
                    yield collate(step.slice(a, a + n), e.pad_id)
    finally:
        reader.close()


class ShardedLoader:
    """Rank `rank`'s micro-batches of one split, streamed from the manifest's Parquet shards.

    global_batch: G, rows per optimizer step over all ranks (default batch_size * world_size);
    world_size must divide it. batch_size: rows per micro-batch on this rank; it must divide G /
    world_size, and `accum` = G / (world_size * batch_size) micro-batches make a global batch.
    Iterating yields dicts of int64 tensors: input_ids and attention_mask [B, L] padded with pad_id
    to the batch's longest row, labels [B], index [B] (each row's position in the split, manifest
    order; -1 in a placeholder). Iteration continues from the current position: call
    set_epoch(e + 1) after an epoch ends.
    """

    def __init__(self, manifest: Manifest, split: str, *, rank: int, world_size: int, batch_size: int,
                 seed: int, global_batch: int | None = None, shuffle: bool = True, shuffle_buffer: int = 4096,
                 length_bucketing: bool = False, pad_id: int = 0, pin_memory: bool = False, pad_multiple: int = 1,
                 packing: bool = False):
        if world_size < 1 or not 0 <= rank < world_size:
            raise UserError(f"rank {rank} with world_size {world_size}: need 0 <= rank < world_size")
        if batch_size < 1:
            raise UserError(f"batch_size {batch_size}: must be >= 1")
        if seed < 0:
            raise UserError(f"seed {seed}: must be >= 0")
        global_batch = global_batch or batch_size * world_size
        if global_batch % (world_size * batch_size):
            raise UserError(f"global batch {global_batch}: must be a multiple of {world_size} workers x micro-batch"
                            f" {batch_size}; choose workers that divide the global batch")
        self._uris, self._groups = split_row_groups(manifest, split)
        rows = manifest.split(split).rows
        if rows < world_size:
            raise UserError(
                f"split {split!r} of {manifest.root} has {rows} rows, fewer than the {world_size} workers;"
                " use fewer workers or more data"
            )
        self.split, self.rank, self.world_size, self.batch_size = split, rank, world_size, batch_size
        self.global_batch, self.accum = global_batch, global_batch // (world_size * batch_size)
        self.seed, self.shuffle, self.length_bucketing, self.pad_id = seed, shuffle, length_bucketing, pad_id
        self.shuffle_buffer = shuffle_buffer
        self.pin_memory = pin_memory  # CUDA: the read-ahead thread pins each batch (see __iter__)
        self.pad_multiple = pad_multiple  # train.compile: widths padded to a multiple of this
        self.packing = packing  # train.packing: each micro-batch packed (data/packing.py), the same rows
        self.rows = rows
        self.fingerprint = manifest.fingerprint
        self.window = max(1, shuffle_buffer // global_batch)  # positions per window
        self.num_steps = global_steps(rows, global_batch)
        # Batch sizes come from a formula, not a table: nothing here grows with the rows.
        self._rem = rows % global_batch
        per = global_batch // world_size
        self._parts = [(p, *partition_range(rows, global_batch, p)) for p in range(rank * per, (rank + 1) * per)]
        self.epoch = 0
        self._batches_yielded = 0
        self._active: ReadAhead | None = None
        # the next epoch's read-ahead, started when this epoch's last batch is handed out, so that its first window
        # is read while the trainer validates and checkpoints: ((epoch, batches_yielded) it starts at, the reader)
        self._next: tuple[tuple[int, int], ReadAhead] | None = None
        self.last_epoch: int | None = None  # the trainer's last epoch; None: nothing is read past the current one
        self._generation = 0  # bumped when an iteration is stopped, so it stops counting

    def __len__(self) -> int:
        return self.num_batches

    @property
    def num_batches(self) -> int:
        """Micro-batches per epoch on every rank: num_steps * accum."""
        return self.num_steps * self.accum

    @property
    def epoch_finished(self) -> bool:
        return self._batches_yielded >= self.num_batches

    def batch_sizes(self, rank: int | None = None) -> list[int]:
        """Micro-batch sizes of `rank` (default: this rank) for every epoch; 0 is a placeholder."""
        rank = self.rank if rank is None else rank
        return batch_sizes(self.rows, self.world_size, self.batch_size, rank, self.global_batch).tolist()

    def global_batch_rows(self, batch_index: int) -> int:
        """Rows in micro-batch `batch_index` summed over all ranks."""
        step, j = divmod(batch_index, self.accum)
        if not 0 <= step < self.num_steps:
            raise IndexError(f"micro-batch {batch_index} of {self.num_batches}")
        if step < self.rows // self.global_batch or not self._rem:
            return self.batch_size * self.world_size
        return sum(rank_range(spread(self._rem, self.world_size, r), self.accum, j)[1]
                   for r in range(self.world_size))

    def set_epoch(self, epoch: int) -> None:
        """Go to the start of `epoch`; the same epoch as now keeps the position (e.g. after a resume)."""
        self._stop_active()
        if epoch != self.epoch:
            self.epoch = epoch
            self._batches_yielded = 0

    def state_dict(self) -> dict[str, Any]:
        """The global cursor (epoch, steps_done: global batches done) and what fixes the order.

        batches_yielded, world_size and batch_size describe this rank; a resume does not need them
        to match.
        """
        return {
            "order": ORDER_VERSION,
            "epoch": self.epoch,
            "steps_done": self._batches_yielded // self.accum,
            "num_steps": self.num_steps,
            "epoch_finished": self.epoch_finished,
            "split": self.split,
            "fingerprint": self.fingerprint,
            "rows": self.rows,
            "global_batch": self.global_batch,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "shuffle_buffer": self.shuffle_buffer,
            "length_bucketing": self.length_bucketing,
            "batches_yielded": self._batches_yielded,
            "world_size": self.world_size,
            "batch_size": self.batch_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state`, at any world size; refuses one whose data or settings give other batches."""
        if state.get("order") != ORDER_VERSION and "batches_yielded" in state:
            raise UserError("loader state: written by an older torchloom whose data order depended on the number"
                            " of workers; it cannot be resumed by this version; start a new run")
        mine = self.state_dict()
        missing = [k for k in (*_RESUME_KEYS, "epoch", "steps_done") if k not in state]
        if missing:
            raise UserError(f"loader state is missing {', '.join(missing)}; it is not from a torchloom loader")
        differ = [f"{k} {state[k]!r} (saved) vs {mine[k]!r} (now)" for k in _RESUME_KEYS if state[k] != mine[k]]
        if differ:
            raise UserError(
                "cannot resume the data loader: " + "; ".join(differ) +
                ". Resume with the same data and settings, or start a new run"
            )
        steps = state["steps_done"]
        if not 0 <= steps <= self.num_steps:
            raise UserError(f"loader state: steps_done {steps} is outside 0..{self.num_steps}; the checkpoint"
                            " is damaged")
        saved_accum = 1
        if state.get("world_size") and state.get("batch_size"):
            saved_accum = max(1, state["global_batch"] // (state["world_size"] * state["batch_size"]))
        within = int(state.get("batches_yielded", steps * saved_accum)) - steps * saved_accum
        if within and (state.get("world_size"), state.get("batch_size")) != (self.world_size, self.batch_size):
            raise UserError(f"loader state: stopped {within} micro-batches into a global batch, which only the same"
                            " workers and micro-batch size can continue; resume from a checkpoint")
        self.close()
        self.epoch = int(state["epoch"])
        self._batches_yielded = int(steps) * self.accum + within

    def _epoch(self, epoch: int) -> _Epoch:
        groups = self._groups
        if self.shuffle:
            order = np.random.default_rng([_GROUP_ORDER, self.seed, epoch]).permutation(len(groups))
            groups = [groups[i] for i in order]
        return _Epoch(self._uris, groups, self._parts, self.rows // self.global_batch, self.num_steps, self.window,
                      self.accum, (self.seed, epoch) if self.shuffle else None, self.length_bucketing,
                      self.pad_id)

    def _read_ahead(self, epoch: int, first_step: int) -> ReadAhead:
        """A thread reading `epoch`'s micro-batches from global batch `first_step` on."""
        batches = _micro_batches(self._epoch(epoch), first_step)
        if self.pin_memory or self.pad_multiple > 1 or self.packing:
            device = torch.cuda.current_device() if self.pin_memory else None  # the rank's GPU, set in its thread
            batches = _for_the_device(batches, device, self.pad_multiple, self.pad_id, self.packing)
        return ReadAhead(batches, max_ahead=_AHEAD_WINDOWS * self.window * self.accum)

    def _read_next_epoch(self) -> None:
        """This epoch's last batch is out: start reading the next epoch (the trainer goes on to it)."""
        if self._next is None and self.last_epoch is not None and self.epoch < self.last_epoch:
            self._next = ((self.epoch + 1, 0), self._read_ahead(self.epoch + 1, 0))

    def _take_next(self) -> ReadAhead | None:
        """The read-ahead started for the current position, if one was; any other is stopped."""
        waiting, self._next = self._next, None
        if waiting is None:
            return None
        if waiting[0] == (self.epoch, self._batches_yielded):
            return waiting[1]
        waiting[1].close()
        return None

    def __iter__(self) -> Iterator[Batch]:
        self._stop_active()
        generation = self._generation
        if self.epoch_finished:
            return
        first_step, within = divmod(self._batches_yielded, self.accum)
        ahead = self._take_next() or self._read_ahead(self.epoch, first_step)
        self._active = ahead
        try:
            for n, batch in enumerate(ahead):
                if n < within:  # mid-step: the micro-batches of this global batch already yielded
                    continue
                if generation != self._generation:
                    return
                self._batches_yielded += 1
                if self.epoch_finished:
                    self._read_next_epoch()
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

    def close(self) -> None:
        """Stop every read-ahead thread (the running iteration's and the next epoch's)."""
        self._stop_active()
        if getattr(self, "_next", None) is not None:
            self._next[1].close()
            self._next = None

    def __del__(self) -> None:
        self.close()


def _for_the_device(batches: Iterator[Batch], device: int | None, multiple: int, pad_id: int, packing: bool = False
                    ) -> Iterator[Batch]:
    """In the read-ahead thread: widths padded to `multiple`, packed where `packing`, pinned where `device` is given.
    Pinned, the trainer's copy to the GPU is asynchronous; from pageable memory it would block the host until the
    GPU had run everything queued before it, so the host could not queue the next step's kernels while the GPU runs
    this one."""
    try:
        if device is not None:  # a new thread's CUDA device is 0: pinning there would open a context on every
            torch.cuda.set_device(device)  # rank's behalf on GPU 0 (as torch's DataLoader sets it in its pin thread)
        for b in batches:
            b = pad_to_multiple(b, multiple, pad_id)
            b = pack_batch(b, pad_id) if packing else b
            yield {k: v.pin_memory() for k, v in b.items()} if device is not None else b
    finally:
        batches.close()  # its readers now, not whenever it is collected
