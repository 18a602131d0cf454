"""The parts of one training step that set torchloom's defaults, each against its alternative.

    .venv/bin/python benchmarks/step_parts.py [--rounds 3] [--reps 8] [--threads 1] [--batch 8] [--seq 128]

One process, the embedded MiniLM built as training builds it (torchloom.model.build), random token
ids (speed only), bf16 autocast where the CPU has it. Measured, interleaved round by round so that
both sides of each pair meet the same machine:

- forward + backward with attention-probability dropout 0.1 (the BERT default) against 0
  (model.attention_dropout, torchloom's default);
- AdamW.step() with the foreach implementation (torch's CPU default) against fused (what
  train/optim.build uses);
- gradient clipping (clip_grad_norm_ to 1.0), as a share of the step.

Prints a table of medians (seconds) with each default's ratio to its alternative.
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=8, help="timed repetitions per side and round (after 2 warm-up)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (a DDP rank on 2 cores has 1)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    args = ap.parse_args()

    import torch
    import torch.nn.functional as F

    from torchloom.embedded import demo_model_path
    from torchloom.model.build import build_classifier
    from torchloom.plan.calibrate import bf16_supported
    from torchloom.train.optim import param_groups

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    labels = ["a", "b", "c", "d", "e"]
    model_dir = demo_model_path()
    models = {p: build_classifier(model_dir, labels, p) for p in (0.1, 0.0)}
    for m in models.values():
        m.train()
    vocab = models[0.0].config.vocab_size
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, vocab, (args.batch, args.seq), generator=gen)
    mask = torch.ones_like(ids)
    targets = torch.randint(0, len(labels), (args.batch,), generator=gen)
    dtype = torch.bfloat16 if bf16_supported() else None

    def fwd_bwd(model) -> float:
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=dtype) if dtype else contextlib.nullcontext():
            logits = model(input_ids=ids, attention_mask=mask).logits
        F.cross_entropy(logits.float(), targets).backward()
        return time.perf_counter() - start

    # the optimizer pair runs on one model's gradients (the 0-dropout one), restored between the sides
    model = models[0.0]
    fwd_bwd(model)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [p.grad.clone() for p in params]
    optimizers = {name: torch.optim.AdamW(param_groups(model, 0.01), lr=2e-5, **kw)
                  for name, kw in (("foreach", {"foreach": True}), ("fused", {"fused": True}))}

    def opt_step(name: str) -> float:
        for p, g in zip(params, grads):
            p.grad = g.clone()
        start = time.perf_counter()
        optimizers[name].step()
        return time.perf_counter() - start

    def clip() -> float:
        for p, g in zip(params, grads):
            p.grad = g.clone()
        start = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        return time.perf_counter() - start

    samples: dict[str, list[float]] = {k: [] for k in ("drop0.1", "drop0", "foreach", "fused", "clip")}
    for r in range(args.rounds):
        for _ in range(2):  # warm-up of each side this round
            fwd_bwd(models[0.1]), fwd_bwd(models[0.0]), opt_step("foreach"), opt_step("fused")
        for _ in range(args.reps):  # alternate the sides rep by rep
            for m in models.values():
                m.zero_grad(set_to_none=True)
            samples["drop0.1"].append(fwd_bwd(models[0.1]))
            samples["drop0"].append(fwd_bwd(models[0.0]))
            samples["foreach"].append(opt_step("foreach"))
            samples["fused"].append(opt_step("fused"))
            samples["clip"].append(clip())
        print(f"round {r + 1}/{args.rounds}: fwd+bwd dropout 0.1 / 0: "
              f"{statistics.median(samples['drop0.1'][-args.reps:]):.3f} / "
              f"{statistics.median(samples['drop0'][-args.reps:]):.3f} s; AdamW foreach / fused: "
              f"{statistics.median(samples['foreach'][-args.reps:]):.4f} / "
              f"{statistics.median(samples['fused'][-args.reps:]):.4f} s", file=sys.stderr, flush=True)

    med = {k: statistics.median(v) for k, v in samples.items()}
    step = med["drop0"] + med["clip"] + med["fused"]
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(f"\n{when}, {platform.machine()}, torch {torch.__version__}, {args.threads} thread(s), micro-batch"
          f" {args.batch} x {args.seq} tokens, {'bf16 autocast' if dtype else 'fp32'}, medians of"
          f" {args.rounds} x {args.reps} interleaved reps\n")
    print("| part | alternative s | torchloom default s | alternative / default |")
    print("|---|---:|---:|---:|")
    print(f"| forward + backward: attention dropout 0.1 vs 0 | {med['drop0.1']:.3f} | {med['drop0']:.3f} |"
          f" {med['drop0.1'] / med['drop0']:.2f}x |")
    print(f"| AdamW.step(): foreach vs fused | {med['foreach']:.4f} | {med['fused']:.4f} |"
          f" {med['foreach'] / med['fused']:.2f}x |")
    print(f"| clip_grad_norm_ (both) | | {med['clip']:.4f} | share of a default step {med['clip'] / step:.1%} |")
    print(f"| one default step (fwd+bwd, clip, fused AdamW) | | {step:.3f} | |")


if __name__ == "__main__":
    main()
