"""torchloom's built-in baseline against the scikit-learn reference, on the same prepared rows.

    .venv/bin/python benchmarks/baseline.py [--corpora demo,trec,news,newsgroups,r52,sms] [--engines driver,spark]
                                            [--spark-corpora demo,trec,sms] [--workdir /tmp/tl-baseline]

Each corpus (benchmarks/quality.py: registry packages, converted to CSV) is prepared by torchloom itself
(`torchloom prepare --eval.baseline false`, reused when its manifest is there), so the train, val and test
rows are exactly the prepared ones. Then, on those Parquet rows:
- ours: etl/baseline.fit_and_score, once per engine (driver: scikit-learn; spark: Spark SQL + MLlib on
  local[*], only on --spark-corpora: one job per L-BFGS iteration is slow on one small machine), fitted on
  train with C chosen on val, scored on test;
- the reference: TfidfVectorizer(ngram_range=(1, 2), sublinear_tf=True, min_df=2, max_features=300000) +
  LogisticRegression(C=10, max_iter=1000), fitted on the same train rows, scored on the same test rows.
Prints one table (test accuracy, the difference in points, the fit seconds of each), the machine and the date.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quality  # noqa: E402  (benchmarks/quality.py: the corpora)

ROOT = Path(__file__).resolve().parent.parent


def prepared(corpus: str, workdir: Path) -> Path:
    out = workdir / "prep" / corpus
    if not (out / "data" / "manifest.json").is_file():
        cmd = [sys.executable, "-m", "torchloom", "prepare", *quality.data_args(corpus, workdir),
               "--output.dir", str(out), "--output.overwrite", "true", "--eval.baseline", "false",
               "--tracking.enabled", "false"]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"{corpus}: prepare failed\n{proc.stderr[-2000:]}")
    return out / "data"


def reference(manifest) -> tuple[float, float]:
    """The scikit-learn reference's test accuracy and fit seconds (vectorizer and classifier)."""
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression

    from torchloom.baseline.driver import read_split

    texts, labels = read_split(manifest, "train")
    test_texts, test_labels = read_split(manifest, "test")
    started = time.perf_counter()
    vec = TfidfVectorizer(ngram_range=(1, 2), sublinear_tf=True, min_df=2, max_features=300000)
    model = LogisticRegression(C=10, max_iter=1000).fit(vec.fit_transform(texts), labels)
    fit_s = time.perf_counter() - started
    return float(np.mean(model.predict(vec.transform(test_texts)) == test_labels)), fit_s


def describe(manifest) -> dict:
    from torchloom.baseline.driver import read_split

    train, test = read_split(manifest, "train")[0], read_split(manifest, "test")[0]
    words = sum(len(t.split()) for t in train + test) / max(1, len(train) + len(test))
    return {"classes": manifest.num_labels, "train": len(train), "test": len(test), "words": words}


def spark_session():
    from torchloom.config.schema import PrepareConfig
    from torchloom.etl.session import get_spark

    return get_spark(PrepareConfig())


def machine() -> str:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = re.search(r"Model name:\s*(.+)", lscpu)
    flags = re.search(r"Flags:\s*(.+)", lscpu)
    have = set(flags.group(1).split()) if flags else set()
    marks = ", ".join(f"{f} {'yes' if f in have else 'no'}" for f in ("avx512_bf16", "amx_bf16", "amx_tile"))
    return (f"{model.group(1).strip() if model else platform.processor()}; {os.cpu_count()} cores; {marks};"
            f" Python {platform.python_version()}")


def measure(corpus: str, engines: list[str], workdir: Path, spark) -> dict:
    """One table row: the corpus's sizes, the reference's accuracy and seconds, and each engine's."""
    from torchloom.baseline import fit_and_score
    from torchloom.manifest import read

    m = read(prepared(corpus, workdir))
    row = {"corpus": corpus, **describe(m)}
    row["ref"], row["ref_s"] = reference(m)
    for engine in engines:
        result = fit_and_score(spark if engine == "spark" else None, m, ["val", "test"], engine=engine)
        row[engine] = result["splits"]["test"]["accuracy"]
        row[f"{engine}_s"], row[f"{engine}_C"] = result["fit_s"], result["C"]
        print(f"{corpus} {engine}: test {row[engine]:.4f} (reference {row['ref']:.4f}), C={result['C']:g}"
              f" {result['grid']}, {result['num_features']} features, {result['fit_s']:.1f} s", file=sys.stderr,
              flush=True)
    return row


def table(rows: list[dict], engines: list[str]) -> None:
    heads = ["data set", "classes", "train", "test", "words/text"]
    for e in engines:
        heads += [f"ours ({e}) acc", "C"]
    heads += ["reference acc", *[f"{e} - ref (points)" for e in engines], *[f"fit s ({e})" for e in engines],
              "fit s (ref)"]
    print("| " + " | ".join(heads) + " |")
    print("|---|" + "---:|" * (len(heads) - 1))
    for r in rows:
        cells = [r["corpus"], r["classes"], r["train"], r["test"], f"{r['words']:.0f}"]
        for e in engines:
            cells += [f"{r[e]:.4f}", f"{r[f'{e}_C']:g}"] if e in r else ["-", "-"]
        cells += [f"{r['ref']:.4f}", *[f"{(r[e] - r['ref']) * 100:+.2f}" if e in r else "-" for e in engines],
                  *[f"{r[f'{e}_s']:.1f}" if e in r else "-" for e in engines], f"{r['ref_s']:.1f}"]
        print("| " + " | ".join(map(str, cells)) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpora", default="demo,trec,news,newsgroups,r52,sms")
    ap.add_argument("--engines", default="driver,spark", help="driver, spark or both")
    ap.add_argument("--spark-corpora", default="demo,trec,sms", help="the corpora the spark engine runs on")
    ap.add_argument("--workdir", default="/tmp/tl-baseline")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    engines = args.engines.split(",")
    spark = spark_session() if "spark" in engines else None
    on_spark = args.spark_corpora.split(",")
    rows = [measure(corpus, [e for e in engines if e != "spark" or corpus in on_spark], workdir, spark)
            for corpus in args.corpora.split(",")]
    print(f"\n{datetime.now(UTC):%Y-%m-%d %H:%M} UTC; {machine()}\n")
    table(rows, engines)


if __name__ == "__main__":
    main()
