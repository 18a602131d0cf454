"""A split's rows by position: its shards' row groups read one at a time, and batch collation.

A split is the concatenation of its row groups in some order (manifest order, or an epoch's
permutation). `RangeReader.read(a, b)` returns rows [a, b) of that sequence, opening only the
row groups that overlap it.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from torchloom.errors import UserError
from torchloom.manifest import Manifest
from torchloom.tag_scoring import concat_labels, label_array
from torchloom.uri import has_scheme

READ_COLUMNS = ["input_ids", "label_id"]


@dataclass(frozen=True)
class RowGroup:
    shard: int  # index into the split's shards
    index: int  # row group number inside the shard file
    rows: int
    first_row: int  # position of its first row in the split, in manifest order


def split_row_groups(manifest: Manifest, split: str) -> tuple[list[str], list[RowGroup]]:
    """The split's shard URIs and its row groups in manifest order."""
    info = manifest.split(split)
    uris = [manifest.shard_uri(shard) for shard in info.shards]
    groups = []
    first = 0
    for s, shard in enumerate(info.shards):
        for i, rows in enumerate(shard.row_groups):
            groups.append(RowGroup(s, i, rows, first))
            first += rows
    if first != info.rows:
        raise UserError(
            f"manifest {manifest.root}: split {split!r} says {info.rows} rows but its shards' row groups"
            f" hold {first}; prepare the data again"
        )
    return uris, groups


@dataclass
class Rows:
    """Rows held as numpy arrays: token ids of all rows concatenated, cut by `offsets`."""

    values: np.ndarray  # int32 token ids; offsets index into it
    offsets: np.ndarray  # int64, len(rows) + 1, ascending
    labels: np.ndarray  # int64 [rows]; a multi-label run's tag ids [rows, width], -1 padded (text/tags.py)
    index: np.ndarray  # int64 position of each row in the split, in manifest order

    def __len__(self) -> int:
        return len(self.labels)

    def slice(self, start: int, stop: int) -> Rows:
        return Rows(self.values, self.offsets[start:stop + 1], self.labels[start:stop], self.index[start:stop])

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @staticmethod
    def concat(a: Rows, b: Rows) -> Rows:
        a_values = a.values[a.offsets[0]:a.offsets[-1]]
        b_offsets = b.offsets[1:] - b.offsets[0] + len(a_values)
        return Rows(
            np.concatenate([a_values, b.values[b.offsets[0]:b.offsets[-1]]]),
            np.concatenate([a.offsets - a.offsets[0], b_offsets]),
            concat_labels([a.labels, b.labels]),
            np.concatenate([a.index, b.index]),
        )

    @staticmethod
    def from_table(table: pa.Table) -> Rows:
        ids = table.column("input_ids").combine_chunks()
        if isinstance(ids, pa.ChunkedArray):  # a table with no rows keeps zero chunks
            ids = pa.array([], ids.type)
        return Rows(
            ids.values.to_numpy(zero_copy_only=False),
            ids.offsets.to_numpy().astype(np.int64),
            label_array(table.column("label_id")),
            table.column("index").to_numpy().astype(np.int64),
        )


IGNORE_LABEL = -100  # torch's cross_entropy ignore_index: a row that adds nothing to the loss


def collate(rows: Rows, pad_id: int) -> dict[str, torch.Tensor]:
    """A batch: input_ids and attention_mask [B, L] (L = longest row), labels and index [B].

    No rows give a placeholder of one pad token with label IGNORE_LABEL and index -1: a rank with
    nothing in a micro-step still runs its forward and backward (DDP and FSDP wait for it), adding
    zero loss and zero gradient.
    """
    if len(rows) == 0:
        return {"input_ids": torch.full((1, 1), pad_id, dtype=torch.int64),
                "attention_mask": torch.ones((1, 1), dtype=torch.int64),
                "labels": torch.full((1,), IGNORE_LABEL, dtype=torch.int64),
                "index": torch.full((1,), -1, dtype=torch.int64)}
    lengths = rows.lengths()
    width = max(int(lengths.max(initial=0)), 1)
    mask = np.arange(width) < lengths[:, None]
    input_ids = np.full(mask.shape, pad_id, np.int64)
    input_ids[mask] = rows.values[rows.offsets[0]:rows.offsets[-1]]  # row-major order = row order
    return {
        "input_ids": torch.from_numpy(input_ids),
        "attention_mask": torch.from_numpy(mask.astype(np.int64)),
        "labels": torch.from_numpy(rows.labels.copy()),
        "index": torch.from_numpy(rows.index.copy()),
    }


def pad_to_multiple(batch: dict[str, torch.Tensor], multiple: int, pad_id: int) -> dict[str, torch.Tensor]:
    """`batch` with its width (input_ids and attention_mask) padded up to a multiple of `multiple`: a compiled
    model then sees a few widths, not every length up to max_length."""
    width = batch["input_ids"].shape[1]
    extra = -width % multiple
    if multiple <= 1 or not extra:
        return batch
    pad = torch.nn.functional.pad
    return {**batch, "input_ids": pad(batch["input_ids"], (0, extra), value=pad_id),
            "attention_mask": pad(batch["attention_mask"], (0, extra), value=0)}


def _open(uri: str) -> pq.ParquetFile:
    return pq.ParquetFile(uri)


class RangeReader:
    """Reads rows [a, b) of `groups` concatenated in the given order, a row group at a time.

    Keeps the last row group read by each `slot` (a caller reading several ranges side by side gives
    each its slot), so a row group straddling two consecutive reads of a slot is read once. `spans`, where
    given, are the rows [a, b) each slot will read, in slot order: read-ahead stays inside them.
    `rows_read` counts the rows returned, for tests and benchmarks.
    """

    # Shards on a store: each row group is one ranged GET, whose latency would stall the reader, so the next
    # PREFETCH row groups of a slot are read in the background. A store answers each request at a fixed cost
    # (tens of ms on S3, a few ms of a local server's CPU) whatever its size up to a few MB, so each shard is
    # opened once per reader (one HEAD, one footer GET) and its handle and footer are shared by the threads:
    # after that a row group costs one GET.
    PREFETCH = 4

    def __init__(self, uris: list[str], groups: list[RowGroup], spans: list[tuple[int, int]] | None = None):
        self._uris = uris
        self._groups = groups
        self._starts = np.cumsum([0] + [g.rows for g in groups])
        # per slot, the position after the last row group it reads (read-ahead goes no further)
        self._ends = [int(np.searchsorted(self._starts, b, side="left")) for _, b in spans or []]
        self._files: dict[int, pq.ParquetFile] = {}
        self._last: dict[int, tuple[RowGroup, pa.Table]] = {}
        self.rows_read = 0
        self._remote = any(has_scheme(u) for u in uris)
        self._pool = None
        self._ahead: dict[int, dict[int, Future]] = {}  # slot -> {group position: its read}
        self._opened: dict[int, tuple] = {}  # remote shard -> (its file handle, its footer)
        self._opening = threading.Lock()
        self._shard_locks: dict[int, threading.Lock] = {}

    def read(self, start: int, stop: int, slot: int = 0) -> pa.Table:
        """Columns input_ids, label_id and index (the row's position in the split, manifest order)."""
        parts = []
        self.rows_read += max(0, stop - start)
        j = int(np.searchsorted(self._starts, start, side="right")) - 1
        while start < stop:
            group = self._groups[j]
            table = self._prefetched(j, slot) if self._remote else self._read_group(group, slot)
            lo = start - int(self._starts[j])
            hi = min(stop - int(self._starts[j]), group.rows)
            part = table.slice(lo, hi - lo)
            index = np.arange(group.first_row + lo, group.first_row + hi, dtype=np.int64)
            parts.append(part.append_column("index", pa.array(index)))
            start += hi - lo
            j += 1
        return pa.concat_tables(parts)

    def _read_group(self, group: RowGroup, slot: int) -> pa.Table:
        last = self._last.get(slot)
        if last is not None and last[0] == group:
            return last[1]
        if group.shard not in self._files:
            self._files[group.shard] = _open(self._uris[group.shard])
        table = self._files[group.shard].read_row_group(group.index, columns=READ_COLUMNS)
        self._check_rows(group, table)
        self._last[slot] = (group, table)
        return table

    def _prefetched(self, j: int, slot: int) -> pa.Table:
        """Row group j of a remote shard, read ahead: the next PREFETCH of this slot are in flight."""
        last = self._last.get(slot)
        if last is not None and last[0] == self._groups[j]:
            return last[1]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.PREFETCH, thread_name_prefix="torchloom-prefetch")
        ahead = self._ahead.setdefault(slot, {})
        for k in list(ahead):
            if k < j or k >= j + self.PREFETCH:  # the slot moved on (or jumped): drop what it will not read
                ahead.pop(k).cancel()
        end = self._ends[slot] if slot < len(self._ends) else len(self._groups)
        for k in range(j, min(j + self.PREFETCH, end)):
            if k not in ahead:
                ahead[k] = self._pool.submit(self._read_remote, k)
        table = (ahead.pop(j) if j in ahead else self._pool.submit(self._read_remote, j)).result()
        self._last[slot] = (self._groups[j], table)
        return table

    def _remote_shard(self, shard: int) -> tuple:
        """(handle, footer) of a remote shard, opened by the first thread that needs it."""
        with self._opening:
            lock = self._shard_locks.setdefault(shard, threading.Lock())
        with lock:  # one open per shard; other shards open meanwhile
            if shard not in self._opened:
                from torchloom.store import storage

                handle = storage.open_input(self._uris[shard])
                self._opened[shard] = (handle, pq.ParquetFile(handle).metadata)
            return self._opened[shard]

    def _read_remote(self, j: int) -> pa.Table:
        group = self._groups[j]
        handle, footer = self._remote_shard(group.shard)
        # A reader of its own over the shared handle: its reads are ReadAt calls, which Arrow's files allow
        # from several threads at once; pre_buffer makes the row group's column chunks one ranged GET.
        table = pq.ParquetFile(handle, metadata=footer, pre_buffer=True).read_row_group(group.index,
                                                                                      columns=READ_COLUMNS)
        self._check_rows(group, table)
        return table

    def _check_rows(self, group: RowGroup, table: pa.Table) -> None:
        if table.num_rows != group.rows:
            raise UserError(
                f"{self._uris[group.shard]}: row group {group.index} has {table.num_rows} rows, the manifest"
                f" says {group.rows}; the data changed after prepare, prepare it again"
            )

    def close(self) -> None:
        for ahead in self._ahead.values():
            for f in ahead.values():
                f.cancel()
        self._ahead.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        for f in self._files.values():
            f.close()
        self._files.clear()
        for handle, _ in self._opened.values():
            handle.close()
        self._opened.clear()
        self._last.clear()
