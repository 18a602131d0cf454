"""The rank-sharded loader: equal batch counts, exactly-once epochs, exact resume, bounded reads."""

from __future__ import annotations

import threading

import pyarrow.parquet as pq
import pytest
import torch

from torchloom.data import ShardedLoader, batch_sizes, eval_batches, rank_range, shards
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
    return [i for b in batches for i in b["index"].tolist()]


def assert_same_batches(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            assert torch.equal(x[k], y[k]), k


def readahead_threads():
    return [t for t in threading.enumerate() if t.name == "torchloom-readahead" and t.is_alive()]


def test_batch_sizes_rule_equal_counts_and_every_row():
    for world_size in range(1, 6):
        for rows in range(world_size, 70):
            for b in range(2, 7):
                per_rank = [batch_sizes(rows, world_size, b, r) for r in range(world_size)]
                assert len({len(s) for s in per_rank}) == 1
                for r, sizes in enumerate(per_rank):
                    assert sizes.sum() == rank_range(rows, world_size, r)[1]
                    assert sizes.min() >= 1 and sizes.max() <= b
                    assert (sizes[:-2] == b).all()


@pytest.mark.parametrize(("split", "world_size", "batch_size"), [
    ("train", 1, 4), ("train", 2, 4), ("train", 3, 4), ("train", 4, 4),
    ("train", 3, 2),  # q=34, 34 % 2 == 0, rem=1: ranks 1, 2 end with batches of 1 and 1
    ("val", 2, 4),  # q=8 % 4 == 0, rem=1: rank 1 ends (4, 3, 1)
    ("test", 3, 3),  # q=6 % 3 == 0, rem=1
    ("val", 4, 5),
])
def test_equal_batch_counts_and_every_row_once(manifest, split, world_size, batch_size):
    ranks = loaders(manifest, split, world_size, batch_size=batch_size)
    runs = [list(loader) for loader in ranks]
    assert {len(run) for run in runs} == {len(ranks[0])}
    for loader, run in zip(ranks, runs):
        assert [len(b["labels"]) for b in run] == loader.batch_sizes()
    seen = indices(b for run in runs for b in run)
    assert sorted(seen) == list(range(ROWS[split]))
    total = [sum(len(run[i]["labels"]) for run in runs) for i in range(len(ranks[0]))]
    assert total == [ranks[0].global_batch_rows(i) for i in range(len(ranks[0]))]
    assert all(loader.batch_sizes(r) == ranks[r].batch_sizes() for loader in ranks for r in range(world_size))


def test_every_row_once_with_length_bucketing(manifest):
    runs = [list(loader) for loader in loaders(manifest, world_size=3, length_bucketing=True)]
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
    assert sorted(indices(loaders(manifest, shuffle=False)[0])) == indices(loaders(manifest, shuffle=False)[0])


@pytest.mark.parametrize("length_bucketing", [False, True])
@pytest.mark.parametrize("stop_after", [1, 2, 3, 12])  # window = 2 batches: 2 is on a boundary, 12 the last
def test_resume_yields_the_uninterrupted_batches(manifest, stop_after, length_bucketing):
    kw = {"world_size": 2, "length_bucketing": length_bucketing}
    full = loaders(manifest, **kw)[1]
    full.set_epoch(3)
    uninterrupted = list(full)

    first = loaders(manifest, **kw)[1]
    first.set_epoch(3)
    it = iter(first)
    head = [next(it) for _ in range(stop_after)]
    state = first.state_dict()
    it.close()
    assert state["epoch"] == 3 and state["batches_yielded"] == stop_after

    resumed = loaders(manifest, **kw)[1]
    resumed.load_state_dict(state)
    resumed.set_epoch(3)  # what a trainer does after loading: the same epoch keeps the position
    assert_same_batches(head + list(resumed), uninterrupted)


def test_resume_before_the_split_remainder(manifest):
    # val on 2 ranks, batch 4: rank 1 has 8 rows as (4, 3, 1); stop right before the 1-row batch.
    uninterrupted = list(loaders(manifest, "val", world_size=2)[1])
    first = loaders(manifest, "val", world_size=2)[1]
    it = iter(first)
    head = [next(it), next(it)]
    it.close()
    resumed = loaders(manifest, "val", world_size=2)[1]
    resumed.load_state_dict(first.state_dict())
    assert_same_batches(head + list(resumed), uninterrupted)


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


def test_rank_reads_only_its_row_groups_once(manifest, row_groups_read):
    groups = group_of(manifest)
    touched = []
    for loader in loaders(manifest, world_size=3, batch_size=2):
        loader.set_epoch(1)
        row_groups_read.clear()
        mine = {groups[i] for i in indices(loader)}
        assert sorted(row_groups_read) == sorted(mine)  # each needed row group, each read once
        touched.append(mine)
    for mine in touched:
        assert len(mine) < len(set(groups))
    assert set().union(*touched) == set(groups)


def test_resume_does_not_reread_skipped_windows(manifest, row_groups_read):
    loader = loaders(manifest, world_size=1, shuffle_buffer=40)[0]
    list(loader)
    full_reads = len(row_groups_read)
    row_groups_read.clear()
    resumed = loaders(manifest, world_size=1, shuffle_buffer=40)[0]
    resumed.load_state_dict(loader.state_dict() | {"batches_yielded": 20, "epoch_finished": False})
    assert len(list(resumed)) == len(loader) - 20
    assert len(row_groups_read) < full_reads / 2


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
    ({"world_size": 4}, "world_size"),
    ({"batch_size": 8}, "batch_size"),
    ({"seed": 1}, "seed"),
    ({"split": "val"}, "split"),
    ({"fingerprint": "other"}, "fingerprint"),
    ({"shuffle_buffer": 16}, "shuffle_buffer"),
    ({"batches_yielded": 99}, "batches_yielded"),
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


def test_batch_size_one_needs_even_shares(manifest):
    with pytest.raises(UserError, match="batch_size >= 2"):
        loaders(manifest, world_size=2, batch_size=1)
    runs = [list(loader) for loader in loaders(manifest, world_size=1, batch_size=1)]
    assert len(runs[0]) == 103


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


def test_eval_batches_in_file_order(manifest):
    runs = [list(eval_batches(manifest, "val", r, 3, 4)) for r in range(3)]
    assert indices(b for run in runs for b in run) == list(range(17))
    assert [len(b["labels"]) for b in runs[0]] == [4, 2]
    assert sum(len(run) for run in runs) == 6
    assert list(eval_batches(manifest, "val", 17, 18, 4)) == []  # fewer rows than ranks: nothing to do
