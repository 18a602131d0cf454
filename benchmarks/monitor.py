"""What monitoring says of a trained model on data it was and was not made for.

    .venv/bin/python benchmarks/monitor.py [--run runs/bbc-minilm] [--size 100] [--windows 30]
                                            [--shifted trec,news] [--workdir /tmp/tl-monitor]

The run's exported model gets a profile from its validation texts only (a copy of the model; the run's own
profile, from val and test, is left as it is), so that its test split is texts the profile never saw:
- false alarms: `--windows` windows of `--size` texts drawn from the test split (without replacement inside a
  window): the share that reads as drift, against the rate the thresholds were set for (0.01);
- the accuracy estimate on the whole test split (no labels used) against the real accuracy;
- shifts with labels: the test split's texts cut to their first 12 words, and thinned to every other word, labels
  kept: the verdict, the estimate against the real accuracy;
- shifted corpora (benchmarks/quality.py's converters: trec, short questions; news, another outlet's articles):
  `--size` texts each, the verdict and each signal's distance against its threshold (their labels are not the
  model's: no real accuracy).
Prints one table; the machine's CPU is in its first line.
"""

from __future__ import annotations

import argparse
import csv
import platform
import random
import shutil
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--run", default=str(ROOT / "runs" / "bbc-minilm"))
    p.add_argument("--size", type=int, default=100)
    p.add_argument("--windows", type=int, default=30)
    p.add_argument("--shifted", default="trec,news")
    p.add_argument("--workdir", default="/tmp/tl-monitor")
    p.add_argument("--online", action="store_true",
                   help="also serve the model (torchloom serve, window --size) and stream the test texts, then each"
                        " shifted corpus, reading GET /v1/monitor after every window")
    args = p.parse_args()

    from torchloom.data.texts import labelled_texts
    from torchloom.manifest import read
    from torchloom.model.predict import Predictor
    from torchloom.monitor.drift import distances, estimated_accuracy, thresholds, verdict
    from torchloom.monitor.profile import kernel_for, read_profile, reference_texts, text_signals, write_profile

    run, work = Path(args.run), Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    model = work / "model"
    shutil.rmtree(model, ignore_errors=True)
    shutil.copytree(run / "model", model)
    m = read(run / "data")
    val, val_labels = labelled_texts(m, "val", 1000)
    test, test_labels = labelled_texts(m, "test", 1000)
    started = time.perf_counter()
    write_profile(model, val, val_labels, {"val": len(val), "test": 0})
    profile_s = time.perf_counter() - started
    profile = read_profile(model)
    correct = np.asarray(profile["reference"]["correct"])
    k = len(profile["labels"])
    predictor = Predictor(str(model))
    kernel = kernel_for(profile, predictor)
    reference = reference_texts(profile, sketched=kernel is not None)

    def signals(texts: list[str]):
        answers = predictor.predict(texts, with_signals=True)
        return answers, text_signals(predictor.labels, answers, kernel)

    rows = []
    answers, test_signals = signals(test)
    real = float(np.mean([a["label"] == y for a, y in zip(answers, test_labels)]))
    est, low, high = estimated_accuracy(test_signals.confidence, reference, correct)
    rows.append(("test split, whole", len(test), "-", f"{est:.3f} [{low:.3f}, {high:.3f}]", f"{real:.3f}",
                 "yes" if low <= real <= high else "NO"))
    size = min(args.size, len(test))
    limits = thresholds(reference, size, k)
    rng = np.random.default_rng(42)
    alarms = 0
    for _ in range(args.windows):
        index = rng.choice(len(test), size, replace=False)
        alarms += bool(verdict(distances(test_signals.take(index), reference, k), limits))
    rows.append((f"test split, {args.windows} windows of {size}", size, f"{alarms}/{args.windows} drift", "-", "-",
                 "-"))
    # shifts with labels: the test split's texts cut or thinned, their labels kept (the label space is the model's)
    for name, change in (("test split, first 12 words", lambda t: " ".join(t.split()[:12])),
                         ("test split, every other word", lambda t: " ".join(t.split()[::2]))):
        changed = [change(t) for t in test]
        answers, shifted = signals(changed)
        real = float(np.mean([a["label"] == y for a, y in zip(answers, test_labels)]))
        found = distances(shifted, reference, k)
        lim = thresholds(reference, len(changed), k)
        drifted = verdict(found, lim)
        est, low, high = estimated_accuracy(shifted.confidence, reference, correct)
        detail = ", ".join(f"{n} {found[n]:.2f}/{lim[n]:.2f}" for n in found)
        rows.append((name, len(changed), f"drift: {', '.join(drifted) or 'none'} ({detail})",
                     f"{est:.3f} [{low:.3f}, {high:.3f}]", f"{real:.3f}", "yes" if low <= real <= high else "NO"))
    from quality import CONVERTERS

    for corpus in [c for c in args.shifted.split(",") if c]:
        path = CONVERTERS[corpus](work)
        with open(path, newline="", encoding="utf-8") as f:
            texts = [r["text"] for r in csv.DictReader(f)]
        texts = random.Random(42).sample(texts, min(args.size, len(texts)))
        _, shifted = signals(texts)
        found = distances(shifted, reference, k)
        lim = thresholds(reference, len(texts), k)
        drifted = verdict(found, lim)
        est, low, high = estimated_accuracy(shifted.confidence, reference, correct)
        detail = ", ".join(f"{n} {found[n]:.2f}/{lim[n]:.2f}" for n in found)
        rows.append((f"{corpus} (shifted)", len(texts), f"drift: {', '.join(drifted) or 'none'} ({detail})",
                     f"{est:.3f} [{low:.3f}, {high:.3f}]", "-", "-"))
    if args.online:
        rows += online(model, test, [c for c in args.shifted.split(",") if c], work, args.size)
    print(f"# monitor: {run} ({len(reference)} val texts in the profile, written in {profile_s:.1f} s); {cpu_name()},"
          f" {time.strftime('%Y-%m-%d')}")
    print("| texts | n | verdict (distance/threshold) | estimated accuracy [95 %] | real accuracy | held |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(str(c) for c in row) + " |")
    return 0


def online(model: Path, test: list[str], shifted: list[str], work: Path, size: int) -> list[tuple]:
    """A real `torchloom serve` of the profiled model, its window `size` texts: the test split streamed in
    requests of 10 texts, then each shifted corpus; the verdict after every window."""
    import asyncio

    import httpx
    from quality import CONVERTERS
    from serve import Process, wait_ready

    server = Process([sys.executable, "-m", "torchloom", "serve", str(model), "--port", "0", "--device", "cpu",
                      "--monitor-window", str(size)], work, "online")
    rows = []
    try:
        asyncio.run(wait_ready(server.url))
        client = httpx.Client(base_url=server.url, timeout=120)

        def stream(name: str, texts: list[str]) -> None:
            states = []
            for start in range(0, len(texts) - size + 1, size):
                for i in range(start, start + size, 10):
                    client.post("/v1/predict", json={"texts": texts[i:min(i + 10, start + size)]}).raise_for_status()
                r = client.get("/v1/monitor").json()
                states.append(r["state"] + (f" ({', '.join(r['drifted'])})" if r["drifted"] else ""))
            est = r.get("estimated_accuracy", {})
            rows.append((f"online: {name}", f"{len(states)} x {size}", "; ".join(states),
                         f"{est.get('value', 0):.3f} [{est.get('low', 0):.3f}, {est.get('high', 0):.3f}]", "-", "-"))

        stream("test split", test)
        for corpus in shifted:
            path = CONVERTERS[corpus](work)
            with open(path, newline="", encoding="utf-8") as f:
                texts = [r["text"] for r in csv.DictReader(f)]
            stream(f"{corpus} (shifted)", random.Random(7).sample(texts, min(2 * size, len(texts))))
        log = server.out.with_suffix(".err").read_text()
        rows.append(("online: the server's log", "-", " / ".join(line.split("torchloom.serve: ", 1)[1][:90]
                                                             for line in log.splitlines() if "monitor:" in line),
                     "-", "-", "-"))
    finally:
        server.stop()
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
