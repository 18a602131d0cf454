"""Hierarchical labels in the report: the shipped model's scores at every level of the label paths
(text/hierarchy.py: the model predicts leaves, a parent is its leaf's prefix), the leaves last."""

from __future__ import annotations

from typing import Any

import numpy as np

from torchloom import tag_scoring as ts
from torchloom.text import hierarchy


def _projection(labels: list[str], level: int, delimiter: str) -> tuple[list[str], np.ndarray]:
    """The level's names and each label's index among them."""
    names = [hierarchy.at_depth(label, level, delimiter) for label in labels]
    found = sorted(set(names))
    return found, np.array([found.index(n) for n in names], np.int64)


def single_label(probs: np.ndarray, truth: np.ndarray, labels: list[str], delimiter: str) -> list[dict[str, Any]]:
    """Accuracy and macro-F1 per level, by scoring.classification_metrics (the leaves' arithmetic) on the parent of
    each predicted leaf."""
    from torchloom.scoring import classification_metrics

    pred = probs.argmax(axis=1) if len(probs) else np.zeros(0, np.int64)
    out = []
    for level in range(1, hierarchy.levels(labels, delimiter) + 1):
        names, index = _projection(labels, level, delimiter)
        chosen = np.eye(len(names))[index[pred]]  # the predicted parent, as certain: one path, never a vote
        m = classification_metrics(chosen, index[np.asarray(truth, np.int64)], names)
        out.append({"level": level, "labels": len(names), "accuracy": m["accuracy"], "macro_f1": m["macro_f1"]})
    return out


def multi_label(probs: np.ndarray, masks: np.ndarray, labels: list[str], delimiter: str, thresholds: ts.Thresholds
                ) -> list[dict[str, Any]]:
    """Micro- and macro-F1 per level: a text holds a parent where it holds (or is predicted) one of its leaves."""
    truth, pred = ts.multi_hot(masks, len(labels)), ts.predict(probs, thresholds)
    out = []
    for level in range(1, hierarchy.levels(labels, delimiter) + 1):
        names, index = _projection(labels, level, delimiter)
        onto = np.zeros((len(labels), len(names)), np.int64)
        onto[np.arange(len(labels)), index] = 1
        m = ts.tag_metrics((pred.astype(np.int64) @ onto) > 0, (truth.astype(np.int64) @ onto) > 0, names)
        out.append({"level": level, "labels": len(names), "micro_f1": m["micro_f1"], "macro_f1": m["macro_f1"],
                    "accuracy": m["subset_accuracy"]})
    return out


def record(metrics: dict[str, Any], delimiter: str, levels: list[dict[str, Any]]) -> None:
    """The levels into a split's metrics: the table, and each level's scores as numbers of their own (MLflow)."""
    metrics["levels"], metrics["label_path_delimiter"] = levels, delimiter
    for row in levels:
        metrics.update({f"level{row['level']}_{k}": v for k, v in row.items() if k not in ("level", "labels")})


def section(levels: list[dict[str, Any]], delimiter: str) -> list[str]:
    """The report's table of every level's scores."""
    multi = "micro_f1" in levels[0]
    head = ("| level | labels | micro F1 | macro F1 | subset accuracy |" if multi else
        "| level | labels | accuracy | macro F1 |")
    lines = ["## Per level", "", f"Labels are paths (`{delimiter}` between levels): the model predicts the leaves and"
             " a parent is its leaf's prefix. Level 1 is the top.", "", head, "|---" * head.count(" | ") + "|---|"]
    for row in levels:
        cells = [row["micro_f1"], row["macro_f1"], row["accuracy"]] if multi else [row["accuracy"], row["macro_f1"]]
        lines.append(f"| {row['level']} | {row['labels']} | " + " | ".join(f"{v:.4f}" for v in cells) + " |")
    return lines + [""]
