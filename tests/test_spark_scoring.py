"""A prepared split scored by Spark tasks (eval.score_with spark; evaluate/spark_scoring.py) gives the numbers one
process gives: the same logits row for row, so the same metrics."""

from __future__ import annotations

import numpy as np
import pytest

from torchloom.config import build
from torchloom.data.synthetic import write_synthetic_dataset
from torchloom.evaluate.spark_scoring import TASK_ROWS, shares
from torchloom.manifest import read as read_manifest
from torchloom.model.build import build_classifier
from torchloom.model.tiny import write_tiny_model
from torchloom.scoring import classification_metrics


def test_the_ranges_cover_the_split_once_each_starting_on_a_batch():
    for rows, batch, tasks in [(1, 16, 4), (203, 8, 4), (1000, 16, 1), (10_000_000, 16, 8), (100, 64, 50)]:
        got = shares(rows, batch, tasks)
        assert got[0][0] == 0 and sum(n for _, n in got) == rows
        assert all(a + n == b for (a, n), (b, _) in zip(got, got[1:]))  # contiguous, in order
        assert all(start % batch == 0 for start, _ in got)
        assert all(n <= max(TASK_ROWS, batch) for _, n in got)
    assert len(shares(203, 8, 4)) == 4 and len(shares(10_000_000, 16, 8)) == 153
    assert shares(0, 16, 4) == []


class _Spark:
    """What the stages hand evaluate (stages/sessions.py's ScoringSpark), over the tests' session."""

    def __init__(self, session):
        self.spark, self.lines = session, []

    def session(self):
        return self.spark

    def manifest(self, m):
        return m

    def say(self, line: str) -> None:
        self.lines.append(line)


@pytest.fixture(scope="module")
def scoring_setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("spark-scoring")
    data = tmp / "data"
    write_synthetic_dataset(data, rows={"train": 20, "val": 203, "test": 9}, rows_per_group=10, rows_per_shard=40,
                            min_len=3, max_len=30)
    model = build_classifier(write_tiny_model(tmp / "tiny", dropout=0.0), read_manifest(data).labels)
    return read_manifest(data), model


@pytest.mark.parametrize("packing", ["false", "true"])
def test_a_split_scored_by_spark_tasks_is_the_split_scored_in_one_process(spark, scoring_setup, packing):
    from torchloom.evaluate.run import scored_by, split_probabilities

    manifest, model = scoring_setup
    args = ["--eval.batch_size", "8", "--eval.precision", "fp32", "--engine.device", "cpu", "--train.packing",
            packing]
    alone = build(None, [*args, "--eval.score_with", "process"])
    tasks = build(None, [*args, "--eval.score_with", "spark"])
    assert scored_by(alone, manifest, "val") == "process" and scored_by(tasks, manifest, "val") == "spark"
    said = _Spark(spark)
    one = split_probabilities(alone, model, manifest, "val")
    many = split_probabilities(tasks, model, manifest, "val", said)
    assert len(one[0]) == 203
    for a, b in zip(one, many):  # probabilities, labels, positions: bit for bit
        assert a.dtype == b.dtype and np.array_equal(a, b)
    assert classification_metrics(one[0], one[1], manifest.labels) == classification_metrics(
        many[0], many[1], manifest.labels)
    assert said.lines[0].startswith("scoring val's 203 rows with Spark, 4 tasks of up to 56 rows"), said.lines
    assert "rows/s" in said.lines[-1]


def test_auto_scores_on_spark_only_a_large_split_of_a_run_on_spark(scoring_setup):
    from torchloom.evaluate.run import scored_by, split_probabilities

    manifest, model = scoring_setup
    assert scored_by(build(None, []), manifest, "val") == "process"  # the local engine: one process
    assert scored_by(build(None, ["--engine.name", "spark"]), manifest, "val") == "process"  # 203 rows: small
    assert scored_by(build(None, ["--engine.name", "spark", "--eval.spark_rows", "200"]), manifest, "val") == "spark"
    assert scored_by(build(None, ["--engine.name", "spark", "--eval.spark_rows", "200"]), manifest, "test") == "process"
    from torchloom.errors import UserError

    with pytest.raises(UserError, match="no SparkSession to score with; set eval.score_with process"):
        split_probabilities(build(None, ["--eval.score_with", "spark"]), model, manifest, "val")


def test_a_tagged_split_of_70_tags_scored_by_spark_tasks_is_the_split_scored_in_one_process(spark, tmp_path):
    """Issue 78, item 4: tag-id lists of different widths in different shards (so in different tasks) come back
    padded to one width, row for row the one process's."""
    import dataclasses

    import pyarrow as pa
    import pyarrow.parquet as pq

    from torchloom import tag_scoring as ts
    from torchloom.evaluate.run import split_probabilities

    data = tmp_path / "data"
    write_synthetic_dataset(data, rows={"train": 20, "val": 120, "test": 9}, rows_per_group=10, rows_per_shard=40,
                            min_len=3, max_len=30)
    m = read_manifest(data)
    labels = [f"tag-{i:02d}" for i in range(70)]
    rng = np.random.default_rng(0)
    for s, shard in enumerate(m.split("val").shards):
        path = data / shard.path
        table = pq.read_table(path)
        widest = 1 + 2 * s  # 1, 3, 5 tags at most: each task's arrays of another width
        ids = [sorted(rng.choice(70, rng.integers(0, widest + 1), replace=False).tolist()) for _ in range(len(table))]
        table = table.set_column(table.schema.get_field_index("label_id"), "label_id",
                                 pa.array(ids, pa.list_(pa.int32())))
        pq.write_table(table, path, row_group_size=10)
    dataclasses.replace(m, labels=labels, task="multi_label").write(data)
    m = read_manifest(data)
    model = build_classifier(write_tiny_model(tmp_path / "tiny", dropout=0.0), labels, multi_label=True)
    args = ["--eval.batch_size", "8", "--eval.precision", "fp32", "--engine.device", "cpu"]
    one = split_probabilities(build(None, [*args, "--eval.score_with", "process"]), model, m, "val")
    many = split_probabilities(build(None, [*args, "--eval.score_with", "spark"]), model, m, "val", _Spark(spark))
    assert one[1].shape == (120, 5) and many[1].shape == (120, 5)  # the widest row's width, -1 padded
    for a, b in zip(one, many):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    hot = ts.multi_hot(many[1], 70)
    assert hot.sum() == (many[1] >= 0).sum() and ts.evaluation(many[0], many[1], labels)["n"] == 120
