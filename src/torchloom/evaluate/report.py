"""The evaluation report of a run: report.json, report.md, misclassified.jsonl and plots/*.png.

Every file is written to a temporary name and renamed, so a crash never leaves half a report.
Plots use matplotlib's Agg canvas directly (no pyplot), so nothing global is changed.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from torchloom.evaluate.render import cell as _cell
from torchloom.evaluate.render import figure as _figure
from torchloom.evaluate.render import fmt as _fmt
from torchloom.evaluate.render import heatmap
from torchloom.evaluate.render import png as _png
from torchloom.jsonio import read_jsonl as read_metrics_jsonl
from torchloom.jsonio import write_atomic as _atomic_write
from torchloom.runs.rundir import RunDir

# Keys of report.json that `extra` may not override.
RESERVED_KEYS = ("split", "label_names", "metrics", "files", "baseline", "verdict")
MISCLASSIFIED_SHOWN = 10  # examples quoted in report.md; all of them are in misclassified.jsonl
TEXT_SHOWN_CHARS = 160


def write_report(
    run_dir: str | Path | RunDir,
    metrics: dict[str, Any],
    *,
    split: str,
    label_names: list[str],
    misclassified: list[dict[str, Any]],
    metrics_jsonl_path: str | Path | None = None,
    extra: dict[str, Any] | None = None,
    baseline: dict[str, Any] | None = None,
    verdict: str | None = None,
) -> dict[str, str]:
    """Write the report files into `run_dir`; returns {kind: path} of the files written.

    metrics: from `classification_metrics`. misclassified: dicts with text, true, predicted, score.
    metrics_jsonl_path: the training log for the loss plot (default: the run's metrics.jsonl; skipped when
    missing or empty).
    extra: more top-level entries of report.json, e.g. timings and a config summary.
    baseline: the classical baseline's scores on the same split (evaluate/baseline.comparison); verdict:
    the line saying the transformer did not beat it, with the likely cause.
    """
    extra = dict(extra or {})
    clash = sorted(set(extra) & set(RESERVED_KEYS))
    if clash:
        raise ValueError(f"extra may not set {', '.join(clash)}: report.json uses those keys")
    rd = RunDir(run_dir)
    run, plots = rd.root, rd.plots
    plots.mkdir(parents=True, exist_ok=True)

    written: dict[str, str] = {}
    _atomic_write(rd.misclassified, "".join(
        json.dumps(_jsonable(row), ensure_ascii=False) + "\n" for row in misclassified
    ).encode("utf-8"))
    written["misclassified"] = str(rd.misclassified)

    written.update(_metric_plots(plots, metrics, label_names))
    history = read_metrics_jsonl(metrics_jsonl_path or rd.metrics)
    loss_png = plot_loss(history)
    if loss_png is not None:
        _atomic_write(plots / "loss.png", loss_png)
        written["loss_plot"] = str(plots / "loss.png")

    files = {kind: os.path.relpath(path, run) for kind, path in written.items()}
    report = {"split": split, "label_names": list(label_names), "metrics": metrics, "files": files, **extra}
    if baseline is not None:
        report["baseline"] = baseline
        report["verdict"] = verdict
    _atomic_write(rd.report_json,
                  (json.dumps(_jsonable(report), indent=2, ensure_ascii=False) + "\n").encode("utf-8"))
    written["report_json"] = str(rd.report_json)
    markdown = render_markdown(metrics, split=split, label_names=label_names,
                               misclassified=misclassified, files=files, extra=extra, baseline=baseline,
                               verdict=verdict)
    _atomic_write(rd.report_md, markdown.encode("utf-8"))
    written["report_md"] = str(rd.report_md)
    return written


def _metric_plots(plots: Path, metrics: dict[str, Any], label_names: list[str]) -> dict[str, str]:
    """The confusion matrix and the reliability diagram; a multi-label run's own (evaluate/tags.py) instead."""
    if metrics.get("task") == "multi_label":
        from torchloom.evaluate.tags import plots as tag_plots

        pngs = {name.replace(".png", "_plot"): (name, png) for name, png in tag_plots(metrics, label_names).items()}
    else:
        pngs = {"confusion_plot": ("confusion.png", plot_confusion(metrics["confusion_matrix"], label_names)),
                "calibration_plot": ("calibration.png", plot_calibration(metrics["reliability"], metrics["ece"]))}
    for name, png in pngs.values():
        _atomic_write(plots / name, png)
    return {kind: str(plots / name) for kind, (name, _) in pngs.items()}


def render_markdown(
    metrics: dict[str, Any],
    *,
    split: str,
    label_names: list[str],
    misclassified: list[dict[str, Any]],
    files: dict[str, str],
    extra: dict[str, Any],
    baseline: dict[str, Any] | None = None,
    verdict: str | None = None,
) -> str:
    """The human-readable report; `files` maps kinds to paths relative to the report."""
    lines = [f"# Evaluation on the `{split}` split", ""]
    multi = metrics.get("task") == "multi_label"
    if multi:
        from torchloom.evaluate.tags import sections

        lines += sections(metrics, label_names, files)
    else:
        lines += _metrics_table(metrics)
    if metrics.get("levels"):
        from torchloom.evaluate.levels import section

        lines += section(metrics["levels"], metrics.get("label_path_delimiter", "/"))
    if baseline is not None:
        lines += _baseline_section(metrics, split, baseline, verdict)
    lines += _extra_sections(extra)
    if not multi:
        lines += _per_class_section(metrics, label_names)
        lines += _confusion_section(metrics, label_names, files)
        lines += _calibration_section(metrics, files)
    if "loss_plot" in files:
        lines += ["## Training", "", f"![loss curve]({files['loss_plot']})", ""]
    lines += _misclassified_section(misclassified, files)
    return "\n".join(lines)


def _metrics_table(metrics: dict[str, Any]) -> list[str]:
    lines = ["| metric | value |", "|---|---|"]
    for name, key in (("rows", "n"), ("accuracy", "accuracy"), ("macro F1", "macro_f1"),
                      ("weighted F1", "weighted_f1"), ("ROC AUC", "roc_auc"),
                      ("expected calibration error", "ece"), ("cross-entropy loss", "loss")):
        lines.append(f"| {name} | {_fmt(metrics.get(key))} |")
    lines.append("")
    return lines


def _comparison_rows(baseline: dict[str, Any]) -> list[str]:
    """The table of the transformer against the baseline: accuracy and macro-F1 (a multi-label run: micro-F1 first,
    and its accuracy is the subset accuracy)."""
    keys = (["micro_f1"] if baseline.get("metric") == "micro_f1" else []) + ["accuracy", "macro_f1"]
    names = {"micro_f1": "micro F1", "accuracy": "subset accuracy" if "micro_f1" in keys else "accuracy",
             "macro_f1": "macro F1"}
    return [f"| model | {' | '.join(names[k] for k in keys)} |", "|---" * (len(keys) + 1) + "|",
            f"| this transformer | {' | '.join(_fmt(baseline[f'transformer_{k}']) for k in keys)} |",
            f"| {_cell(baseline['name'])} | {' | '.join(_fmt(baseline[k]) for k in keys)} |",
            "| difference | " + " | ".join(f"{baseline[k + '_gain']:+.4f}" for k in keys) + " |"]


def _baseline_section(metrics: dict[str, Any], split: str, baseline: dict[str, Any], verdict: str | None) -> list[str]:
    lines = ["## Against a classical baseline", "",
             f"The same `{split}` rows, scored by a {baseline['name']} baseline trained on the same train split"
             f" ({baseline['description']}).", "",
             *_comparison_rows(baseline)]
    shipped = baseline.get("shipped")
    if shipped:  # the model export ships: the two mixed, the weight chosen on val
        first = f"{_fmt(shipped['micro_f1'])} | " if baseline.get("metric") == "micro_f1" else ""
        lines.append(f"| shipped: {shipped['weight']:.2f} x the transformer + {1 - shipped['weight']:.2f} x the"
                     f" baseline | {first}{_fmt(shipped['accuracy'])} | {_fmt(shipped['macro_f1'])} |")
    lines.append("")
    if baseline.get("per_tag"):
        lines += _per_tag_winners(baseline["per_tag"])
    if verdict:
        lines += [f"**Note:** {verdict}.", ""]
    return lines


def _per_tag_winners(rows: dict[str, dict]) -> list[str]:
    """Each tag's F1 on both sides and which wins it, the most frequent tags first."""
    won = {side: sum(r["winner"] == side for r in rows.values()) for side in ("transformer", "baseline", "tie")}
    lines = ["### Per tag: which side wins", "",
             f"The transformer wins {won['transformer']} of {len(rows)} tags, the baseline {won['baseline']}, and"
             f" {won['tie']} are ties (F1 within 0.01). The transformer's F1 at its own thresholds, the baseline's at"
             " its own (both chosen on val).", "",
             "| tag | support | transformer F1 | baseline F1 | wins |", "|---|---|---|---|---|"]
    for tag, r in sorted(rows.items(), key=lambda kv: (-kv[1]["support"], kv[0])):
        lines.append(f"| {_cell(tag)} | {r['support']} | {r['transformer_f1']:.4f} | {r['baseline_f1']:.4f}"
                     f" | {r['winner']} |")
    lines.append("")
    return lines


def _extra_sections(extra: dict[str, Any]) -> list[str]:
    # Scalars of `extra` (e.g. evaluate_s) share one table; each dict (timings, config) gets its own.
    scalars = {k: v for k, v in extra.items() if not isinstance(v, dict)}
    sections = [("Run", scalars)] if scalars else []
    sections += [(k.replace("_", " ").capitalize(), v) for k, v in extra.items() if isinstance(v, dict)]
    lines: list[str] = []
    for title, table in sections:
        lines += [f"## {title}", "", "| key | value |", "|---|---|"]
        lines += [f"| {_cell(k)} | {_cell(_fmt(v))} |" for k, v in table.items()]
        lines.append("")
    return lines


def _per_class_section(metrics: dict[str, Any], label_names: list[str]) -> list[str]:
    lines = ["## Per class", "", "| label | precision | recall | F1 | support |", "|---|---|---|---|---|"]
    for name in label_names:
        c = metrics["per_class"][name]
        lines.append(f"| {_cell(name)} | {c['precision']:.4f} | {c['recall']:.4f} | {c['f1']:.4f} "
                     f"| {c['support']} |")
    lines.append("")
    return lines


def _confusion_section(metrics: dict[str, Any], label_names: list[str], files: dict[str, str]) -> list[str]:
    lines = ["## Confusion matrix", "", "Rows are the true label, columns the predicted one.", ""]
    lines.append("| true \\ predicted | " + " | ".join(_cell(n) for n in label_names) + " |")
    lines.append("|---" * (len(label_names) + 1) + "|")
    for name, row in zip(label_names, metrics["confusion_matrix"]):
        lines.append(f"| **{_cell(name)}** | " + " | ".join(str(v) for v in row) + " |")
    lines.append("")
    if "confusion_plot" in files:
        lines += [f"![confusion matrix]({files['confusion_plot']})", ""]
    return lines


def _calibration_section(metrics: dict[str, Any], files: dict[str, str]) -> list[str]:
    bins = metrics["reliability"]
    lines = ["## Calibration", "",
             f"Expected calibration error of the top-1 confidence: **{_fmt(metrics['ece'])}** "
             f"({len(bins['count'])} equal-width bins; empty bins omitted).", "",
             "| confidence bin | rows | mean confidence | accuracy |", "|---|---|---|---|"]
    edges = bins["edges"]
    for i, count in enumerate(bins["count"]):
        if count:
            lines.append(f"| ({edges[i]:.2f}, {edges[i + 1]:.2f}] | {count} | "
                         f"{bins['confidence'][i]:.4f} | {bins['accuracy'][i]:.4f} |")
    lines.append("")
    if "calibration_plot" in files:
        lines += [f"![reliability diagram]({files['calibration_plot']})", ""]
    return lines


def _misclassified_section(misclassified: list[dict[str, Any]], files: dict[str, str]) -> list[str]:
    lines = ["## Misclassified", ""]
    if not misclassified:
        return lines + ["None.", ""]
    worst = sorted(misclassified, key=lambda r: -float(r.get("score", 0.0)))[:MISCLASSIFIED_SHOWN]
    lines += [f"{len(misclassified)} rows; the {len(worst)} most confident mistakes below, all in "
              f"[{files.get('misclassified', 'misclassified.jsonl')}]"
              f"({files.get('misclassified', 'misclassified.jsonl')}).", "",
              "| true | predicted | score | text |", "|---|---|---|---|"]
    for row in worst:
        text = str(row.get("text", ""))
        if len(text) > TEXT_SHOWN_CHARS:
            text = text[:TEXT_SHOWN_CHARS] + "…"
        lines.append(f"| {_cell(row.get('true'))} | {_cell(row.get('predicted'))} | "
                     f"{_fmt(row.get('score'))} | {_cell(text)} |")
    lines.append("")
    return lines


def plot_confusion(confusion: list[list[int]], label_names: list[str]) -> bytes:
    """PNG of the confusion matrix: counts written in each cell, coloured by the share of the true class."""
    counts = np.asarray(confusion, dtype=np.int64)
    row_totals = counts.sum(axis=1, keepdims=True)
    share = np.divide(counts, row_totals, out=np.zeros(counts.shape), where=row_totals > 0)
    k = len(label_names)
    fig, ax = heatmap(share, label_names, "share of the true class")
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    ax.set_title(f"Confusion matrix ({int(counts.sum())} rows)")
    fontsize = max(5, min(11, 120 // max(k, 1)))
    for i in range(k):
        for j in range(k):
            ax.text(j, i, str(counts[i, j]), ha="center", va="center", fontsize=fontsize,
                    color="white" if share[i, j] > 0.5 else "black")
    return _png(fig)


def plot_calibration(reliability: dict[str, list], ece: float) -> bytes:
    """PNG reliability diagram: accuracy per confidence bin against the diagonal, with the bin counts."""
    edges = np.asarray(reliability["edges"], dtype=np.float64)
    counts = np.asarray(reliability["count"], dtype=np.int64)
    accuracy = np.array([np.nan if a is None else a for a in reliability["accuracy"]], dtype=np.float64)
    confidence = np.array([np.nan if c is None else c for c in reliability["confidence"]], dtype=np.float64)
    centers = (edges[:-1] + edges[1:]) / 2
    widths = np.diff(edges)
    fig, (ax, ax_counts) = _figure(6.0, 6.5, rows=2, height_ratios=(3, 1))
    filled = counts > 0
    ax.bar(centers[filled], accuracy[filled], width=widths[filled] * 0.95, color="tab:blue",
           edgecolor="black", linewidth=0.5, label="accuracy")
    ax.plot(confidence[filled], accuracy[filled], "o", color="tab:orange", markersize=4,
            label="mean confidence")
    ax.plot([0, 1], [0, 1], "--", color="gray", label="perfect calibration")
    for x, a, c in zip(centers[filled], accuracy[filled], counts[filled]):
        ax.text(x, min(a + 0.02, 1.02), str(c), ha="center", va="bottom", fontsize=7)
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1.08)
    ax.set_ylabel("accuracy")
    ax.set_title(f"Reliability diagram (ECE {ece:.4f}); numbers are rows per bin")
    ax.legend(loc="upper left", fontsize=8)
    ax_counts.bar(centers, counts, width=widths * 0.95, color="tab:gray")
    ax_counts.set_xlim(0, 1)
    ax_counts.set_xlabel("top-1 confidence")
    ax_counts.set_ylabel("rows")
    return _png(fig)


def plot_loss(history: list[dict[str, Any]]) -> bytes | None:
    """PNG of train and eval loss against step, eval accuracy on a second axis; None with nothing to plot."""
    train = [(r["step"], r["loss"]) for r in history if r.get("kind") == "train" and _has(r, "step", "loss")]
    evals = [r for r in history if r.get("kind") == "eval" and _has(r, "step", "loss")]
    if not train and not evals:
        return None
    fig, ax = _figure(8.0, 4.5)
    handles = []
    if train:
        steps, losses = zip(*sorted(train))
        handles += ax.plot(steps, losses, color="tab:blue", linewidth=1, alpha=0.8, label="train loss")
    if evals:
        evals.sort(key=lambda r: r["step"])
        handles += ax.plot([r["step"] for r in evals], [r["loss"] for r in evals], "o-", color="tab:red",
                           label="eval loss")
        with_accuracy = [r for r in evals if _has(r, "accuracy")]
        if with_accuracy:
            ax_acc = ax.twinx()
            handles += ax_acc.plot([r["step"] for r in with_accuracy], [r["accuracy"] for r in with_accuracy],
                                   "s--", color="tab:green", label="eval accuracy")
            ax_acc.set_ylabel("accuracy")
            ax_acc.set_ylim(0, 1.02)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("Training")
    ax.grid(alpha=0.3)
    # Below the axes: inside, the twin axis would draw its line over the legend.
    fig.legend(handles=handles, loc="outside lower center", ncols=len(handles), fontsize=8)
    return _png(fig)


def _has(row: dict[str, Any], *keys: str) -> bool:
    return all(isinstance(row.get(k), (int, float)) and math.isfinite(row[k]) for k in keys)


def _jsonable(value: Any) -> Any:
    """Plain JSON types: numpy scalars and arrays converted, NaN and infinity as null."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return _jsonable(value.tolist())
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Path):
        return str(value)
    return value
