"""How a text is scored, in numpy only: the one place every scoring path (evaluate, validation in training,
predict, serve, Spark batch, the ONNX gate) takes its arithmetic from.

A text's score is the softmax of the mean of its windows' logits (a text prepared whole is one window, so its
score is the softmax of its own logits): `text_scores`. The classification metrics follow scikit-learn so
numbers can be checked against it: precision, recall and F1 of a class with nothing to divide by are 0; macro
averages run over the classes that occur in the labels or the predictions; ROC AUC is one-vs-rest, averaged
over classes present in the labels.

This module imports nothing from torchloom and nothing heavier than numpy (an import-linter contract).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

# Probabilities are clipped to [LOSS_EPS, 1] before the log, so one confident mistake gives a large
# but finite loss.
LOSS_EPS = 1e-12


class TextScores(NamedTuple):
    """One row per text, texts in the order of their ids (`docs`' sorted distinct values)."""

    probs: np.ndarray  # [T, C] float64: the softmax of `logits`
    logits: np.ndarray  # [T, C] float64: the mean of the text's windows' logits
    first: np.ndarray  # [T] the position in the input of the text's first window


def softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise softmax in float64 (shifted by the row's largest logit, so large logits do not overflow)."""
    logits = np.asarray(logits, dtype=np.float64)
    if not len(logits):
        return logits
    shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
    return shifted / shifted.sum(axis=1, keepdims=True)


def sigmoid(logits: np.ndarray) -> np.ndarray:
    """Element-wise logistic in float64 (a multi-label head: each tag's probability on its own)."""
    return 1.0 / (1.0 + np.exp(-np.clip(np.asarray(logits, dtype=np.float64), -60.0, 60.0)))


def mean_by_text(logits: np.ndarray, docs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(mean logits per text in float64, each text's first position in `docs`).

    docs: the text each row of `logits` is a window of (any ids; rows may come in any order)."""
    logits = np.asarray(logits)
    found, first, inverse = np.unique(np.asarray(docs), return_index=True, return_inverse=True)
    sums = np.zeros((len(found), logits.shape[1]), np.float64)
    np.add.at(sums, inverse.reshape(-1), logits.astype(np.float64))
    return sums / np.bincount(inverse.reshape(-1), minlength=len(found))[:, None], first


def text_scores(logits: np.ndarray, docs: np.ndarray | None = None, multi_label: bool = False) -> TextScores:
    """Each text's score from its windows' logits [N, C]: the softmax of their mean (multi_label: the sigmoid).

    docs: the text each row is a window of; None: every row is a text of its own."""
    logits = np.asarray(logits)
    squash = sigmoid if multi_label else softmax
    if docs is None:
        mean = logits.astype(np.float64)
        return TextScores(squash(mean), mean, np.arange(len(logits)))
    if len(docs) != len(logits):
        raise ValueError(f"docs has {len(docs)} entries for {len(logits)} rows of logits")
    mean, first = mean_by_text(logits, docs)
    return TextScores(squash(mean), mean, first)


def classification_metrics(
    probs: np.ndarray, labels: np.ndarray, label_names: list[str], calibration_bins: int = 10
) -> dict[str, Any]:
    """Accuracy, F1s, per-class scores, ROC AUC, calibration, confusion matrix and loss as plain JSON types.

    probs: [N, C] class probabilities (rows sum to 1); labels: [N] true class ids in [0, C).
    """
    probs = np.asarray(probs, dtype=np.float64)
    labels = np.asarray(labels)
    sums = class_sums(probs, labels, len(label_names), calibration_bins)
    if probs.shape[0] == 0:
        raise ValueError("no rows to evaluate: the split is empty")
    out = metrics_from_sums(sums, label_names, calibration_bins)
    out["roc_auc"] = _roc_auc(probs, labels)
    return out


def class_sums(probs: np.ndarray, labels: np.ndarray, num_classes: int, calibration_bins: int = 10) -> np.ndarray:
    """What every metric but ROC AUC is a function of, as sums that add up across parts of a split (so ranks
    all-reduce them instead of gathering rows): one float64 vector [rows, summed log loss, the confusion matrix
    (C x C, true by predicted), and per calibration bin its count, summed confidence and summed correct]. No rows:
    zeros. probs: [N, C] class probabilities; labels: [N] true class ids in [0, C)."""
    probs = np.asarray(probs, dtype=np.float64)
    labels = np.asarray(labels)
    if probs.ndim != 2 or probs.shape[1] != num_classes:
        raise ValueError(f"probs has shape {probs.shape}, expected [N, {num_classes}] for {num_classes} labels")
    if labels.shape != (probs.shape[0],):
        raise ValueError(f"labels has shape {labels.shape}, expected [{probs.shape[0]}] to match probs")
    if len(labels) and (not np.issubdtype(labels.dtype, np.integer) or labels.min() < 0
                        or labels.max() >= num_classes):
        raise ValueError(f"labels must be integer class ids in [0, {num_classes})")
    if calibration_bins < 1:
        raise ValueError(f"calibration_bins must be >= 1, got {calibration_bins}")
    labels = labels.astype(np.int64)
    n = probs.shape[0]
    predicted = probs.argmax(axis=1) if n else np.zeros(0, np.int64)
    confusion = np.bincount(labels * num_classes + predicted, minlength=num_classes**2)
    confidence = probs.max(axis=1) if n else np.zeros(0)
    correct = (predicted == labels).astype(np.float64)
    bin_of = np.searchsorted(np.linspace(0.0, 1.0, calibration_bins + 1)[1:-1], confidence, side="left")
    loss = -np.log(np.clip(probs[np.arange(n), labels], LOSS_EPS, 1.0)).sum()
    return np.concatenate([[n, loss], confusion, np.bincount(bin_of, minlength=calibration_bins),
                           np.bincount(bin_of, weights=confidence, minlength=calibration_bins),
                           np.bincount(bin_of, weights=correct, minlength=calibration_bins)]).astype(np.float64)


def metrics_from_sums(sums: np.ndarray, label_names: list[str], calibration_bins: int = 10) -> dict[str, Any]:
    """classification_metrics' numbers, ROC AUC aside, from class_sums' vector (of one part, or summed over
    parts: the same numbers as of all the rows at once)."""
    num_classes, bins = len(label_names), calibration_bins
    sums = np.asarray(sums, np.float64)
    if sums.shape != (2 + num_classes**2 + 3 * bins,):
        raise ValueError(f"sums has shape {sums.shape}, not class_sums' for {num_classes} labels and {bins} bins")
    n = int(round(sums[0]))
    if n == 0:
        raise ValueError("no rows to evaluate: the split is empty")
    confusion = np.rint(sums[2:2 + num_classes**2]).astype(np.int64).reshape(num_classes, num_classes)
    count, confidence_sum, correct_sum = sums[2 + num_classes**2:].reshape(3, bins)
    true_positives = np.diag(confusion).astype(np.float64)
    support = confusion.sum(axis=1)
    predicted_count = confusion.sum(axis=0)
    precision = _safe_divide(true_positives, predicted_count)
    recall = _safe_divide(true_positives, support)
    # 2tp / (2tp + fp + fn): equal to the harmonic mean, and 0 (not NaN) when the class never occurs.
    f1 = _safe_divide(2 * true_positives, support + predicted_count)
    occurs = (support + predicted_count) > 0
    calibration = _calibration(np.rint(count), confidence_sum, correct_sum, n)
    return {
        "n": n,
        "label_names": list(label_names),
        "accuracy": float(true_positives.sum() / n),
        "macro_f1": float(f1[occurs].mean()),
        "weighted_f1": float((f1 * support).sum() / n),
        "per_class": {
            name: {
                "precision": float(precision[i]),
                "recall": float(recall[i]),
                "f1": float(f1[i]),
                "support": int(support[i]),
            }
            for i, name in enumerate(label_names)
        },
        "roc_auc": None,  # a rank statistic: no sum holds it (classification_metrics computes it from the rows)
        "ece": calibration["ece"],
        "reliability": calibration["bins"],
        "confusion_matrix": confusion.tolist(),
        "loss": float(sums[1] / n),
    }


def binary_auc(scores: np.ndarray, positive: np.ndarray) -> float | None:
    """Exact ROC AUC by the Mann-Whitney rank sum (ties count one half); None with only one class present."""
    scores = np.asarray(scores, dtype=np.float64)
    positive = np.asarray(positive, dtype=bool)
    n_pos = int(positive.sum())
    n_neg = positive.size - n_pos
    if n_pos == 0 or n_neg == 0:
        return None
    ranks = average_ranks(scores)
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def average_ranks(values: np.ndarray) -> np.ndarray:
    """1-based ranks; tied values share the mean of the ranks they span (scipy's rankdata 'average')."""
    values = np.asarray(values)
    order = np.argsort(values, kind="mergesort")
    sorted_values = values[order]
    starts_group = np.r_[True, sorted_values[1:] != sorted_values[:-1]]
    group_of_sorted = np.cumsum(starts_group) - 1
    bounds = np.r_[np.flatnonzero(starts_group), values.size]
    # A group spanning sorted positions [lo, hi) holds ranks lo+1 .. hi, whose mean is (lo + 1 + hi) / 2.
    mean_rank = (bounds[:-1] + 1 + bounds[1:]) / 2.0
    ranks = np.empty(values.size, dtype=np.float64)
    ranks[order] = mean_rank[group_of_sorted]
    return ranks


def _roc_auc(probs: np.ndarray, labels: np.ndarray) -> float | None:
    num_classes = probs.shape[1]
    if num_classes == 2:
        return binary_auc(probs[:, 1], labels == 1)
    aucs = [binary_auc(probs[:, c], labels == c) for c in range(num_classes)]
    defined = [a for a in aucs if a is not None]
    return float(np.mean(defined)) if defined else None


def _calibration(count: np.ndarray, confidence_sum: np.ndarray, correct_sum: np.ndarray, n: int) -> dict[str, Any]:
    """Expected calibration error of the top-1 confidence over equal-width bins (lo, hi]; 0 falls in bin 0; from
    each bin's count, summed confidence and summed correct (class_sums)."""
    num_bins = len(count)
    edges = np.linspace(0.0, 1.0, num_bins + 1)
    filled = count > 0
    mean_confidence = _safe_divide(confidence_sum, count)
    mean_accuracy = _safe_divide(correct_sum, count)
    ece = float((np.abs(mean_accuracy - mean_confidence) * count)[filled].sum() / n)
    return {
        "ece": ece,
        "bins": {
            "edges": edges.tolist(),
            # Empty bins have no mean: None, so JSON and plots can tell them from a real 0.
            "confidence": [float(v) if f else None for v, f in zip(mean_confidence, filled)],
            "accuracy": [float(v) if f else None for v, f in zip(mean_accuracy, filled)],
            "count": count.astype(int).tolist(),
        },
    }


def _safe_divide(numerator: np.ndarray, denominator: np.ndarray) -> np.ndarray:
    numerator = np.asarray(numerator, dtype=np.float64)
    denominator = np.asarray(denominator, dtype=np.float64)
    out = np.zeros_like(numerator)
    np.divide(numerator, denominator, out=out, where=denominator > 0)
    return out



# -- the shipped mix of the transformer and the classical baseline -------------------------------------------
# The transformer's weights tried on validation (0: the baseline alone, 1: the transformer alone).
MIX_GRID = tuple(i / 20 for i in range(21))


def mix(transformer: np.ndarray, baseline: np.ndarray, weight: float) -> np.ndarray:
    """The shipped model's probabilities: `weight` x the transformer's + (1 - weight) x the baseline's."""
    return weight * np.asarray(transformer, np.float64) + (1.0 - weight) * np.asarray(baseline, np.float64)


def choose_weight(transformer: np.ndarray, baseline: np.ndarray, labels: np.ndarray,
                  grid: tuple[float, ...] = MIX_GRID) -> tuple[float, list[dict[str, float]]]:
    """The transformer's weight with the best accuracy on these (validation) texts; a tie goes to the lower log
    loss, then to the higher weight (less of the baseline to serve). Returns (weight, one row per weight tried)."""
    labels = np.asarray(labels)
    rows = []
    for w in grid:
        p = mix(transformer, baseline, w)
        accuracy = float(np.mean(p.argmax(axis=1) == labels)) if len(labels) else 0.0
        picked = p[np.arange(len(labels)), labels] if len(labels) else np.ones(0)
        loss = float(-np.mean(np.log(np.clip(picked, LOSS_EPS, 1.0)))) if len(labels) else 0.0
        rows.append({"weight": w, "accuracy": accuracy, "loss": loss})
    best = max(rows, key=lambda r: (r["accuracy"], -r["loss"], r["weight"]))
    return best["weight"], rows
