"""The classical baseline (etl/baseline.py, evaluate/baseline.py): what it trains on, what it scores,
and how it is reported beside the transformer."""

from __future__ import annotations

import numpy as np
import pytest

from torchloom.data.synthetic import write_synthetic_dataset
from torchloom.evaluate.metrics import classification_metrics
from torchloom.manifest import read as read_manifest

pytest.importorskip("pyspark")


def test_baseline_scores_agree_with_the_evaluation_metrics():
    from torchloom.etl.baseline import scores

    rng = np.random.default_rng(0)
    labels = rng.integers(0, 3, 300)  # class 3 never occurs in the labels but is predicted at times
    pred = np.where(rng.random(300) < 0.7, labels, rng.integers(0, 4, 300))
    confusion = [[int(np.sum((labels == t) & (pred == p))) for p in range(4)] for t in range(4)]
    m = classification_metrics(np.eye(4)[pred], labels, ["a", "b", "c", "d"])
    s = scores(confusion)
    assert s["n"] == 300
    assert s["accuracy"] == pytest.approx(m["accuracy"]) and s["macro_f1"] == pytest.approx(m["macro_f1"])


def test_the_baseline_trains_on_train_and_scores_exactly_the_prepared_splits(spark, tmp_path):
    from torchloom.etl.baseline import fit_and_score

    written = write_synthetic_dataset(tmp_path / "data", rows={"train": 150, "val": 30, "test": 45})
    m = read_manifest(tmp_path / "data")
    result = fit_and_score(spark, m, ["val", "test"])
    assert result["train_rows"] == 150 and result["fingerprint"] == written.fingerprint
    assert set(result["splits"]) == {"val", "test"}
    for split in ("val", "test"):
        confusion = result["splits"][split]["confusion_matrix"]
        # every row of the split scored once, under its own label
        assert [sum(row) for row in confusion] == [m.split(split).per_class.get(lb, 0) for lb in m.labels]
    # the synthetic texts draw most words from their label's band of the vocabulary: learnable (chance: 1/3)
    assert result["splits"]["test"]["accuracy"] >= 0.7, result["splits"]["test"]


def comparison_with(transformer_accuracy: float, baseline_accuracy: float, split: str = "test") -> dict:
    from torchloom.evaluate.baseline import comparison

    stored = {"name": "TF-IDF + logistic regression", "description": "d", "seconds": 1.0,
              "splits": {split: {"n": 10, "accuracy": baseline_accuracy, "macro_f1": baseline_accuracy}}}
    return comparison({"accuracy": transformer_accuracy, "macro_f1": transformer_accuracy}, stored, split)


def test_the_verdict_names_the_likely_cause_only_when_the_transformer_does_not_win(tmp_path):
    from torchloom.evaluate.baseline import verdict

    # every text reaches max_length (min_len = max_len): all truncated
    write_synthetic_dataset(tmp_path / "cut", rows={"train": 8, "test": 8}, min_len=24, max_len=24)
    write_synthetic_dataset(tmp_path / "whole", rows={"train": 8, "test": 8}, min_len=4, max_len=12)
    cut, whole = read_manifest(tmp_path / "cut"), read_manifest(tmp_path / "whole")
    assert verdict(comparison_with(0.91, 0.90), cut, None) is None  # it won: nothing to say
    line = verdict(comparison_with(0.85, 0.90), cut, None)
    assert line.startswith("the transformer trails the TF-IDF + logistic regression baseline on test"
                           " (accuracy 0.8500 against 0.9000); likely cause: truncation: 100% of the test texts")
    assert "\n" not in line
    assert "ties with" in verdict(comparison_with(0.9, 0.9), cut, None)
    still_improving = {"steps": 40, "best_step": 40, "stopped_early": False}
    assert "too few epochs" in verdict(comparison_with(0.85, 0.90), whole, still_improving)
    plateaued = {"steps": 40, "best_step": 20, "stopped_early": False}
    assert "likely cause: the baseline suits this data" in verdict(comparison_with(0.85, 0.90), whole, plateaued)
