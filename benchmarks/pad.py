"""Padding a batch of encoded texts: the tokenizer's own `pad` against torchloom's `pad_batch`.

    .venv/bin/python benchmarks/pad.py [--model runs/bbc-minilm/model] [--rounds 50]

Both pad the same 64 encoded BBC News texts (headline + lede, <= 400 chars; synthetic sentences without
the demo corpus) in the same process, alternating, each timed from the same clock; prints ms per batch
and the ratio. On a GPU this padding was most of an inference batch's time (docs/benchmarks.md, "On a GPU").
"""

import argparse
import statistics
import time

from serve import load_texts

from torchloom.machine import cpu
from torchloom.model.predict import Predictor, pad_batch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="", help="an exported model dir; default: MiniLM with a fresh head")
    p.add_argument("--rounds", type=int, default=50)
    a = p.parse_args()
    model = a.model
    if not model:
        import tempfile
        from pathlib import Path

        from serve import export_benchmark_model

        model = export_benchmark_model(Path(tempfile.mkdtemp()) / "model")
    predictor = Predictor(model, batch_size=64)
    features = [f for windows in predictor.encode_windows(load_texts(64)) for f in windows]
    timings: dict[str, list[float]] = {"tokenizer.pad": [], "pad_batch": []}
    for _ in range(a.rounds):
        for name, pad in (("tokenizer.pad", lambda: predictor.tokenizer.pad(features, return_tensors="pt")),
                          ("pad_batch", lambda: pad_batch(features, predictor.tokenizer))):
            started = time.perf_counter()
            pad()
            timings[name].append((time.perf_counter() - started) * 1e3)
    base = statistics.median(timings["tokenizer.pad"])
    c = cpu()
    print(f"{len(features)} texts, longest {max(len(f['input_ids']) for f in features)} tokens; {c.model},"
          f" {c.cores} cores; median of {a.rounds} rounds")
    print("| padding | ms per batch of 64 | x tokenizer.pad |\n|---|---:|---:|")
    for name, values in timings.items():
        print(f"| {name} | {statistics.median(values):.2f} | {statistics.median(values) / base:.3f} |")


if __name__ == "__main__":
    main()
