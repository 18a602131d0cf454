"""What shipping the mix with the baseline costs at serving time: Predictor on a run's test texts, the model as
exported (transformer alone) against the same model shipping 0.5 x the transformer + 0.5 x the baseline.

    .venv/bin/python benchmarks/mix_cost.py RUN_DIR [--rounds 3] [--texts 200]

RUN_DIR: a finished `torchloom run` (its model/, data/ and baseline/). Both sides run interleaved in one
process, timed from the same moment each round; the baseline's own time (lexical.py, TF-IDF + logistic
regression in numpy) is timed alone too. Prints one table: ms per text, and the ratio against the transformer
alone, median over rounds, with the CPU it ran on.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from torchloom.data.texts import texts_at
from torchloom.lexical import Lexical
from torchloom.manifest import read as read_manifest
from torchloom.model.predict import Predictor


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def model_copy(run: Path, into: Path, weight: float) -> Path:
    """The run's model, its torchloom.json saying it ships `weight` x the transformer + the rest x the baseline."""
    shutil.copytree(run / "model", into)
    shutil.rmtree(into / "baseline", ignore_errors=True)
    shutil.copytree(run / "baseline", into / "baseline")
    info = json.loads((into / "torchloom.json").read_text())
    (into / "torchloom.json").write_text(json.dumps({**info, "combine": {"weight": weight, "baseline": "baseline"}}))
    return into


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--texts", type=int, default=200)
    args = ap.parse_args()
    manifest = read_manifest(args.run / "data")
    rows = min(args.texts, manifest.split("test").rows)
    texts = list(texts_at(manifest, "test", set(range(rows))).values())
    with tempfile.TemporaryDirectory() as tmp:
        sides = {"transformer alone": Predictor(str(model_copy(args.run, Path(tmp) / "alone", 1.0))),
                 "mix (0.5 / 0.5)": Predictor(str(model_copy(args.run, Path(tmp) / "mixed", 0.5)))}
        lexical = Lexical.load(args.run / "baseline")
        times: dict[str, list[float]] = {name: [] for name in [*sides, "baseline alone (numpy)"]}
        for _ in range(args.rounds):
            for name, predictor in sides.items():
                started = time.perf_counter()
                predictor.predict(texts)
                times[name].append((time.perf_counter() - started) / len(texts) * 1000)
            started = time.perf_counter()
            lexical.probabilities(texts)
            times["baseline alone (numpy)"].append((time.perf_counter() - started) / len(texts) * 1000)
    base = statistics.median(times["transformer alone"])
    print(f"\n{len(texts)} test texts of {args.run}, {args.rounds} rounds, CPU: {cpu_name()}")
    print("| path | ms per text (median) | x transformer alone |\n|---|---:|---:|")
    for name, values in times.items():
        ms = statistics.median(values)
        print(f"| {name} | {ms:.2f} | {ms / base:.3f} |")


if __name__ == "__main__":
    main()
