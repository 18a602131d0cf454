"""The loader: one global order for any number of workers, exactly-once epochs, O(1) resume, bounded reads."""

from __future__ import annotations

import threading

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from torchloom.data import ShardedLoader, batch_sizes, eval_batches, shards
from torchloom.data.loader import global_steps, partition_range
from torchloom.data.synthetic import write_synthetic_dataset
from torchloom.errors import UserError

# train 103 rows = shards of 40, 40, 23 rows in row groups of 10 (the last one 3): 11 row groups.
ROWS = {"train": 103, "val": 17, "test": 19}


@pytest.fixture(scope="module")
def manifest(tmp_path_factory):
    return write_synthetic_dataset(tmp_path_factory.mktemp("data"), rows=ROWS, rows_per_group=10, rows_per_shard=40)


def loaders(manifest, split="train", world_size=2, **kw):
    kw = {"batch_size": 4, "seed": 0, "shuffle_buffer": 8} | kw
    return [ShardedLoader(manifest, split, rank=r, world_size=world_size, **kw) for r in range(world_size)]


def indices(batches) -> list[int]:
    return [i for b in batches for i in b["index"].tolist() if i >= 0]


def global_batches(ranks, runs) -> list[list[int]]:
    """Row ids of every global batch, ranks in order, from each rank's list of micro-batches."""
    accum = ranks[0].accum
    steps = len(runs[0]) // accum
    return [indices(run[i * accum + j] for run in runs for j in range(accum)) for i in range(steps)]


def epoch(manifest, world_size, batch_size, global_batch=8, epoch_=0, **kw):
    ranks = loaders(manifest, world_size=world_size, batch_size=batch_size, global_batch=global_batch, **kw)
    for loader in ranks:
        loader.set_epoch(epoch_)
    return global_batches(ranks, [list(loader) for loader in ranks])


def assert_same_batches(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            assert torch.equal(x[k], y[k]), k


def readahead_threads():
    return [t for t in threading.enumerate() if t.name == "torchloom-readahead" and t.is_alive()]


def test_partitions_spread_the_remainder_evenly_over_any_divisor():
    for parts in (1, 4, 6, 12):
        for rows in range(parts, 80):
            ranges = [partition_range(rows, parts, p) for p in range(parts)]
            assert [start for start, _ in ranges] == list(np.cumsum([0] + [n for _, n in ranges])[:-1])
            assert sum(n for _, n in ranges) == rows
            extra = [n - rows // parts for _, n in ranges]
            for world in (w for w in range(1, parts + 1) if parts % w == 0):
                per = parts // world
                blocks = [sum(extra[r * per:(r + 1) * per]) for r in range(world)]
                assert max(blocks) - min(blocks) <= 1


def test_batch_sizes_rule_equal_counts_and_every_row():
    for global_batch in (4, 6, 12):
        for world_size in (w for w in range(1, global_batch + 1) if global_batch % w == 0):
            for b in (b for b in range(1, global_batch // world_size + 1) if global_batch // world_size % b == 0):
                for rows in range(world_size, 60):
                    per_rank = [batch_sizes(rows, world_size, b, r, global_batch) for r in range(world_size)]
                    accum = global_batch // (world_size * b)
                    assert {len(s) for s in per_rank} == {global_steps(rows, global_batch) * accum}
                    assert sum(s.sum() for s in per_rank) == rows
                    assert all(s.max() <= b for s in per_rank)
                    step_rows = np.sum(per_rank, axis=0).reshape(-1, accum).sum(1)
                    assert (step_rows[:-1] == global_batch).all()


@pytest.mark.parametrize(("split", "world_size", "batch_size", "global_batch"), [
    ("train", 1, 4, 4), ("train", 2, 4, 8), ("train", 4, 2, 8), ("train", 2, 2, 8), ("train", 3, 2, 6),
    ("train", 4, 1, 12),  # rem 7 over 4 ranks of 3 micro-batches: some micro-batches are placeholders
    ("val", 2, 4, 8), ("test", 3, 3, 9), ("val", 4, 5, 20),
])
def test_equal_batch_counts_and_every_row_once(manifest, split, world_size, batch_size, global_batch):
    ranks = loaders(manifest, split, world_size, batch_size=batch_size, global_batch=global_batch)
    runs = [list(loader) for loader in ranks]
    assert {len(run) for run in runs} == {len(ranks[0])}
    for loader, run in zip(ranks, runs):
        assert [len([i for i in b["index"].tolist() if i >= 0]) for b in run] == loader.batch_sizes()
    seen = indices(b for run in runs for b in run)
    assert sorted(seen) == list(range(ROWS[split]))
    total = [sum(len(indices([run[i]])) for run in runs) for i in range(len(ranks[0]))]
    assert total == [ranks[0].global_batch_rows(i) for i in range(len(ranks[0]))]
    assert all(loader.batch_sizes(r) == ranks[r].batch_sizes() for loader in ranks for r in range(world_size))


@pytest.mark.parametrize("length_bucketing", [False, True])
def test_the_same_global_batches_on_any_number_of_workers(manifest, length_bucketing):
    kw = {"length_bucketing": length_bucketing, "shuffle_buffer": 32}  # 4 positions per window
    reference = epoch(manifest, 2, 4, **kw)
    assert len(reference) == 13 and [len(b) for b in reference] == [8] * 12 + [7]
    assert sorted(i for b in reference for i in b) == list(range(103))
    for world_size, batch_size in [(1, 8), (1, 2), (4, 2), (4, 1), (8, 1), (2, 1)]:
        assert epoch(manifest, world_size, batch_size, **kw) == reference, (world_size, batch_size)
    assert epoch(manifest, 2, 4, epoch_=1, **kw) == epoch(manifest, 4, 2, epoch_=1, **kw) != reference


def test_every_row_once_with_length_bucketing(manifest):
    runs = [list(loader) for loader in loaders(manifest, world_size=3, global_batch=6, batch_size=2,
                                               length_bucketing=True)]
    assert sorted(indices(b for run in runs for b in run)) == list(range(103))


def test_epoch_order_depends_on_seed_and_epoch_only(manifest):
    def order(seed, epoch):
        loader = loaders(manifest, seed=seed)[1]
        loader.set_epoch(epoch)
        return indices(loader)

    assert order(0, 0) == order(0, 0)
    assert order(0, 1) == order(0, 1)
    assert order(0, 0) != order(0, 1)
    assert order(0, 0) != order(1, 0)
    unshuffled = epoch(manifest, 1, 8, shuffle=False)
    assert [b[0] for b in unshuffled[:12]] == list(range(12))  # partition 0: rows 0..11, in file order
    assert unshuffled[0] == [0, 12, 25, 38, 51, 64, 77, 90]  # one row of each partition: 12 or 13 rows each


@pytest.mark.parametrize("length_bucketing", [False, True])
@pytest.mark.parametrize("stop_after", [1, 2, 3, 12])  # window = 2 batches: 2 is on a boundary, 12 the last
def test_resume_yields_the_uninterrupted_batches(manifest, stop_after, length_bucketing):
    kw = {"world_size": 2, "length_bucketing": length_bucketing, "shuffle_buffer": 16}
    full = loaders(manifest, **kw)[1]
    full.set_epoch(3)
    uninterrupted = list(full)

    first = loaders(manifest, **kw)[1]
    first.set_epoch(3)
    it = iter(first)
    head = [next(it) for _ in range(stop_after)]
    state = first.state_dict()
    it.close()
    assert state["epoch"] == 3 and state["steps_done"] == stop_after

    resumed = loaders(manifest, **kw)[1]
    resumed.load_state_dict(state)
    resumed.set_epoch(3)  # what a trainer does after loading: the same epoch keeps the position
    assert_same_batches(head + list(resumed), uninterrupted)


@pytest.mark.parametrize("length_bucketing", [False, True])
@pytest.mark.parametrize("stop_after", [1, 5, 12])
def test_resume_on_other_workers_continues_the_same_global_batches(manifest, stop_after, length_bucketing):
    kw = {"length_bucketing": length_bucketing, "shuffle_buffer": 32}
    uninterrupted = epoch(manifest, 2, 4, **kw) + epoch(manifest, 2, 4, epoch_=1, **kw)
    two = loaders(manifest, world_size=2, batch_size=4, global_batch=8, **kw)
    its = [iter(loader) for loader in two]
    for it in its:
        for _ in range(stop_after):
            next(it)
        it.close()
    state = two[0].state_dict()
    for world_size, batch_size in [(1, 8), (1, 4), (4, 2), (4, 1)]:
        ranks = loaders(manifest, world_size=world_size, batch_size=batch_size, global_batch=8, **kw)
        for loader in ranks:
            loader.load_state_dict(state)
        rest = global_batches(ranks, [list(loader) for loader in ranks])
        for loader in ranks:
            loader.set_epoch(1)
        rest += global_batches(ranks, [list(loader) for loader in ranks])
        assert rest == uninterrupted[stop_after:], (world_size, batch_size)


def test_resume_before_the_split_remainder(manifest):
    # val (17 rows) on 2 ranks, global batch 8: two full global batches, then 1 row; stop before it.
    uninterrupted = list(loaders(manifest, "val", world_size=2)[1])
    first = loaders(manifest, "val", world_size=2)[1]
    it = iter(first)
    head = [next(it), next(it)]
    it.close()
    resumed = loaders(manifest, "val", world_size=2)[1]
    resumed.load_state_dict(first.state_dict())
    assert_same_batches(head + list(resumed), uninterrupted)


def test_a_rank_without_rows_in_the_last_batch_gets_a_placeholder(manifest):
    # val: 17 rows, global batch 8 over 2 ranks: the last global batch is 1 row, on one rank only.
    last = [list(loader)[-1] for loader in loaders(manifest, "val", world_size=2)]
    empty = [b for b in last if b["index"].tolist() == [-1]]
    assert len(empty) == 1
    assert empty[0]["labels"].tolist() == [shards.IGNORE_LABEL] and empty[0]["attention_mask"].tolist() == [[1]]
    logits = torch.randn(1, 3, requires_grad=True)
    torch.nn.functional.cross_entropy(logits, empty[0]["labels"], reduction="sum").backward()
    assert (logits.grad == 0).all()  # it adds nothing to the loss or the gradient


def test_mid_step_resume_needs_the_same_workers(manifest):
    loader = loaders(manifest, world_size=2, batch_size=2, global_batch=8)[0]  # 2 micro-batches per step
    it = iter(loader)
    next(it)
    it.close()
    state = loader.state_dict()
    assert state["steps_done"] == 0 and state["batches_yielded"] == 1
    same = loaders(manifest, world_size=2, batch_size=2, global_batch=8)[0]
    same.load_state_dict(state)
    assert len(list(same)) == len(loader) - 1
    with pytest.raises(UserError, match="micro-batches into a global batch"):
        loaders(manifest, world_size=4, batch_size=2, global_batch=8)[0].load_state_dict(state)


@pytest.fixture
def row_groups_read(monkeypatch):
    """Records (shard uri, row group) of every read_row_group call the loader makes."""
    calls = []
    real_open = shards._open

    class Counting:
        def __init__(self, uri):
            self.uri, self.file = uri, real_open(uri)

        def read_row_group(self, i, **kw):
            calls.append((self.uri, i))
            return self.file.read_row_group(i, **kw)

        def close(self):
            self.file.close()

    monkeypatch.setattr(shards, "_open", Counting)
    return calls


def group_of(manifest, split="train"):
    """Row position in the split (manifest order) -> (shard uri, row group)."""
    out = []
    for shard in manifest.split(split).shards:
        for i, rows in enumerate(shard.row_groups):
            out += [(manifest.shard_uri(shard), i)] * rows
    return out


def test_rank_reads_only_the_row_groups_of_its_partitions(manifest, row_groups_read):
    groups = group_of(manifest)
    touched = []
    for loader in loaders(manifest, world_size=2, batch_size=1, global_batch=4, shuffle_buffer=40):
        loader.set_epoch(1)
        row_groups_read.clear()
        mine = {groups[i] for i in indices(loader)}
        assert set(row_groups_read) == mine
        # each row group once per partition that holds some of it: at most once more than once
        assert len(row_groups_read) <= len(mine) + 1
        touched.append(mine)
    for mine in touched:
        assert len(mine) < len(set(groups))
    assert set().union(*touched) == set(groups)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_resume_reads_at_most_one_window_it_does_not_yield(manifest, world_size, monkeypatch):
    """Rows read to resume do not grow with the position in the epoch: at most one window per rank."""
    read = []
    real = shards.RangeReader.read

    def counting(self, start, stop, slot=0):
        read.append(stop - start)
        return real(self, start, stop, slot)

    monkeypatch.setattr(shards.RangeReader, "read", counting)
    kw = {"world_size": world_size, "batch_size": 8 // world_size, "global_batch": 8, "shuffle_buffer": 32}
    window_rows = 32 // world_size  # 4 positions x the rank's 8 / world_size partitions
    for steps_done in (1, 6, 11):
        loader = loaders(manifest, **kw)[0]
        loader.load_state_dict(loader.state_dict() | {"steps_done": steps_done, "batches_yielded": steps_done})
        read.clear()
        yielded = len(indices(loader))
        assert sum(read) - yielded <= window_rows, steps_done


def test_padding_and_attention_mask(manifest):
    table = pq.read_table([manifest.shard_uri(s) for s in manifest.split("train").shards])
    ids, labels = table.column("input_ids").to_pylist(), table.column("label_id").to_pylist()
    for batch in loaders(manifest, batch_size=5, pad_id=7)[0]:
        assert batch["input_ids"].dtype == batch["attention_mask"].dtype == batch["labels"].dtype == torch.int64
        lengths = [len(ids[i]) for i in batch["index"].tolist()]
        assert batch["input_ids"].shape == (len(lengths), max(lengths))
        assert batch["attention_mask"].sum(1).tolist() == lengths
        for row, i in enumerate(batch["index"].tolist()):
            n = len(ids[i])
            assert batch["input_ids"][row, :n].tolist() == ids[i]
            assert (batch["input_ids"][row, n:] == 7).all()
            assert batch["labels"][row] == labels[i]


def test_length_bucketing_groups_similar_lengths(manifest):
    def padding(**kw):
        batches = list(loaders(manifest, world_size=1, shuffle_buffer=64, **kw)[0])
        return sum((1 - b["attention_mask"]).sum().item() for b in batches)

    assert padding(length_bucketing=True) < padding(length_bucketing=False) / 2


def test_epoch_end_state_and_set_epoch(manifest):
    loader = loaders(manifest)[0]
    n = len(list(loader))
    state = loader.state_dict()
    assert state["epoch_finished"] and state["batches_yielded"] == n
    assert list(loader) == []  # the position stays at the end until set_epoch moves on
    loader.set_epoch(0)
    assert list(loader) == []
    loader.set_epoch(1)
    assert len(list(loader)) == n


@pytest.mark.parametrize(("change", "message"), [
    ({"global_batch": 16}, "global_batch"),
    ({"seed": 1}, "seed"),
    ({"split": "val"}, "split"),
    ({"fingerprint": "other"}, "fingerprint"),
    ({"shuffle_buffer": 16}, "shuffle_buffer"),
    ({"steps_done": 99}, "steps_done"),
    ({"order": 1}, "older torchloom"),
])
def test_bad_resume_state_refused(manifest, change, message):
    loader = loaders(manifest)[0]
    with pytest.raises(UserError, match=message):
        loader.load_state_dict(loader.state_dict() | change)


def test_resume_state_without_keys_refused(manifest):
    with pytest.raises(UserError, match="missing"):
        loaders(manifest)[0].load_state_dict({"epoch": 0})


def test_too_few_rows_for_workers(tmp_path):
    small = write_synthetic_dataset(tmp_path, rows={"train": 3})
    with pytest.raises(UserError, match="fewer than the 4 workers"):
        ShardedLoader(small, "train", rank=0, world_size=4, batch_size=2, seed=0)


def test_abandoned_iteration_stops_its_thread(manifest):
    loader = loaders(manifest, world_size=1, batch_size=2, shuffle_buffer=4)[0]
    it = iter(loader)
    next(it)
    assert readahead_threads()
    second = iter(loader)  # a new iteration stops the first one
    next(second)
    assert list(it) == []
    second.close()
    assert not readahead_threads()
    assert loader.state_dict()["batches_yielded"] == 2

    it = iter(loader)
    next(it)
    loader.set_epoch(1)  # moving to another epoch stops the iteration and resets the position
    assert list(it) == [] and not readahead_threads()
    assert loader.state_dict()["batches_yielded"] == 0

    it = iter(loaders(manifest)[0])
    next(it)
    del it  # dropped without close
    assert not readahead_threads()


def test_the_next_epoch_is_read_while_its_last_batch_is_used_and_gives_the_same_batches(manifest):
    # The trainer validates and checkpoints after an epoch's last batch; the next epoch's first window is read then.
    def fresh(e):
        other = loaders(manifest, world_size=1, batch_size=2, shuffle_buffer=4)[0]
        other.set_epoch(e)
        other.last_epoch = e
        return list(other)

    loader = loaders(manifest, world_size=1, batch_size=2, shuffle_buffer=4)[0]
    loader.last_epoch = 9
    before = len(readahead_threads())
    list(loader)
    assert len(readahead_threads()) == before + 1  # the next epoch's reader, started at the last batch
    loader.set_epoch(1)
    assert_same_batches(list(loader), fresh(1))
    loader.set_epoch(3)  # not the epoch read ahead: that reader is stopped, epoch 3 read as asked
    loader.last_epoch = 3
    assert_same_batches(list(loader), fresh(3))
    assert len(readahead_threads()) == before  # nothing read past the last epoch
    loader.last_epoch = 9
    list(loader.set_epoch(4) or loader)
    assert len(readahead_threads()) == before + 1
    loader.close()
    assert len(readahead_threads()) == before


def test_eval_batches_in_file_order(manifest):
    runs = [list(eval_batches(manifest, "val", r, 3, 4)) for r in range(3)]
    assert indices(b for run in runs for b in run) == list(range(17))
    assert [len(b["labels"]) for b in runs[0]] == [4, 2]
    assert sum(len(run) for run in runs) == 6
    assert list(eval_batches(manifest, "val", 17, 18, 4)) == []  # fewer rows than ranks: nothing to do


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.gpu
def test_on_cuda_the_read_ahead_pins_every_batch_and_the_rows_are_the_same(manifest):
    # Pinned batches make the trainer's copy to the GPU asynchronous (train/loop.py asks for it on CUDA).
    pinned, plain = (list(ShardedLoader(manifest, "train", rank=0, world_size=2, batch_size=4, seed=0,
                                        pin_memory=pin)) for pin in (True, False))
    assert all(v.is_pinned() for b in pinned for v in b.values())
    assert indices(pinned) == indices(plain)
