"""Metrics against hand-computed values (and scikit-learn when it is importable), and the report files."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from torchloom.evaluate.report import read_metrics_jsonl, write_report
from torchloom.scoring import average_ranks, binary_auc, classification_metrics

NAMES = ["a", "b", "c"]
# Six rows worked through by hand below: predictions 0, 1, 1, 2, 0, 2.
PROBS = np.array([
    [0.7, 0.2, 0.1],   # true a, predicted a
    [0.2, 0.6, 0.2],   # true a, predicted b
    [0.1, 0.8, 0.1],   # true b, predicted b
    [0.3, 0.3, 0.4],   # true c, predicted c
    [0.5, 0.25, 0.25],  # true c, predicted a
    [0.1, 0.1, 0.8],   # true c, predicted c
])
LABELS = np.array([0, 0, 1, 2, 2, 2])


def test_metrics_match_hand_computed_values():
    m = classification_metrics(PROBS, LABELS, NAMES)
    assert m["n"] == 6
    assert m["confusion_matrix"] == [[1, 1, 0], [0, 1, 0], [1, 0, 2]]
    assert m["accuracy"] == pytest.approx(4 / 6)
    assert m["per_class"]["a"] == pytest.approx({"precision": 0.5, "recall": 0.5, "f1": 0.5, "support": 2})
    assert m["per_class"]["b"] == pytest.approx({"precision": 0.5, "recall": 1.0, "f1": 2 / 3, "support": 1})
    assert m["per_class"]["c"] == pytest.approx({"precision": 1.0, "recall": 2 / 3, "f1": 0.8, "support": 3})
    assert m["macro_f1"] == pytest.approx((0.5 + 2 / 3 + 0.8) / 3)
    assert m["weighted_f1"] == pytest.approx((0.5 * 2 + 2 / 3 * 1 + 0.8 * 3) / 6)
    # One-vs-rest: a = 6 of 8 pairs ranked right, b and c separate perfectly.
    assert m["roc_auc"] == pytest.approx((0.75 + 1.0 + 1.0) / 3)
    expected_loss = -np.mean(np.log([0.7, 0.2, 0.8, 0.4, 0.25, 0.8]))
    assert m["loss"] == pytest.approx(expected_loss)


def test_ece_and_reliability_bins_use_upper_closed_bins():
    m = classification_metrics(PROBS, LABELS, NAMES, calibration_bins=10)
    # Confidences .7 .6 .8 .4 .5 .8 each sit on a bin's upper edge, so each lands in the bin below it.
    assert m["reliability"]["count"] == [0, 0, 0, 1, 1, 1, 1, 2, 0, 0]
    assert m["reliability"]["accuracy"][7] == 1.0
    assert m["reliability"]["confidence"][7] == pytest.approx(0.8)
    assert m["reliability"]["accuracy"][0] is None and m["reliability"]["confidence"][0] is None
    assert len(m["reliability"]["edges"]) == 11
    assert m["ece"] == pytest.approx((0.3 + 0.6 + 0.2 * 2 + 0.6 + 0.5) / 6)

    two = classification_metrics(PROBS, LABELS, NAMES, calibration_bins=2)
    # (0, .5]: conf .4 .5, acc 1/2; (.5, 1]: conf .7 .6 .8 .8, acc 3/4.
    assert two["reliability"]["count"] == [2, 4]
    assert two["ece"] == pytest.approx((abs(0.5 - 0.45) * 2 + abs(0.75 - 0.725) * 4) / 6)


def test_binary_auc_counts_ties_as_half():
    assert binary_auc(np.array([0.1, 0.4, 0.35, 0.8]), np.array([0, 0, 1, 1])) == pytest.approx(0.75)
    # Pairs (pos, neg): (.5,.5) (.5,.5) count 1/2 each, (.9,.5) (.9,.5) count 1 each.
    assert binary_auc(np.array([0.5, 0.5, 0.5, 0.9]), np.array([0, 1, 0, 1])) == pytest.approx(0.75)
    assert binary_auc(np.array([0.3, 0.3]), np.array([0, 1])) == pytest.approx(0.5)
    assert binary_auc(np.array([0.2, 0.9]), np.array([1, 1])) is None
    assert average_ranks(np.array([30, 10, 20, 20])).tolist() == [4.0, 1.0, 2.5, 2.5]


def test_binary_roc_auc_is_the_positive_class():
    probs = np.array([[0.9, 0.1], [0.4, 0.6], [0.3, 0.7], [0.8, 0.2]])
    m = classification_metrics(probs, np.array([0, 1, 0, 1]), ["neg", "pos"])
    # Positive scores .6 .2 against negative .1 .7: .6 > .1, .6 < .7, .2 > .1, .2 < .7.
    assert m["roc_auc"] == pytest.approx(0.5)


def test_absent_classes_are_skipped_and_single_class_auc_is_none():
    probs = np.array([[0.6, 0.3, 0.1], [0.2, 0.7, 0.1], [0.5, 0.4, 0.1], [0.1, 0.8, 0.1]])
    labels = np.array([0, 1, 1, 0])
    m = classification_metrics(probs, labels, NAMES)
    auc_a = binary_auc(probs[:, 0], labels == 0)
    auc_b = binary_auc(probs[:, 1], labels == 1)
    assert m["roc_auc"] == pytest.approx((auc_a + auc_b) / 2)
    # Class c is never true nor predicted: left out of the macro F1, listed with zeros.
    assert m["per_class"]["c"] == {"precision": 0.0, "recall": 0.0, "f1": 0.0, "support": 0}
    assert m["macro_f1"] == pytest.approx((m["per_class"]["a"]["f1"] + m["per_class"]["b"]["f1"]) / 2)

    single = classification_metrics(probs, np.array([1, 1, 1, 1]), NAMES)
    assert single["roc_auc"] is None
    assert json.loads(json.dumps(single))["roc_auc"] is None


def test_loss_is_clipped_for_a_zero_probability():
    m = classification_metrics(np.array([[1.0, 0.0], [0.0, 1.0]]), np.array([1, 1]), ["x", "y"])
    assert math.isfinite(m["loss"]) and m["loss"] > 10


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="shape"):
        classification_metrics(PROBS, LABELS, ["a", "b"])
    with pytest.raises(ValueError, match="labels"):
        classification_metrics(PROBS, LABELS[:-1], NAMES)
    with pytest.raises(ValueError, match="class ids"):
        classification_metrics(PROBS, np.array([0, 0, 1, 2, 2, 3]), NAMES)


@pytest.mark.parametrize("num_classes", [2, 4])
def test_metrics_agree_with_sklearn(num_classes):
    skm = pytest.importorskip("sklearn.metrics")
    rng = np.random.default_rng(num_classes)
    n = 300
    labels = rng.integers(0, num_classes, n)
    # Coarse integer weights make many tied scores, which is where AUC implementations differ.
    weights = rng.integers(1, 6, size=(n, num_classes)).astype(float)
    weights[np.arange(n), labels] += rng.integers(0, 4, n)
    probs = weights / weights.sum(axis=1, keepdims=True)
    names = [f"class{i}" for i in range(num_classes)]
    m = classification_metrics(probs, labels, names)
    predicted = probs.argmax(axis=1)

    assert m["accuracy"] == pytest.approx(skm.accuracy_score(labels, predicted))
    assert m["macro_f1"] == pytest.approx(skm.f1_score(labels, predicted, average="macro"))
    assert m["weighted_f1"] == pytest.approx(skm.f1_score(labels, predicted, average="weighted"))
    precision, recall, f1, support = skm.precision_recall_fscore_support(
        labels, predicted, labels=list(range(num_classes)), zero_division=0
    )
    for i, name in enumerate(names):
        assert m["per_class"][name] == pytest.approx(
            {"precision": precision[i], "recall": recall[i], "f1": f1[i], "support": support[i]}
        )
    assert m["confusion_matrix"] == skm.confusion_matrix(labels, predicted).tolist()
    assert m["loss"] == pytest.approx(skm.log_loss(labels, probs))
    if num_classes == 2:
        expected_auc = skm.roc_auc_score(labels, probs[:, 1])
    else:
        expected_auc = skm.roc_auc_score(labels, probs, multi_class="ovr", average="macro")
    assert m["roc_auc"] == pytest.approx(expected_auc)


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _misclassified():
    return [
        {"text": "a | piped text", "true": "a", "predicted": "b", "score": 0.6},
        {"text": "second", "true": "c", "predicted": "a", "score": 0.5},
    ]


def _write_history(path):
    lines = []
    for step in range(1, 21):
        lines.append({"kind": "train", "step": step, "epoch": step / 10, "loss": 2.0 / step, "lr": 1e-4,
                      "grad_norm": 1.0, "samples_per_s": 10.0})
        if step % 10 == 0:
            lines.append({"kind": "eval", "step": step, "epoch": step / 10, "loss": 1.0 / step,
                          "accuracy": 0.5 + step / 100, "macro_f1": 0.5})
    text = "".join(json.dumps(line) + "\n" for line in lines)
    path.write_text(text + '{"kind": "train", "st', encoding="utf-8")  # a line still being written


def test_write_report_writes_every_file(tmp_path):
    metrics = classification_metrics(PROBS, LABELS, NAMES)
    history = tmp_path / "metrics.jsonl"
    _write_history(history)
    written = write_report(tmp_path, metrics, split="test", label_names=NAMES, misclassified=_misclassified(),
                           metrics_jsonl_path=history, extra={"timings": {"eval_s": 1.5}, "bad": float("nan")})

    assert set(written) == {"report_json", "report_md", "misclassified", "confusion_plot", "calibration_plot",
                            "loss_plot"}
    report = json.loads((tmp_path / "report.json").read_text(encoding="utf-8"))
    assert report["split"] == "test"
    assert report["metrics"]["accuracy"] == pytest.approx(4 / 6)
    assert report["metrics"]["confusion_matrix"] == [[1, 1, 0], [0, 1, 0], [1, 0, 2]]
    assert report["timings"] == {"eval_s": 1.5}
    assert report["bad"] is None  # NaN is not JSON
    assert report["files"]["loss_plot"] == "plots/loss.png"

    rows = [json.loads(line) for line in (tmp_path / "misclassified.jsonl").read_text().splitlines()]
    assert rows == _misclassified()

    for name in ("confusion", "calibration", "loss"):
        data = (tmp_path / "plots" / f"{name}.png").read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000

    md = (tmp_path / "report.md").read_text(encoding="utf-8")
    assert "| accuracy | 0.6667 |" in md
    assert "| **c** | 1 | 0 | 2 |" in md
    assert "| c | 1.0000 | 0.6667 | 0.8000 | 3 |" in md
    assert "a \\| piped text" in md
    assert "| eval_s | 1.5000 |" in md and "| bad | n/a |" in md
    for link in ("plots/confusion.png", "plots/calibration.png", "plots/loss.png", "misclassified.jsonl"):
        assert f"({link})" in md
    assert not [p.name for p in tmp_path.rglob(".*tmp*")]


@pytest.mark.parametrize("history", ["missing", "empty", "garbage"])
def test_loss_plot_is_skipped_without_history(tmp_path, history):
    path = tmp_path / "metrics.jsonl"
    if history == "empty":
        path.write_text("", encoding="utf-8")
    elif history == "garbage":
        path.write_text("not json\n[1, 2]\n", encoding="utf-8")
    metrics = classification_metrics(PROBS, LABELS, NAMES)
    written = write_report(tmp_path / "run", metrics, split="val", label_names=NAMES, misclassified=[],
                           metrics_jsonl_path=path)
    assert "loss_plot" not in written
    assert not (tmp_path / "run" / "plots" / "loss.png").exists()
    md = (tmp_path / "run" / "report.md").read_text(encoding="utf-8")
    assert "loss.png" not in md and "None." in md
    assert (tmp_path / "run" / "misclassified.jsonl").read_text() == ""


def test_read_metrics_jsonl_skips_partial_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    _write_history(path)
    rows = read_metrics_jsonl(path)
    assert len(rows) == 22
    assert [r["step"] for r in rows if r["kind"] == "eval"] == [10, 20]


def test_extra_may_not_override_report_keys(tmp_path):
    metrics = classification_metrics(PROBS, LABELS, NAMES)
    with pytest.raises(ValueError, match="metrics"):
        write_report(tmp_path, metrics, split="test", label_names=NAMES, misclassified=[],
                     extra={"metrics": {}})
