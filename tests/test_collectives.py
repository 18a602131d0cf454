"""The distributed loop on threads (support/threaded.py): the ranks of one process, joined by torch's threaded
process group, run what every engine's worker runs (train.entry.run). What the loop decides (the collectives every
rank calls, in order; the batches each rank takes; what a resume continues) is checked here in seconds, over more
worlds and settings than processes could afford; the engines' own tests (test_train, test_engines, tests/cluster)
keep what only processes and hosts show: launches, signals, restarts, lost hosts.

The first test ties the tier to the real thing: the same job on threads and on the local engine's processes ends
at the same weights, bit for bit."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from support.engine_reference import assert_same_weights, traced_rows, train_losses
from support.threaded import run_on_threads, train_on_threads

from torchloom.config import build
from torchloom.data.synthetic import write_synthetic_dataset
from torchloom.model.tiny import write_tiny_model

# 103 rows, global batch 8: 13 steps per epoch (the engines' reference job, support/engine_reference.py)
COMMON = ["--train.precision", "fp32", "--train.batch_size", "8", "--train.lr", "1e-3", "--engine.threads_per_worker",
          "1", "--train.epochs", "1", "--train.checkpoint_every", "5", "--train.keep_last", "5", "--engine.device",
          "cpu", "--tracking.enabled", "false", "--train.budget", "off"]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """{model: a tiny model without dropout, data: 103 prepared rows}."""
    root = tmp_path_factory.mktemp("collectives")
    data = root / "data"
    write_synthetic_dataset(data, rows={"train": 103, "val": 21, "test": 19})
    return {"root": root, "model": write_tiny_model(root / "tiny", dropout=0.0), "data": data}


def new_run(tmp_path: Path, job: dict, name: str) -> Path:
    rd = tmp_path / name
    rd.mkdir()
    shutil.copytree(job["data"], rd / "data")
    return rd


def cfg_for(rd: Path, job: dict, workers: int, *extra: str):
    return build(None, ["--output.dir", str(rd), "--model.path", job["model"], *COMMON, "--engine.workers",
                        str(workers), *extra])


def on_threads(rd: Path, job: dict, workers: int, *extra: str):
    run = train_on_threads(cfg_for(rd, job, workers, *extra), str(rd), workers)
    assert not run.errors, run.errors
    return run


def test_ranks_on_threads_end_at_the_weights_of_the_local_engine_s_processes_bit_for_bit(tmp_path, job):
    from torchloom.engines import local

    processes = new_run(tmp_path, job, "processes")
    local.train(cfg_for(processes, job, 2), processes, quiet=True)
    threads = new_run(tmp_path, job, "threads")
    run = on_threads(threads, job, 2)
    assert {r: result.steps for r, result in run.results.items()} == {0: 13, 1: 13}
    for step in ("step-5", "step-10", "step-13"):
        assert_same_weights(processes / "checkpoints" / step, threads / "checkpoints" / step)
    assert train_losses(threads) == train_losses(processes)
    assert sorted(p.name for p in (threads / "checkpoints" / "step-13").iterdir()) == sorted(
        p.name for p in (processes / "checkpoints" / "step-13").iterdir())


# (workers, settings): the loop's branches that call collectives of their own
WORLDS = {
    "ddp-2-eval-checkpoint": (2, ["--train.eval_every", "4"]),
    "ddp-4-grad-accum": (4, ["--train.grad_accum", "2", "--train.eval_every", "3"]),
    "ddp-3-early-stopping": (3, ["--train.batch_size", "12", "--train.epochs", "3", "--train.eval_every", "2",
                                 "--train.early_stopping_patience", "1", "--train.lr", "1e-7"]),
    "fsdp-2": (2, ["--train.strategy", "fsdp", "--train.eval_every", "5"]),
    "ddp-8-one-row-each": (8, ["--train.checkpoint_every", "7"]),
}


@pytest.mark.parametrize("world", WORLDS)
def test_every_rank_calls_the_same_collectives_in_the_same_order(tmp_path, job, world):
    workers, extra = WORLDS[world]
    run = on_threads(new_run(tmp_path, job, world), job, workers, *extra)
    assert sorted(run.calls) == list(range(workers))
    first = run.calls[0]
    assert len(first) > 10, first  # the loop's own collectives were seen (the losses, the flags, the checkpoints)
    for rank, calls in run.calls.items():
        assert calls == first, (rank, next(i for i, (a, b) in enumerate(zip(calls, first)) if a != b)
                                if len(calls) == len(first) else (len(calls), len(first)))
    steps = {result.steps for result in run.results.values()}
    assert len(steps) == 1, steps  # every rank stopped at the same step
    if "early-stopping" in world:
        assert all(result.stopped_early for result in run.results.values())
        assert steps.pop() < 3 * 9  # 103 rows, global batch 12: 9 steps an epoch, stopped before the third ends


def test_a_resume_continues_the_same_global_batches_on_one_two_four_and_eight_ranks(tmp_path, job):
    trace = ["--train.trace_rows", "true", "--train.log_every", "1", "--train.epochs", "2", "--train.keep_last", "10"]
    two = new_run(tmp_path, job, "two")
    on_threads(two, job, 2, *trace)
    reference_rows, reference_losses = traced_rows(two), train_losses(two)
    assert sorted(reference_rows) == list(range(1, 27))
    assert sorted(i for s in range(1, 14) for i in reference_rows[s]) == list(range(103))  # each row once an epoch
    ckpt = two / "checkpoints" / "step-5"
    for workers in (1, 2, 4, 8):
        rd = new_run(tmp_path, job, f"w{workers}")
        run = on_threads(rd, job, workers, *trace, "--train.resume", str(ckpt))
        for result in run.results.values():  # resumed_world_size: said where the world changed
            assert (result.world_size, result.resumed_world_size, result.resumed_at_step, result.steps) == (
                workers, None if workers == 2 else 2, 5, 26)
        rows = traced_rows(rd)
        assert sorted(rows) == list(range(6, 27))
        for step, ids in rows.items():
            assert ids == reference_rows[step], (workers, step)
        for step, loss in train_losses(rd).items():
            assert loss == pytest.approx(reference_losses[step], rel=1e-5), (workers, step)
        if workers == 2:  # the same world: the same weights, bit for bit
            assert_same_weights(two / "checkpoints" / "step-26", rd / "checkpoints" / "step-26")


def chunked_split(root: Path, texts: int, labels: list[str], task: str = "single_label"):
    """A prepared-looking val split with truncation chunks (1 to 4 windows a text) in two shards: (manifest, each
    row's label, each row's text)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from torchloom.data.loader import rank_range
    from torchloom.manifest import Manifest, Shard, Split

    for seed in range(texts, texts + 100):  # one where every share's edge on 2 and 3 ranks cuts a text
        rng = np.random.default_rng(seed)
        counts = rng.integers(1, 5, texts)
        doc = np.repeat(np.arange(texts), counts)
        edges = [rank_range(len(doc), w, r)[0] for w in (2, 3) for r in range(1, w)]
        if all(doc[e - 1] == doc[e] for e in edges):
            break
    chunk = np.concatenate([np.arange(n) for n in counts])
    if task == "multi_label":  # each text's tag ids, -1 padded (text/tags.py), some untagged
        from torchloom import tag_scoring

        per_text = tag_scoring.to_ids(rng.random((texts, len(labels))) < 0.3)
    else:
        per_text = rng.integers(0, len(labels), texts)
    (root / "val").mkdir(parents=True)
    shards, cut = [], len(doc) // 3
    for i, rows in enumerate([slice(0, cut), slice(cut, len(doc))]):
        path = root / "val" / f"part-{i}.parquet"
        pq.write_table(pa.table({"chunk": chunk[rows].astype(np.int32)}), path)
        shards.append(Shard(path=f"val/{path.name}", rows=rows.stop - rows.start, row_groups=[rows.stop - rows.start]))
    m = Manifest(labels=labels, splits={"val": Split(rows=len(doc), shards=shards, documents=texts)},
                 tokenizer={"truncation": "chunks", "max_length": 8}, fingerprint="chunked", root=str(root),
                 task=task)
    return m, per_text[doc], doc


@pytest.mark.parametrize("task", ["single_label", "multi_label"])
def test_validation_on_ranks_reduces_sums_to_the_one_process_numbers_and_moves_bytes_by_labels_not_rows(
        tmp_path, task):
    """Issue 77, item 2: validation all-reduces sufficient statistics; a text whose windows two ranks' shares cut
    travels as its summed logits; the metrics are those of every row in one process (the old gather's)."""
    import numpy as np
    import torch

    from torchloom import tag_scoring
    from torchloom.data.loader import rank_range
    from torchloom.data.texts import to_documents
    from torchloom.scoring import classification_metrics
    from torchloom.train.distributed import Dist
    from torchloom.train.evaluation import reduced_metrics

    labels = ["a", "b", "c", "d", "e"]
    bytes_at, thresholds_seen = {}, []
    for texts in (400, 4000):
        m, row_labels, doc = chunked_split(tmp_path / str(texts), texts, labels, task)
        rows = len(row_labels)
        logits = np.random.default_rng(1).normal(size=(rows, len(labels))).astype(np.float32) * 3
        probs, text_labels, _ = to_documents(m, "val", logits, row_labels, np.arange(rows))
        if task == "multi_label":  # at the thresholds export would choose on these rows (issue 78, item 2)
            chosen = tag_scoring.choose_thresholds(probs, tag_scoring.multi_hot(text_labels, len(labels)),
                                                   at_least_one=not m.tags.get("keep_untagged", False))
            one = tag_scoring.evaluation(probs, text_labels, labels, chosen)
            thresholds_seen.append(one["thresholds"])
        else:
            one = classification_metrics(probs, text_labels, labels)
        for world in (2, 3):
            shares = [rank_range(rows, world, r) for r in range(world)]
            assert any(doc[start - 1] == doc[start] for start, _ in shares[1:])  # a text cut between two ranks

            def validate(r, world=world, shares=shares, m=m, logits=logits, row_labels=row_labels, rows=rows):
                start, count = shares[r]
                d = Dist(r, world, r, torch.device("cpu"), False)
                part = slice(start, start + count)
                return reduced_metrics(d, m, "val", logits[part], row_labels[part], np.arange(rows)[part])

            results, sent = run_on_threads(world, validate)
            for got in results.values():
                assert got["n"] == texts and got.keys() >= one.keys() - {"roc_auc"}
                for key in one.keys() - {"roc_auc", "reliability"}:
                    assert got[key] == (pytest.approx(one[key], rel=1e-9) if isinstance(one[key], float)
                                        else one[key]), key
            if task == "single_label":
                assert results[0]["reliability"]["count"] == one["reliability"]["count"]
                assert results[0]["ece"] == pytest.approx(one["ece"], rel=1e-9) and results[0]["roc_auc"] is None
            bytes_at[texts, world] = max(sent.values())
    # what a rank sends grows with the label set, not the rows: 10x the texts, within a few hundred bytes
    for world in (2, 3):
        assert abs(bytes_at[4000, world] - bytes_at[400, world]) < 400, bytes_at
        # the old gather sent ~rows x (labels + 2) x 4 to 8 bytes; a tagger also sends the rule's counts at each
        # threshold of its grid, 2 x 19 x 3 float64 a tag
        grid = 8 * 2 * len(tag_scoring.GRID) * 3 * len(labels) if task == "multi_label" else 0
        assert bytes_at[4000, world] < 4000 + grid, bytes_at
    if task == "multi_label":  # the rule chose thresholds other than 0.5 here, so the test could tell them apart
        assert any(t["default"] != 0.5 or t["per_label"] for t in thresholds_seen), thresholds_seen
