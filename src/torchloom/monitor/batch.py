"""`torchloom monitor`: a file of new texts compared with the model's reference profile (monitor/profile.py), the
verdict a scheduled job acts on (exit 0: no drift; DRIFT_EXIT: drift), and a report a person reads:
report.md, monitor.json and plots/ (class shares, confidence, lengths, each signal against its threshold).

The same texts are read as `predict --input` reads them; the same Predictor scores them (cleaning, truncation,
the shipped mix), so a file like the validation split reads as no drift (monitor/drift.py says how the thresholds give
that at the chosen false-alarm rate).
"""

from __future__ import annotations

import io
import json
import os
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from torchloom.errors import UserError
from torchloom.monitor.drift import (
    Texts,
    caveat,
    describe,
    distances,
    estimated_accuracy,
    signal_names,
    thresholds,
    verdict,
)
from torchloom.runs.outputs import check_output, clear_output, record_output

OUTLIERS = 10  # the most unusual texts a report lists (--outliers)
UNUSUAL = 0.99  # an outlier score past this: more unusual than 99 % of the reference
OUTLIER_CHARS = 300  # of each listed text
DRIFT_EXIT = 3  # `torchloom monitor` found drift (0: none; 2: a usage error, as every command)


SAMPLE = 10_000  # texts compared at most: past a few thousand a window's thresholds call every tiny shift drift


class Sampled:
    """Up to n texts (with their labels) drawn uniformly from a stream of rows: each row gets a random key and the
    n smallest keys stay (memory: n rows, whatever the input's size)."""

    def __init__(self, n: int, seed: int = 0) -> None:
        self.n, self.rng = n, np.random.default_rng(seed)
        self.keys = np.empty(0)
        self.texts: list[str] = []
        self.labels: list[Any] = []
        self.total = self.empty = 0

    def add(self, texts: list[Any], labels: list[Any] | None = None) -> None:
        labels = labels if labels is not None else [None] * len(texts)
        usable = [(t, y) for t, y in zip(texts, labels) if isinstance(t, str) and t.strip()]
        self.empty += len(texts) - len(usable)
        self.total += len(texts)
        if not usable:
            return
        keys = np.concatenate([self.keys, self.rng.random(len(usable))])
        rows = list(zip(self.texts, self.labels)) + usable
        keep = np.sort(np.argpartition(keys, self.n - 1)[:self.n]) if len(keys) > self.n else np.arange(len(keys))
        self.keys = keys[keep]
        self.texts = [rows[i][0] for i in keep]
        self.labels = [rows[i][1] for i in keep]


def read_sample(input_path: str, text_column: str, labels_column: str | None, n: int = SAMPLE, spark=None,
                say=print) -> Sampled:
    """A uniform sample of up to n texts of `input_path`, read as `predict --input ... --output` reads it (CSV,
    JSON lines or Parquet, a file or a directory; a .txt file a text a line): streamed locally, or on Spark
    (`spark`: a session) for inputs too large for one machine to scan quickly. Empty texts are counted, not kept."""
    from torchloom.inputs import text_files
    from torchloom.model.predict import read_texts

    sample = Sampled(n)
    if Path(input_path).suffix.lower() == ".txt" and spark is None:
        if labels_column:
            raise UserError(f"--labels {labels_column}: a .txt input has texts only; give a CSV or JSON lines file"
                            " with a label column")
        sample.add(read_texts(input_path, say=say))
        return sample
    fmt = text_files.input_format(input_path)
    if spark is not None:
        return _spark_sample(spark, input_path, fmt, text_column, labels_column, sample)
    schema, batches = text_files.stream_batches(input_path, fmt)
    text_column, labels_column = _columns(schema.names, text_column, labels_column, input_path)
    for batch in batches:
        texts = batch.column(text_column).to_pylist()
        labels = ([None if y is None else str(y) for y in batch.column(labels_column).to_pylist()]
            if labels_column else None)
        sample.add(texts, labels)
    return sample


def _columns(names: list[str], text_column: str, labels_column: str | None, input_path: str
             ) -> tuple[str, str | None]:
    from torchloom.text.formats import column_named, text_column_hint

    found = column_named(names, text_column)
    if found is None:
        raise UserError(f"--input {input_path}: no column {text_column!r} (columns: {', '.join(names) or 'none'});"
                        " name the text column with --text-column" + text_column_hint(names))
    labels = column_named(names, labels_column) if labels_column else None
    if labels_column and labels is None:
        raise UserError(f"--labels {labels_column}: no such column in {input_path} (columns: {', '.join(names)})")
    return found, labels


def _spark_sample(spark, input_path: str, fmt: str, text_column: str, labels_column: str | None,
                  sample: Sampled) -> Sampled:
    """Spark counts the rows, keeps about 1.5 n of them at random and the driver n of those, at random."""
    from pyspark.sql import functions as F  # noqa: N812

    from torchloom.batch import spark as score_spark

    df = score_spark.spark_read(spark, input_path, fmt)
    text_column, labels_column = _columns(df.columns, text_column, labels_column, input_path)
    cols = [F.col(text_column).cast("string").alias("text")]
    if labels_column:
        cols.append(F.col(labels_column).cast("string").alias("label"))
    df = df.select(*cols)
    usable = F.col("text").isNotNull() & (F.length(F.trim(F.col("text"))) > 0)
    counts = df.agg(F.count(F.lit(1)).alias("rows"), F.sum(F.when(usable, 1).otherwise(0)).alias("texts")).first()
    total, texts = int(counts["rows"]), int(counts["texts"] or 0)
    df = df.where(usable)
    fraction = min(1.0, 1.5 * sample.n / max(1, texts))
    rows = (df.sample(False, fraction, seed=0).orderBy(F.rand(seed=0)).limit(sample.n).collect()
        if fraction < 1.0 else df.collect())
    sample.add([r["text"] for r in rows], [r["label"] for r in rows] if labels_column else None)
    sample.total, sample.empty = total, total - texts
    return sample


def monitor_file(model_dir: str, input_path: str, output: str, text_column: str = "text",
                 labels_column: str | None = None, false_alarm: float | None = None, device: str = "cpu",
                 overwrite: bool = False, say=print, sample: int = SAMPLE, spark=None, outliers: int = OUTLIERS
                 ) -> dict[str, Any]:
    """Compare `input_path`'s texts (a uniform sample of `sample` where it holds more) with the model's profile;
    write the report to `output`; returns its JSON. outliers: the report lists this many of the most unusual texts
    (monitor/outliers.py), where the profile has sketches."""
    from torchloom.monitor.profile import REEXPORT, read_profile

    profile = read_profile(model_dir)
    if profile is None:
        raise UserError(f"model dir {model_dir}: no monitoring profile (monitor/profile.json: exported before"
                        f" torchloom wrote one); {REEXPORT}")
    rate = profile.get("false_alarm", 0.01) if false_alarm is None else false_alarm
    if not 0 < rate < 1:
        raise UserError(f"--false-alarm {false_alarm}: a chance, between 0 and 1 (e.g. 0.01)")
    out = Path(output)
    if out.is_symlink() and not out.exists():  # said now, not after the work
        raise UserError(f"--output {output}: a symbolic link to nothing ({os.readlink(out)}); remove it or pass"
                        " another --output")
    if out.exists() and not overwrite:
        raise UserError(f"--output {output}: already exists; remove it or pass --overwrite")
    if overwrite:
        check_output(out, [input_path, model_dir])
    if sample < 2:
        raise UserError(f"--sample {sample}: compare at least 2 texts")
    if outliers < 0:
        raise UserError(f"--outliers {outliers}: list 0 or more of the most unusual texts")
    drawn = read_sample(input_path, text_column, labels_column, sample, spark=spark, say=say)
    if len(drawn.texts) < 2:
        raise UserError(f"--input {input_path}: {len(drawn.texts)} text(s) to compare ({drawn.empty} empty); a"
                        " window needs at least 2")
    if drawn.empty:
        say(f"{drawn.empty} empty or missing texts set aside")
    if len(drawn.texts) < drawn.total - drawn.empty:
        say(f"comparing a uniform sample of {len(drawn.texts)} of the {drawn.total - drawn.empty} texts (--sample)")
    started = time.perf_counter()
    result, window, reference = compare(model_dir, profile, drawn, rate, device, labels_column is not None,
                                        outliers)
    result.update(model=str(model_dir), input=str(input_path),
                  at=datetime.now(UTC).isoformat(timespec="seconds"))  # when: a scheduled job's reports over time
    result["seconds"] = round(time.perf_counter() - started, 2)
    _write(out, result, window, reference, profile["labels"], [input_path, model_dir])
    return result


def compare(model_dir: str, profile: dict, drawn: Sampled, rate: float, device: str, labelled: bool,
            outliers: int = 0) -> tuple[dict[str, Any], Texts, Texts]:
    """The drawn texts scored by the model and compared with its profile: the report's JSON, and the two sides."""
    from torchloom.model.predict import Predictor
    from torchloom.model.served import model_identity
    from torchloom.monitor.profile import REEXPORT, kernel_for, reference_texts, text_signals

    texts = drawn.texts
    predictor = Predictor(model_dir, device=device)
    if predictor.labels != profile["labels"]:
        raise UserError(f"model dir {model_dir}: its profile is of other labels than the model's; {REEXPORT}")
    kernel = kernel_for(profile, predictor)
    answers = predictor.predict(texts, with_signals=True)
    window = text_signals(predictor.labels, answers, kernel, predictor.max_length)
    reference = reference_texts(profile, sketched=kernel is not None)
    k = len(profile["labels"])
    found = distances(window, reference, k)
    limits = thresholds(reference, len(texts), k, rate)
    drifted = verdict(found, limits)
    estimate, low, high = estimated_accuracy(window.confidence, reference, np.asarray(profile["reference"]["correct"]))
    result: dict[str, Any] = {
        # who was watched: a registered model's name, version and aliases, else its directory's name and export
        "model_identity": model_identity(model_dir, predictor.info, predictor.labels).brief(),
        "texts": len(texts), "rows": drawn.total, "empty": drawn.empty,
        "sampled": len(texts) < drawn.total - drawn.empty, "reference_texts": len(reference),
        "false_alarm": rate, "drift": bool(drifted), "drifted": drifted,
        "signals": {name: {"distance": round(found[name], 6), "threshold": round(limits[name], 6),
                           "drift": name in drifted} for name in signal_names() if name in found},
        "estimated_accuracy": {"value": round(estimate, 4), "low": round(low, 4), "high": round(high, 4),
                               "reference": profile.get("accuracy"), "caveat": caveat(drifted)},
        "class_shares": {label: {"window": round(float(np.mean(window.predicted == i)), 4),
                                 "reference": round(float(np.mean(reference.predicted == i)), 4)}
                         for i, label in enumerate(profile["labels"])},
    }
    if profile.get("task") == "multi_label":
        result.update(tag_counts(profile, answers))
    if labelled:
        pairs = [(a["label"], y) for a, y in zip(answers, drawn.labels) if y is not None and y != ""]
        if pairs:
            result["accuracy"] = round(float(np.mean([correct(a, y, profile) for a, y in pairs])), 4)
            result["labelled"] = len(pairs)
    if kernel is not None:
        result.update(unusual(profile, texts, answers, outliers))
    return result, window, reference


def unusual(profile: dict, texts: list[str], answers: list[dict], n: int) -> dict[str, Any]:
    """The texts' outlier scores against the reference (monitor/outliers.py): the share past UNUSUAL (about 1 - it
    for texts like the reference) and the `n` highest, most unusual first."""
    from torchloom.monitor.outliers import scorer_for

    scorer = scorer_for(profile)
    if scorer is None:
        return {}
    scores = scorer.scores(np.stack([a["sketch"] for a in answers]))
    top = np.argsort(-scores, kind="stable")[:n]
    return {"unusual": {"past": UNUSUAL, "share": round(float(np.mean(scores >= UNUSUAL)), 4),
                        "expected": round(1 - UNUSUAL, 4)},
            "outliers": [{"score": round(float(scores[i]), 4), "label": answers[i]["label"],
                          "text": texts[i][:OUTLIER_CHARS]} for i in top]}


def correct(predicted: str, given, profile: dict) -> bool:
    """A given label's verdict on a prediction; a tagger's top tag is right when the given tags hold it."""
    from torchloom.monitor.profile import right
    from torchloom.text import tags

    if profile.get("task") != "multi_label":
        return predicted == given
    try:
        return right(predicted, tags.as_label(tags.parse(given) or []))
    except ValueError:  # a label that is no tags: not this tag
        return False


def tag_counts(profile: dict, answers: list[dict]) -> dict[str, Any]:
    """A tagger's window beside its reference: tags a text, and each tag's share of the texts that get it."""
    labels, reference = profile["labels"], profile["reference"].get("tags") or []
    window = [a.get("labels") or [] for a in answers]
    index = {label: i for i, label in enumerate(labels)}

    def shares(rows: list[list[int]]) -> np.ndarray:
        counts = np.zeros(len(labels))
        for row in rows:
            counts[list(row)] += 1
        return counts / max(1, len(rows))

    here, there = shares([[index[t] for t in row] for row in window]), shares(reference)
    return {"tags_per_text": {"window": round(float(np.mean([len(r) for r in window])), 4),
                              "reference": round(float(np.mean([len(r) for r in reference])), 4) if reference
                              else None},
            "tag_shares": {label: {"window": round(float(here[i]), 4), "reference": round(float(there[i]), 4)}
                           for i, label in enumerate(labels)}}


def _write(out: Path, result: dict, window: Texts, reference: Texts, labels: list[str], inputs: list[str]) -> None:
    clear_output(out, inputs)  # an earlier report of torchloom's, as it left it, checked again
    (out / "plots").mkdir(parents=True)
    (out / "monitor.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    (out / "report.md").write_text(report_text(result), encoding="utf-8")
    (out / "plots" / "signals.png").write_bytes(_plot(result, window, reference, labels))
    record_output(out)


def report_text(r: dict) -> str:
    est = r["estimated_accuracy"]
    verdict_line = (f"**Drift** in {', '.join(r['drifted'])}" if r["drift"] else "**No drift**")
    sampled = f" (a uniform sample of the input's {r['rows'] - r['empty']})" if r.get("sampled") else ""
    who = r.get("model_identity") or {}
    lines = [f"# Monitor: {r['input']}", "",
             f"Model {who.get('name', r['model'])}, version {who.get('version', '?')}; {r.get('at', '')}.", "",
             f"{verdict_line}: {r['texts']} texts{sampled} against the model's reference of {r['reference_texts']}"
             f" (validation texts), each signal's threshold set for a {r['false_alarm']:.2%} chance of a false"
             " alarm on texts like the reference.", "",
             "| signal | distance | threshold | drift | what it measures |", "|---|---|---|---|---|"]
    for name, s in r["signals"].items():
        lines.append(f"| {name} | {s['distance']:.4f} | {s['threshold']:.4f} | {'yes' if s['drift'] else 'no'}"
                     f" | {describe(name)} |")
    tagger = "tag_shares" in r
    what = "top-tag precision (the share of texts whose most probable tag is theirs)" if tagger else "accuracy"
    lines += ["", f"Estimated {what} (from confidence, no labels): **{est['value']:.3f}** (95 % interval"
              f" {est['low']:.3f} to {est['high']:.3f}); on the reference it was {est['reference']}."
              + (f" Caveat: {est['caveat']}." if est.get("caveat") else "")]
    if "accuracy" in r:
        lines.append(f"{'Top-tag precision' if tagger else 'Accuracy'} with the given labels: **{r['accuracy']:.3f}**"
                     f" ({r['labelled']} labelled texts).")
    if tagger:
        per = r["tags_per_text"]
        lines += ["", f"Tags a text: {per['window']:.2f} here, {per['reference']} in the reference.", "",
                  "| tag | share of texts tagged here | in the reference | top tag here | top tag in the reference |",
                  "|---|---|---|---|---|"]
        lines += [f"| {label} | {s['window']:.3f} | {s['reference']:.3f} | {r['class_shares'][label]['window']:.3f}"
                  f" | {r['class_shares'][label]['reference']:.3f} |" for label, s in r["tag_shares"].items()]
    else:
        lines += ["", "| class | share here | share in the reference |", "|---|---|---|"]
        lines += [f"| {label} | {s['window']:.3f} | {s['reference']:.3f} |" for label, s in r["class_shares"].items()]
    lines += outlier_lines(r)
    lines += ["", "![signals](plots/signals.png)", ""]
    return "\n".join(lines)


def outlier_lines(r: dict) -> list[str]:
    """The report's unusual texts: the share past UNUSUAL against what texts like the reference give, and the
    most unusual ones (a text's | and line breaks made safe for a table)."""
    if "unusual" not in r:
        return []
    u = r["unusual"]
    lines = ["", f"Unusual texts (an outlier score past {u['past']}: more unusual than {u['past']:.0%} of the"
             f" reference): **{u['share']:.1%}** here, about {u['expected']:.0%} for texts like the reference."]
    if r.get("outliers"):
        lines += ["", "| outlier score | predicted | text |", "|---|---|---|"]
        lines += [f"| {o['score']:.3f} | {o['label']} | {' '.join(o['text'].split()).replace('|', '/')} |"
                  for o in r["outliers"]]
    return lines


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
