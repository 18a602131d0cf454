"""A multi-label model's evaluation: thresholds chosen on val at export (tag_scoring's rule, stored in
torchloom.json), its metrics and mistakes on eval.split, and the report's own sections and plots (the per-tag
thresholds, the tags' co-occurrence) in place of the single-label confusion matrix and calibration."""

from __future__ import annotations

from typing import Any

import numpy as np

from torchloom import tag_scoring as ts
from torchloom.data.texts import texts_at
from torchloom.evaluate.render import cell, figure, fmt, heatmap, png
from torchloom.manifest import Manifest


def choose(probs: np.ndarray, masks: np.ndarray, manifest: Manifest, top_k: int = 0) -> tuple[dict, str]:
    """torchloom.json's `thresholds` from the val split's probabilities, and export's line about them. A text with
    no tag over its thresholds gets its most probable one when every kept row has a tag (data.keep_untagged off).
    top_k (export.top_k): the k most probable tags of every text instead, no threshold."""
    labels = manifest.labels
    at_least_one = not manifest.tags.get("keep_untagged", False)
    if top_k:
        chosen = ts.Thresholds(0.5, top_k=top_k)
        line = f"the {top_k} most probable tags of each text (export.top_k)"
        if len(probs):
            truth = ts.multi_hot(masks, len(labels))
            by_rule = ts.choose_thresholds(probs, truth, at_least_one=at_least_one)
            f1, rule = (ts.tag_metrics(ts.predict(probs, t), truth, labels)["micro_f1"] for t in (chosen, by_rule))
            line += f"; val micro-F1 {f1:.4f} (thresholds chosen on val would give {rule:.4f})"
        return chosen.record(labels), line
    if not len(probs):
        chosen = ts.Thresholds(0.5, at_least_one=at_least_one)
        return chosen.record(labels), "thresholds: 0.5 for every tag (no val rows to choose them on)"
    truth = ts.multi_hot(masks, len(labels))
    chosen = ts.choose_thresholds(probs, truth, at_least_one=at_least_one)
    f1 = ts.tag_metrics(ts.predict(probs, chosen), truth, labels)["micro_f1"]
    half = ts.tag_metrics(ts.predict(probs, ts.Thresholds(0.5, at_least_one=at_least_one)), truth, labels)["micro_f1"]
    own = (f"; own thresholds for {len(chosen.per_label)} tags with {ts.MIN_SUPPORT}+ val rows" if chosen.per_label
        else "")
    return chosen.record(labels), (f"thresholds chosen on val ({len(probs)} texts): {chosen.default:.2f} for every"
                                   f" tag{own}; val micro-F1 {f1:.4f} (at 0.5: {half:.4f})")


def evaluate(probs: np.ndarray, masks: np.ndarray, index: np.ndarray, manifest: Manifest, split: str,
             thresholds: dict | None, limit: int) -> tuple[dict, list[dict]]:
    """(metrics, mistakes): a text is a mistake when its predicted tags are not its tags, the most confident
    first (the probability furthest on the wrong side of its threshold)."""
    labels = manifest.labels
    chosen = ts.Thresholds.from_record(thresholds, labels) if thresholds else ts.Thresholds(0.5)
    metrics = ts.evaluation(probs, masks, labels, chosen)
    truth, pred = ts.multi_hot(masks, len(labels)), ts.predict(probs, chosen)
    metrics["cooccurrence"] = ts.cooccurrence(truth).tolist()
    wrong = np.nonzero((pred != truth).any(axis=1))[0]
    margin = np.abs(probs - chosen.array(len(labels))[None, :]) * (pred != truth)
    wrong = wrong[np.argsort(-margin[wrong].max(axis=1))][:limit]
    texts = texts_at(manifest, split, {int(index[i]) for i in wrong})
    mistakes = [{"text": texts.get(int(index[i]), ""), "true": [labels[j] for j in np.flatnonzero(truth[i])],
                 "predicted": [labels[j] for j in np.flatnonzero(pred[i])],
                 "score": round(float(margin[i].max()), 6)} for i in wrong]
    return metrics, mistakes


def sections(metrics: dict[str, Any], labels: list[str], files: dict[str, str]) -> list[str]:
    """The report's multi-label sections: the metrics, each tag's threshold and scores, the plots."""
    rows = [("texts", "n"), ("micro F1", "micro_f1"), ("macro F1", "macro_f1"), ("samples F1", "samples_f1"),
            ("subset accuracy (every tag right)", "subset_accuracy"), ("Hamming loss", "hamming_loss"),
            ("tags a text, true", "cardinality_true"), ("tags a text, predicted", "cardinality_predicted"),
            ("binary cross-entropy", "loss")]
    lines = ["| metric | value |", "|---|---|", *(f"| {name} | {fmt(metrics.get(key))} |" for name, key in rows), ""]
    th = metrics["thresholds"]
    rule = (f"the {th['top_k']} most probable tags of each text" if th.get("top_k") else
            f"a tag is predicted at or over its threshold: {th['default']:.2f} for every tag"
            + (", its own for the tags below with enough val rows" if th.get("per_label") else "")
            + ("; a text with none over gets its most probable tag" if th.get("at_least_one") else ""))
    lines += ["## Per tag", "", f"Thresholds chosen on val (docs/evaluation.md): {rule}.", "",
              "| tag | threshold | precision | recall | F1 | support | predicted |", "|---|---|---|---|---|---|---|"]
    for name in labels:
        c = metrics["per_class"][name]
        t = th.get("per_label", {}).get(name, th["default"])
        lines.append(f"| {cell(name)} | {t:.2f} | {c['precision']:.4f} | {c['recall']:.4f} | {c['f1']:.4f} "
                     f"| {c['support']} | {c['predicted']} |")
    lines.append("")
    for kind, title in (("thresholds_plot", "thresholds and F1 per tag"), ("cooccurrence_plot", "tag co-occurrence")):
        if kind in files:
            lines += [f"![{title}]({files[kind]})", ""]
    return lines


def plots(metrics: dict[str, Any], labels: list[str]) -> dict[str, bytes]:
    """PNGs: each tag's threshold beside its F1 and support; the share of a tag's texts that hold another."""
    k = len(labels)
    th = metrics["thresholds"]
    fig, ax = figure(min(max(5.0, 0.45 * k + 2.5), 24.0), 4.0)
    x = np.arange(k)
    f1 = [metrics["per_class"][n]["f1"] for n in labels]
    ax.bar(x - 0.2, [th.get("per_label", {}).get(n, th["default"]) for n in labels], 0.4, label="threshold")
    ax.bar(x + 0.2, f1, 0.4, label="F1")
    ax.set_xticks(x, labels=labels, rotation=45 if k > 3 else 0, ha="right" if k > 3 else "center")
    ax.set_ylim(0, 1)
    ax.legend()
    ax.set_title("Threshold and F1 per tag")
    out = {"thresholds.png": png(fig)}
    co = np.asarray(metrics["cooccurrence"], np.float64)
    share = np.divide(co, np.diag(co)[:, None], out=np.zeros_like(co), where=np.diag(co)[:, None] > 0)
    fig, ax = heatmap(share, labels, "share of the row tag's texts")
    ax.set_title("Tag co-occurrence (true tags)")
    out["cooccurrence.png"] = png(fig)
    return out
