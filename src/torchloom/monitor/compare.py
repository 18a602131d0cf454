"""`torchloom predict --model A --model B --input FILE`: both models score the same texts, and a report says how
they differ: agreement, each class's share under each model, and where the file has labels each model's accuracy
and per-class F1 with McNemar's test on the texts they disagree about (ab.once: one look at a fixed set of labels).
Writes report.md, compare.json and the texts they disagree on (disagreements.jsonl) under --report.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from torchloom.errors import UserError
from torchloom.runs.outputs import check_output, clear_output, record_output


def model_names(given: list[str]) -> list[tuple[str, str]]:
    """(name, dir) per `--model NAME=DIR` or DIR (named after its run, else its folder; A and B where both
    would read the same)."""
    out = []
    for g in given:
        name, sep, path = g.partition("=")
        if not sep or not name or "/" in name:
            name, path = "", g
        out.append((name, path))
    auto = [Path(p).resolve().parent.name if Path(p).name == "model" else Path(p).name for _, p in out]
    if len(set(auto)) < len(auto):
        auto = [chr(65 + i) for i in range(len(out))]
    return [(name or a, path) for (name, path), a in zip(out, auto)]


def compare_file(models: list[tuple[str, str]], input_path: str, report: str, text_column: str = "text",
                 labels_column: str | None = None, sample: int = 100_000, alpha: float = 0.05, device: str = "cpu",
                 overwrite: bool = False, say=print) -> dict[str, Any]:
    from torchloom.model.predict import Predictor
    from torchloom.monitor.ab import Outcomes, once
    from torchloom.monitor.batch import read_sample

    (name_a, dir_a), (name_b, dir_b) = models
    if name_a == name_b:
        raise UserError(f"--model {name_a}=...: two models of one name; name them apart (--model v1=DIR --model"
                        " v2=DIR)")
    out = Path(report)
    if out.exists() and not overwrite:
        raise UserError(f"--report {report}: already exists; remove it or pass --overwrite")
    if overwrite:
        check_output(out, [input_path, dir_a, dir_b], "--report")
    drawn = read_sample(input_path, text_column, labels_column, sample, say=say)
    texts, truth = drawn.texts, drawn.labels if labels_column else None
    if not texts:
        raise UserError(f"--input {input_path}: no texts to compare ({drawn.empty} empty)")
    started = time.perf_counter()
    a, b = Predictor(dir_a, device=device), Predictor(dir_b, device=device)
    if sorted(a.labels) != sorted(b.labels):
        raise UserError(f"--model {name_b}: its labels ({', '.join(b.labels)}) differ from {name_a}'s"
                        f" ({', '.join(a.labels)}); compare models of one label set")
    pa, pb = [r["label"] for r in a.predict(texts)], [r["label"] for r in b.predict(texts)]
    labels = a.labels
    result: dict[str, Any] = {
        "models": {name_a: dir_a, name_b: dir_b}, "input": input_path, "texts": len(texts), "rows": drawn.total,
        "empty": drawn.empty, "sampled": len(texts) < drawn.total - drawn.empty,
        "agreement": round(float(np.mean([x == y for x, y in zip(pa, pb)])), 4),
        "class_shares": {label: {name_a: round(pa.count(label) / len(pa), 4),
                                 name_b: round(pb.count(label) / len(pb), 4)} for label in labels},
        "seconds": 0.0,
    }
    if truth is not None:
        keep = [i for i, y in enumerate(truth) if y not in (None, "")]
        unknown = sorted({truth[i] for i in keep} - set(labels))
        if unknown:
            say(f"{sum(truth[i] in unknown for i in keep)} texts labelled with labels the models do not have"
                f" ({', '.join(unknown[:5])}): they count as wrong for both")
        outcomes = Outcomes()
        for i in keep:
            outcomes.add(pa[i] == truth[i], pb[i] == truth[i])
        verdict = once(outcomes, alpha)
        result["labelled"] = len(keep)
        result["accuracy"] = {name_a: verdict.accuracy_a, name_b: verdict.accuracy_b}
        result["f1"] = {label: {name_a: _f1(pa, truth, keep, label), name_b: _f1(pb, truth, keep, label)}
                        for label in labels}
        result["verdict"] = {"state": {"a_better": f"{name_a} better", "b_better": f"{name_b} better"}.get(
            verdict.state, "no difference found"), "test": "McNemar (exact, paired)", "p_value": verdict.p_value,
            "alpha": alpha, "line": verdict.line((name_a, name_b))}
    result["seconds"] = round(time.perf_counter() - started, 2)
    _write(out, result, texts, pa, pb, truth, (name_a, name_b), [input_path, dir_a, dir_b])
    return result


def _f1(pred: list[str], truth: list[Any], keep: list[int], label: str) -> float:
    tp = sum(1 for i in keep if pred[i] == label and truth[i] == label)
    fp = sum(1 for i in keep if pred[i] == label and truth[i] != label)
    fn = sum(1 for i in keep if pred[i] != label and truth[i] == label)
    return round(2 * tp / (2 * tp + fp + fn), 4) if tp else 0.0


def _write(out: Path, r: dict, texts: list[str], pa: list[str], pb: list[str], truth, names: tuple[str, str],
           inputs: list[str]) -> None:
    clear_output(out, inputs, "--report")  # an earlier report of torchloom's, as it left it, checked again
    out.mkdir(parents=True)
    (out / "compare.json").write_text(json.dumps(r, indent=2) + "\n", encoding="utf-8")
    with open(out / "disagreements.jsonl", "w", encoding="utf-8") as f:
        for i, (t, x, y) in enumerate(zip(texts, pa, pb)):
            if x != y:
                row = {"text": t, names[0]: x, names[1]: y, **({"label": truth[i]} if truth is not None else {})}
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    (out / "report.md").write_text(report_text(r, names), encoding="utf-8")
    record_output(out)


def report_text(r: dict, names: tuple[str, str]) -> str:
    a, b = names
    sampled = f" (a uniform sample of the input's {r['rows'] - r['empty']})" if r["sampled"] else ""
    lines = [f"# {a} against {b}: {r['input']}", "",
             f"{r['texts']} texts{sampled}; the two models agree on **{r['agreement']:.1%}** of them"
             " (the others are in disagreements.jsonl).", ""]
    if "verdict" in r:
        v = r["verdict"]
        lines += [f"**{v['state']}** on {r['labelled']} labelled texts: {v['line']}. The test: McNemar's exact test"
                  f" on the texts exactly one model got right, at level {v['alpha']}.", "",
                  f"| class | F1 {a} | F1 {b} | share {a} | share {b} |", "|---|---|---|---|---|"]
        lines += [f"| {label} | {f[a]:.3f} | {f[b]:.3f} | {r['class_shares'][label][a]:.3f} |"
                  f" {r['class_shares'][label][b]:.3f} |" for label, f in r["f1"].items()]
    else:
        lines += [f"| class | share {a} | share {b} |", "|---|---|---|"]
        lines += [f"| {label} | {s[a]:.3f} | {s[b]:.3f} |" for label, s in r["class_shares"].items()]
    return "\n".join(lines) + "\n"
