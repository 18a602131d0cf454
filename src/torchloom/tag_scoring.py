"""Multi-label scoring: sigmoid probabilities, thresholds chosen on validation, tags predicted, and the metrics of
a tagger. numpy and the standard library only, like scoring.py beside it (every scoring path stands on both).

Tag sets arrive as tag ids [N, width] padded with -1 (text/tags.py; older shards' int64 masks too) or as boolean
[N, K] arrays (`multi_hot`).

**Thresholds, honestly.** A threshold tuned per label on a small validation split fits that split's noise, so the
rule (docs/evaluation.md) is:
1. one global threshold, the one of GRID with the best micro-F1 on validation (ties: the one nearest 0.5);
2. a label with at least `min_support` positive validation rows (MIN_SUPPORT by default) gets its own threshold,
   the one of GRID with that label's best F1, kept only where it beats the global threshold on that label by at
   least MIN_GAIN F1; every other label uses the global one;
3. `at_least_one`: a text whose tags are all under their thresholds gets its most probable tag (on when every
   training row had a tag), applied while choosing the thresholds too.
`top_k` instead: the k most probable tags of every text, no threshold.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

GRID = tuple(round(0.05 * i, 2) for i in range(1, 20))  # 0.05 .. 0.95
MIN_SUPPORT = 30  # positive validation rows before a label gets a threshold of its own
MIN_GAIN = 0.01  # the F1 on validation a label's own threshold must gain over the global one


def multi_hot(masks: np.ndarray, k: int) -> np.ndarray:
    """Tag sets -> bool [N, k]: tag ids [N, width] padded with -1 (text/tags.py), or int64 masks [N] (bit i: tag
    i) as older shards hold them."""
    masks = np.asarray(masks, np.int64)
    if masks.ndim == 2:
        hot = np.zeros((len(masks), k + 1), bool)  # column k takes the padding
        hot[np.repeat(np.arange(len(masks)), masks.shape[1]), np.where(masks >= 0, masks, k).ravel()] = True
        return hot[:, :k]
    return ((masks[:, None] >> np.arange(k, dtype=np.int64)[None, :]) & 1).astype(bool)


def label_array(column):
    """A shard's label_id column (pyarrow, chunked or not) as numpy int64: single labels (or older shards' masks)
    1-D; tag-id lists [rows, width], each row padded with -1 to the longest list (width at least 1)."""
    if hasattr(column, "combine_chunks"):
        column = column.combine_chunks()
    if not hasattr(column.type, "value_type"):
        return np.asarray(column.to_numpy(zero_copy_only=False), np.int64)
    offsets = np.asarray(column.offsets.to_numpy(), np.int64)
    values = np.asarray(column.values.to_numpy(zero_copy_only=False), np.int64)[offsets[0]:offsets[-1]]
    lengths = np.diff(offsets)
    out = np.full((len(lengths), max(1, int(lengths.max(initial=0)))), -1, np.int64)
    out[np.arange(out.shape[1])[None, :] < lengths[:, None]] = values  # row-major order = the lists' order
    return out


def concat_labels(parts: Sequence):
    """np.concatenate of label arrays; tag-id arrays of different widths padded with -1 to the widest, and 2-D
    parts winning over empty 1-D ones (a part with no rows)."""
    parts = [np.asarray(p) for p in parts]
    wide = [p for p in parts if p.ndim == 2]
    if not wide:
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)
    width = max(p.shape[1] for p in wide)
    out = []
    for p in parts:
        if p.ndim == 1:
            if len(p):
                raise ValueError("tag-id rows mixed with single labels or masks")
            continue
        out.append(p if p.shape[1] == width else
                   np.concatenate([p, np.full((len(p), width - p.shape[1]), -1, p.dtype)], axis=1))
    return np.concatenate(out)


def to_ids(hot: np.ndarray) -> np.ndarray:
    """bool [N, k] -> tag ids [N, width] padded with -1 (width: the most tags a row holds, at least 1)."""
    hot = np.asarray(hot, bool)
    width = max(1, int(hot.sum(axis=1).max(initial=0)))
    ranked = np.sort(np.where(hot, np.arange(hot.shape[1])[None, :], hot.shape[1]), axis=1)[:, :width]
    return np.where(ranked < hot.shape[1], ranked, -1).astype(np.int64)


@dataclass
class Thresholds:
    default: float = 0.5
    per_label: dict[int, float] = field(default_factory=dict)  # label index -> its own threshold
    at_least_one: bool = False
    top_k: int = 0  # > 0: the k most probable tags instead of thresholds

    def array(self, k: int) -> np.ndarray:
        out = np.full(k, self.default, np.float32)
        for i, t in self.per_label.items():
            out[int(i)] = t
        return out

    def record(self, labels: Sequence[str]) -> dict:
        """As stored with the model (JSON): thresholds by label name."""
        return {"default": self.default, "per_label": {labels[int(i)]: t for i, t in sorted(self.per_label.items())},
                "at_least_one": self.at_least_one, "top_k": self.top_k}

    @classmethod
    def from_record(cls, record: dict, labels: Sequence[str]) -> Thresholds:
        index = {label: i for i, label in enumerate(labels)}
        return cls(float(record.get("default", 0.5)),
                   {index[name]: float(t) for name, t in (record.get("per_label") or {}).items() if name in index},
                   bool(record.get("at_least_one", False)), int(record.get("top_k", 0)))


def predict(probs: np.ndarray, thresholds: Thresholds) -> np.ndarray:
    """bool [N, K]: the tags each text gets."""
    probs = np.asarray(probs, np.float32)
    n, k = probs.shape
    if thresholds.top_k > 0:
        top = np.argsort(-probs, axis=1, kind="stable")[:, :min(thresholds.top_k, k)]
        hot = np.zeros((n, k), bool)
        np.put_along_axis(hot, top, True, axis=1)
        return hot
    hot = probs >= thresholds.array(k)[None, :]
    if thresholds.at_least_one and n and k:
        empty = ~hot.any(axis=1)
        hot[empty, probs[empty].argmax(axis=1)] = True
    return hot


def _f1(tp, fp, fn) -> np.ndarray:
    tp, fp, fn = (np.asarray(x, np.float64) for x in (tp, fp, fn))
    denominator = 2 * tp + fp + fn
    return np.divide(2 * tp, denominator, out=np.zeros_like(denominator), where=denominator > 0)


def _counts(pred: np.ndarray, truth: np.ndarray):
    tp = (pred & truth).sum(axis=0)
    return tp, (pred & ~truth).sum(axis=0), (~pred & truth).sum(axis=0)


def _best(scores: Sequence[float]) -> int:
    """The index of GRID with the best score; ties go to the threshold nearest 0.5."""
    best = max(scores)
    return min((i for i, s in enumerate(scores) if s >= best - 1e-12), key=lambda i: abs(GRID[i] - 0.5))


def grid_sums(probs: np.ndarray, truth: np.ndarray, at_least_one: bool = False) -> np.ndarray:
    """What the rule's choice is a function of, as sums that add up across parts of a split (ranks all-reduce them
    instead of gathering rows): float64 [2, len(GRID), 3, K] flattened, for each threshold of GRID the tags' tp, fp
    and fn with that threshold for every tag (at_least_one applied), then with each tag alone at it."""
    probs, truth = np.asarray(probs, np.float32), np.asarray(truth, bool)
    out = np.zeros((2, len(GRID), 3, truth.shape[1]), np.float64)
    for i, t in enumerate(GRID):
        out[0, i] = _counts(predict(probs, Thresholds(t, at_least_one=at_least_one)), truth)
        out[1, i] = _counts(probs >= t, truth)
    return out.reshape(-1)


def thresholds_from_grid(sums: np.ndarray, k: int, min_support: int = MIN_SUPPORT, at_least_one: bool = False
                         ) -> tuple[Thresholds, float]:
    """(the rule's thresholds from grid_sums' vector, the val micro-F1 of the global threshold alone). A tag's own
    threshold is kept here wherever it gains on that tag; `keep_own` then checks them together under
    at_least_one."""
    counts = np.asarray(sums, np.float64).reshape(2, len(GRID), 3, k)
    micro = [float(_f1(*counts[0, i].sum(axis=1))) for i in range(len(GRID))]
    g = _best(micro)
    chosen = Thresholds(GRID[g], at_least_one=at_least_one)
    base = _f1(*counts[0, g])
    support = counts[0, 0, 0] + counts[0, 0, 2]  # tp + fn: the same at every threshold
    for j in np.flatnonzero(support >= max(1, min_support)):
        scores = [float(_f1(*counts[1, i, :, j])) for i in range(len(GRID))]
        i = _best(scores)
        if scores[i] >= base[j] + MIN_GAIN and GRID[i] != chosen.default:
            chosen.per_label[int(j)] = GRID[i]
    return chosen, micro[g]


def keep_own(chosen: Thresholds, micro_with_own: float, micro_global: float) -> Thresholds:
    """at_least_one may move a text's tags: the tags' own thresholds stay only if together they do not lower val
    micro-F1 below the global threshold's."""
    if chosen.per_label and micro_with_own < micro_global - 1e-12:
        return Thresholds(chosen.default, at_least_one=chosen.at_least_one, top_k=chosen.top_k)
    return chosen


def choose_thresholds(probs: np.ndarray, truth: np.ndarray, min_support: int = MIN_SUPPORT,
                      at_least_one: bool = False) -> Thresholds:
    """The thresholds of the rule above, chosen on validation `probs` [N, K] against `truth` (bool [N, K])."""
    probs, truth = np.asarray(probs, np.float32), np.asarray(truth, bool)
    chosen, micro = thresholds_from_grid(grid_sums(probs, truth, at_least_one), truth.shape[1], min_support,
                                         at_least_one)
    if not chosen.per_label:
        return chosen
    return keep_own(chosen, float(_f1(*(c.sum() for c in _counts(predict(probs, chosen), truth)))), micro)


def tag_metrics(pred: np.ndarray, truth: np.ndarray, labels: Sequence[str]) -> dict:
    """A tagger's metrics on one split: micro/macro/samples precision, recall and F1, Hamming loss, subset
    accuracy, label cardinality (true and predicted), and per label precision, recall, F1 and support.

    Macro averages over the labels with support in this split (a label the split lacks has no recall to
    average); a text with no true and no predicted tag counts as a perfect sample (samples-F1 1)."""
    return metrics_from_sums(tag_sums(pred, truth), labels)


def tag_sums(pred: np.ndarray, truth: np.ndarray, probs: np.ndarray | None = None) -> np.ndarray:
    """What tag_metrics (and evaluation's loss, given probs) is a function of, as sums that add up across parts
    of a split, so ranks all-reduce them instead of gathering rows: one float64 vector [rows, texts with every tag
    right, summed samples precision, recall and F1, summed binary cross-entropy, then per tag tp, fp, fn]."""
    pred, truth = np.asarray(pred, bool), np.asarray(truth, bool)
    tp, fp, fn = _counts(pred, truth)
    row_tp, row_pred, row_true = (pred & truth).sum(1), pred.sum(1), truth.sum(1)
    both_empty = (row_pred + row_true) == 0
    samples_f1 = np.where(both_empty, 1.0, np.divide(2 * row_tp, row_pred + row_true, out=np.zeros(len(pred)),
                                                      where=~both_empty))
    samples_p = np.where(row_pred > 0, np.divide(row_tp, np.maximum(row_pred, 1)), both_empty.astype(float))
    samples_r = np.where(row_true > 0, np.divide(row_tp, np.maximum(row_true, 1)), both_empty.astype(float))
    loss = 0.0
    if probs is not None:
        clipped = np.clip(np.asarray(probs, np.float64), LOSS_EPS, 1 - LOSS_EPS)
        loss = float(-(truth * np.log(clipped) + (~truth) * np.log(1 - clipped)).sum())
    return np.concatenate([[len(pred), (pred == truth).all(axis=1).sum(), samples_p.sum(), samples_r.sum(),
                            samples_f1.sum(), loss], tp, fp, fn]).astype(np.float64)


def metrics_from_sums(sums: np.ndarray, labels: Sequence[str]) -> dict:
    """tag_metrics' numbers from tag_sums' vector (of one part, or summed over parts: the same numbers as of all
    the rows at once)."""
    k = len(labels)
    sums = np.asarray(sums, np.float64)
    if sums.shape != (6 + 3 * k,):
        raise ValueError(f"sums has shape {sums.shape}, not tag_sums' for {k} labels")
    n = int(round(sums[0]))
    tp, fp, fn = np.rint(sums[6:]).astype(np.int64).reshape(3, k)
    support, predicted = tp + fn, tp + fp
    precision = np.divide(tp, predicted, out=np.zeros(k), where=predicted > 0)
    recall = np.divide(tp, support, out=np.zeros(k), where=support > 0)
    f1 = _f1(tp, fp, fn)
    present = support > 0

    def mean(values) -> float:
        return float(np.mean(values)) if len(values) else 0.0

    def per_row(total: float) -> float:
        return float(total / n) if n else 0.0

    return {
        "rows": n, "labels": int(k),
        "micro_precision": float(tp.sum() / predicted.sum()) if predicted.sum() else 0.0,
        "micro_recall": float(tp.sum() / support.sum()) if support.sum() else 0.0,
        "micro_f1": float(_f1(tp.sum(), fp.sum(), fn.sum())),
        "macro_precision": mean(precision[present]), "macro_recall": mean(recall[present]),
        "macro_f1": mean(f1[present]),
        "weighted_f1": float((f1 * support).sum() / support.sum()) if support.sum() else 0.0,
        "samples_precision": per_row(sums[2]), "samples_recall": per_row(sums[3]), "samples_f1": per_row(sums[4]),
        "hamming_loss": float((fp.sum() + fn.sum()) / (n * k)) if n and k else 0.0,
        "subset_accuracy": per_row(sums[1]),
        "cardinality_true": per_row(support.sum()), "cardinality_predicted": per_row(predicted.sum()),
        "per_label": {labels[j]: {"precision": float(precision[j]), "recall": float(recall[j]), "f1": float(f1[j]),
                                  "support": int(support[j]), "predicted": int(predicted[j])}
                      for j in range(k)},
    }


def cooccurrence(hot: np.ndarray) -> np.ndarray:
    """[K, K] counts of texts holding both tags (the diagonal: each tag's count)."""
    hot = np.asarray(hot, np.int64)
    return hot.T @ hot


LOSS_EPS = 1e-7


def evaluation(probs: np.ndarray, masks: np.ndarray, labels: Sequence[str], thresholds: Thresholds | None = None
               ) -> dict:
    """A multi-label split's metrics under the keys every report, summary and tracker reads of a single-label
    one (scoring.classification_metrics): `accuracy` is the subset accuracy (every tag right), `macro_f1` the tags'
    macro-F1, `loss` the mean binary cross-entropy, `per_class` per tag; with tag_metrics' own beside them, the
    thresholds used (0.5 when none are given) and task multi_label."""
    if not len(probs):
        raise ValueError("no rows to evaluate: the split is empty")
    thresholds = thresholds or Thresholds(0.5)
    return evaluation_from_sums(evaluation_sums(probs, masks, len(labels), thresholds), labels, thresholds)


def evaluation_sums(probs: np.ndarray, masks: np.ndarray, k: int, thresholds: Thresholds) -> np.ndarray:
    """evaluation's sums of one part of a split (tag_sums with the loss): what ranks all-reduce."""
    probs = np.asarray(probs, np.float64)
    return tag_sums(predict(probs, thresholds), multi_hot(masks, k), probs)


def evaluation_from_sums(sums: np.ndarray, labels: Sequence[str], thresholds: Thresholds) -> dict:
    """evaluation's metrics from evaluation_sums' vector, of one part or summed over parts."""
    m = metrics_from_sums(sums, labels)
    if not m["rows"]:
        raise ValueError("no rows to evaluate: the split is empty")
    loss = float(sums[5] / (m["rows"] * len(labels))) if len(labels) else 0.0
    return {"task": "multi_label", "n": m["rows"], "label_names": list(labels), "accuracy": m["subset_accuracy"],
            "macro_f1": m["macro_f1"], "loss": loss, "per_class": m.pop("per_label"),
            "thresholds": thresholds.record(labels), **m}
