"""`torchloom monitor`: a file of new texts compared with the model's reference profile (model/profile.py), the
verdict a scheduled job acts on (exit 0: no drift; DRIFT_EXIT: drift), and a report a person reads:
report.md, monitor.json and plots/ (class shares, confidence, lengths, each signal against its threshold).

The same texts are read as `predict --input` reads them; the same Predictor scores them (cleaning, truncation,
the shipped mix), so a file like the validation split reads as no drift (drift.py says how the thresholds give
that at the chosen false-alarm rate).
"""

from __future__ import annotations

import io
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from torchloom.drift import SIGNALS, Texts, distances, estimated_accuracy, thresholds, verdict
from torchloom.errors import UserError
from torchloom.ledger import check_output, record_output

DRIFT_EXIT = 3  # `torchloom monitor` found drift (0: none; 2: a usage error, as every command)
MEANING = {
    "classes": "the predicted classes' shares (Jensen-Shannon distance)",
    "confidence": "the model's confidence, top probability (Jensen-Shannon distance of a 10-bin histogram)",
    "length": "tokens per text before truncation (Kolmogorov-Smirnov statistic)",
    "unknown": "share of tokens the tokenizer does not know (Kolmogorov-Smirnov statistic)",
    "representation": "the model's pooled representation, sketched (maximum mean discrepancy, Gaussian kernel)",
}


def monitor_file(model_dir: str, input_path: str, output: str, text_column: str = "text",
                 labels_column: str | None = None, false_alarm: float | None = None, device: str = "cpu",
                 overwrite: bool = False, say=print) -> dict[str, Any]:
    """Compare `input_path`'s texts with the model's profile; write the report to `output`; returns its JSON."""
    from torchloom.model.predict import Predictor, read_texts
    from torchloom.model.profile import REEXPORT, kernel_for, read_profile, reference_texts, text_signals

    profile = read_profile(model_dir)
    if profile is None:
        raise UserError(f"model dir {model_dir}: no monitoring profile (monitor/profile.json: exported before"
                        f" torchloom wrote one); {REEXPORT}")
    rate = profile.get("false_alarm", 0.01) if false_alarm is None else false_alarm
    if not 0 < rate < 1:
        raise UserError(f"--false-alarm {false_alarm}: a chance, between 0 and 1 (e.g. 0.01)")
    out = Path(output)
    if out.exists() and not overwrite:
        raise UserError(f"--output {output}: already exists; remove it or pass --overwrite")
    if overwrite:
        check_output(out, [input_path])
    if labels_column and Path(input_path).suffix.lower() == ".txt":
        raise UserError(f"--labels {labels_column}: a .txt input has texts only; give a CSV or JSON lines file with a"
                        " label column")
    texts = read_texts(input_path, say=say, column=text_column)
    truth = read_texts(input_path, column=labels_column) if labels_column else None
    if len(texts) < 2:
        raise UserError(f"--input {input_path}: {len(texts)} text(s); a window to compare needs at least 2")
    started = time.perf_counter()
    predictor = Predictor(model_dir, device=device)
    if predictor.labels != profile["labels"]:
        raise UserError(f"model dir {model_dir}: its profile is of other labels than the model's; {REEXPORT}")
    kernel = kernel_for(profile, predictor)
    answers = predictor.predict(texts, with_signals=True)
    window = text_signals(predictor.labels, answers, kernel)
    reference = reference_texts(profile, sketched=kernel is not None)
    k = len(profile["labels"])
    found = distances(window, reference, k)
    limits = thresholds(reference, len(texts), k, rate)
    drifted = verdict(found, limits)
    estimate, low, high = estimated_accuracy(window.confidence, reference, np.asarray(profile["reference"]["correct"]))
    result: dict[str, Any] = {
        "model": str(model_dir), "input": str(input_path), "texts": len(texts), "reference_texts": len(reference),
        "false_alarm": rate, "drift": bool(drifted), "drifted": drifted,
        "signals": {name: {"distance": round(found[name], 6), "threshold": round(limits[name], 6),
                           "drift": name in drifted} for name in SIGNALS if name in found},
        "estimated_accuracy": {"value": round(estimate, 4), "low": round(low, 4), "high": round(high, 4),
                               "reference": profile.get("accuracy")},
        "class_shares": {label: {"window": round(float(np.mean(window.predicted == i)), 4),
                                 "reference": round(float(np.mean(reference.predicted == i)), 4)}
                         for i, label in enumerate(profile["labels"])},
        "seconds": 0.0,
    }
    if truth is not None:
        if len(truth) != len(texts):
            raise UserError(f"--labels {labels_column}: {len(truth)} labels for {len(texts)} texts; every row needs"
                            " both")
        result["accuracy"] = round(float(np.mean([a["label"] == y for a, y in zip(answers, truth)])), 4)
    result["seconds"] = round(time.perf_counter() - started, 2)
    _write(out, result, window, reference, profile["labels"])
    return result


def _write(out: Path, result: dict, window: Texts, reference: Texts, labels: list[str]) -> None:
    import shutil

    if out.is_dir():
        shutil.rmtree(out)  # check_output: an earlier report of torchloom's, as it left it
    elif out.exists():
        out.unlink()
    (out / "plots").mkdir(parents=True)
    (out / "monitor.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    (out / "report.md").write_text(report_text(result), encoding="utf-8")
    (out / "plots" / "signals.png").write_bytes(_plot(result, window, reference, labels))
    record_output(out)


def report_text(r: dict) -> str:
    est = r["estimated_accuracy"]
    verdict_line = (f"**Drift** in {', '.join(r['drifted'])}" if r["drift"] else "**No drift**")
    lines = [f"# Monitor: {r['input']}", "",
             f"{verdict_line}: {r['texts']} texts against the model's reference of {r['reference_texts']}"
             f" (validation texts), each signal's threshold set for a {r['false_alarm']:.2%} chance of a false"
             " alarm on texts like the reference.", "",
             "| signal | distance | threshold | drift | what it measures |", "|---|---|---|---|---|"]
    for name, s in r["signals"].items():
        lines.append(f"| {name} | {s['distance']:.4f} | {s['threshold']:.4f} | {'yes' if s['drift'] else 'no'}"
                     f" | {MEANING[name]} |")
    lines += ["", f"Estimated accuracy (from confidence, no labels): **{est['value']:.3f}** (95 % interval"
              f" {est['low']:.3f} to {est['high']:.3f}); on the reference it was {est['reference']}."]
    if "accuracy" in r:
        lines.append(f"Accuracy with the given labels: **{r['accuracy']:.3f}**.")
    lines += ["", "| class | share here | share in the reference |", "|---|---|---|"]
    lines += [f"| {label} | {s['window']:.3f} | {s['reference']:.3f} |" for label, s in r["class_shares"].items()]
    lines += ["", "![signals](plots/signals.png)", ""]
    return "\n".join(lines)


def _plot(r: dict, window: Texts, reference: Texts, labels: list[str]) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 7.5), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 2)
    x = np.arange(len(labels))
    shares = [(np.mean(reference.predicted == i), np.mean(window.predicted == i)) for i in x]
    axes[0, 0].bar(x - 0.2, [s[0] for s in shares], 0.4, label="reference")
    axes[0, 0].bar(x + 0.2, [s[1] for s in shares], 0.4, label="these texts")
    axes[0, 0].set_xticks(x, [str(lb)[:12] for lb in labels], rotation=30, ha="right", fontsize=8)
    axes[0, 0].set_title("predicted class shares")
    bins = np.linspace(0, 1, 11)
    for data, name in ((reference.confidence, "reference"), (window.confidence, "these texts")):
        axes[0, 1].hist(data, bins=bins, density=True, alpha=0.5, label=name)
    axes[0, 1].set_title("confidence (top probability)")
    top = max(reference.length.max(), window.length.max())
    edges = np.unique(np.geomspace(1, top + 1, 30).astype(int))
    for data, name in ((reference.length, "reference"), (window.length, "these texts")):
        axes[1, 0].hist(data, bins=edges, density=True, alpha=0.5, label=name)
    axes[1, 0].set_xscale("log")
    axes[1, 0].set_title("tokens per text")
    names = list(r["signals"])
    axes[1, 1].bar(names, [r["signals"][n]["distance"] for n in names],
                   color=["tab:red" if r["signals"][n]["drift"] else "tab:green" for n in names])
    axes[1, 1].scatter(names, [r["signals"][n]["threshold"] for n in names], marker="_", s=900, color="black",
                       label="threshold", zorder=3)
    axes[1, 1].set_title("distance to the reference")
    for ax in axes.flat:
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    return buffer.getvalue()
