"""`torchloom plan --calibrate`: time real training steps of the embedded model here, against the estimate."""

from __future__ import annotations

import statistics
import time

from torchloom.plan.estimate import Job, data_parallel

WARMUP_STEPS = 2


def embedded_model_dir() -> str:
    from torchloom.embedded import demo_model_path

    return demo_model_path()


def precision(setting: str) -> str:
    """The precision training would run in on this CPU (model/device.py's rule)."""
    from torchloom.model.device import choose_precision

    return choose_precision(setting, "cpu", key="--precision").precision


def measure(model_dir: str, seq: int, micro_batch: int, precision: str, steps: int,
            attention_dropout: float | None = None) -> dict:
    """Seconds per optimizer step of one process, as torchloom's loop runs it: the model built as
    training builds it (model.attention_dropout, the config's default unless given), autocast forward,
    cross-entropy, backward, gradient clipping, and training's own optimizer (train/optim.build: fused
    AdamW), on random token ids (speed only)."""
    import contextlib

    import torch
    import torch.nn.functional as F

    from torchloom.config.schema import ModelConfig, TrainConfig
    from torchloom.model.build import build_classifier
    from torchloom.train import optim

    labels = ["a", "b", "c", "d", "e"]
    dropout = ModelConfig().attention_dropout if attention_dropout is None else attention_dropout
    model = build_classifier(model_dir, labels, dropout)
    model.train()
    train_cfg = TrainConfig()
    optimizer, _ = optim.build(model, train_cfg.lr, train_cfg.weight_decay, 1000, 0, train_cfg.schedule,
                               torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(1000, model.config.vocab_size, (micro_batch, seq), generator=gen)
    attention_mask = torch.ones_like(input_ids)
    targets = torch.randint(0, len(labels), (micro_batch,), generator=gen)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    times = []
    for i in range(WARMUP_STEPS + steps):
        if i == WARMUP_STEPS:
            cpu_start = time.process_time()
        start = time.perf_counter()
        ctx = torch.autocast("cpu", dtype=dtype) if dtype else contextlib.nullcontext()
        with ctx:
            logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
        F.cross_entropy(logits.float(), targets).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    cpu_seconds = time.process_time() - cpu_start
    threads = torch.get_num_threads()
    # Below ~90%, other processes took the cores part of the time and the steps ran slow.
    core_share = cpu_seconds / (sum(times[WARMUP_STEPS:]) * threads)
    return {"step_seconds": times[WARMUP_STEPS:], "threads": threads, "torch": torch.__version__,
            "core_share": core_share, "attention_dropout": dropout}


def both_paths(job: Job, steps: int) -> tuple[dict, dict[str, float]]:
    """Steps in the job's precision, and the other of fp32 / bf16 too (fewer steps when it is the slow one):
    the median seconds per step of each, which the precision warning quotes (torchloom.machine)."""
    from torchloom import machine

    model_dir = embedded_model_dir()
    m = measure(model_dir, job.seq, job.micro_batch, job.precision, steps)
    medians = {job.precision: statistics.median(m["step_seconds"])}
    other = "bf16" if job.precision == "fp32" else "fp32"
    if job.precision in ("fp32", "bf16"):
        few = max(2, steps // 2) if other == "bf16" and not machine.cpu().bf16_how else steps
        medians[other] = statistics.median(measure(model_dir, job.seq, job.micro_batch, other, few)["step_seconds"])
        machine.save_calibration(medians)
    return m, medians


def compare(job: Job, steps: int) -> dict:
    from torchloom import machine

    predicted = data_parallel(job, "ddp")
    m, medians = both_paths(job, steps)
    measured = medians[job.precision]
    fwd_bwd = max(1e-9, measured - predicted.optimizer_s)
    peak = job.cluster.flops(job.precision)
    return {
        "model": job.model.name, "seq": job.seq, "micro_batch": job.micro_batch, "precision": job.precision,
        "threads": m["threads"], "torch": m["torch"], "cores": machine.usable_cores(),
        "attention_dropout": m["attention_dropout"],
        "core_share": m["core_share"],
        "warmup_steps": WARMUP_STEPS, "step_seconds": m["step_seconds"], "measured_step_s": measured,
        "fastest_step_s": min(m["step_seconds"]),
        "predicted_step_s": predicted.step_s, "predicted_compute_s": predicted.compute_s,
        "predicted_optimizer_s": predicted.optimizer_s, "flops_per_step": predicted.flops_per_step,
        "peak_flops": peak, "mfu_assumed": job.mfu or job.cluster.device.mfu,
        # the MFU that would make compute match, if the optimizer estimate holds
        "mfu_implied": predicted.flops_per_step / fwd_bwd / peak,
        "error_pct": (predicted.step_s - measured) / measured * 100,
        "cpu": machine.cpu().describe(), "step_s_by_precision": medians,
        "faster": min(medians, key=medians.get),
    }


def render(r: dict) -> str:
    times = ", ".join(f"{t:.2f}" for t in r["step_seconds"])
    verdict = "within" if abs(r["error_pct"]) <= 30 else "OUTSIDE"
    share = r["core_share"]
    by = r.get("step_s_by_precision", {})
    faster = r.get("faster", r["precision"])
    slower = next((p for p in by if p != faster), None)
    paths = (f"faster     {faster} here: {by[faster]:.3f} s per step against {slower} {by[slower]:.3f} s"
             f" ({by[slower] / by[faster]:.1f}x slower)" if slower else f"faster     {faster} (only one measured)")
    return "\n".join([
        f"cpu        {r.get('cpu', '?')}",
        paths,
        f"calibrate: {r['model']} (embedded), seq {r['seq']}, micro-batch {r['micro_batch']}, {r['precision']}"
        f"{' autocast' if r['precision'] != 'fp32' else ''}, 1 process x {r['threads']} threads, AdamW (fused, as"
        f" training), attention dropout {r.get('attention_dropout', 0.0):g}, torch {r['torch']}",
        f"measured   {r['measured_step_s']:.3f} s per step (median of {len(r['step_seconds'])} after"
        f" {r['warmup_steps']} warm-up: {times}; fastest {r['fastest_step_s']:.3f})",
        f"predicted  {r['predicted_step_s']:.3f} s = compute {r['predicted_compute_s']:.3f} s"
        f" ({r['flops_per_step'] / 1e9:.1f} GFLOP at {r['peak_flops'] / 1e12:.2f} TFLOP/s x MFU {r['mfu_assumed']:g})"
        f" + optimizer {r['predicted_optimizer_s']:.3f} s",
        f"error      {r['error_pct']:+.0f}% (predicted against measured): {verdict} the +-30% target;"
        f" the MFU that matches here is {r['mfu_implied']:.3f} (pass it with --mfu)",
        f"cores      this process ran {share:.0%} of the time on its {r['threads']} threads"
        + ("; other processes took the cores the rest of it, so the measurement is slow: rerun when idle"
           if share < 0.85 else ""),
    ])
