"""The plan as terminal tables or as JSON with every number."""

from __future__ import annotations

from dataclasses import asdict

from torchloom.plan.advice import Advice
from torchloom.plan.estimate import Job, Strategy, parameter_server, training_flops_per_sequence
from torchloom.plan.models import count_params
from torchloom.plan.stages import StageEstimate

GIB = 2**30

ASSUMPTIONS = [
    "model states per ZeRO: mixed precision 2 (16-bit params) + 2 (16-bit grads) + K bytes/param,"
    " K = 12 for AdamW (fp32 master, momentum, variance), 8 for SGD with momentum; fp32: 4 + 4 + 8 (AdamW)",
    "activations per layer (Korthikanti et al.): s*b*h*(18 + 4f/h [+ 5as/h with eager attention]) bytes in 16-bit,"
    " s*b*h*(34 + 8f/h [+ 9as/h]) in fp32; checkpointing keeps s*b*h per layer plus one layer in full",
    "FLOPs per sequence: 6 * (parameters that multiply each token) * t + 12 * layers * t^2 * hidden,"
    " t = min(mean tokens, seq); checkpointing recomputes the forward (x 4/3); time = FLOPs / (peak x MFU)",
    "ring all-reduce sends 2(N-1)/N * S per device, all-gather / reduce-scatter (N-1)/N * S; a ring that"
    " leaves the node runs at min(device link, node network); plus one latency per hop",
    "overlap (GPU): gradient communication hides behind backward, FSDP's all-gathers behind the layer before;"
    " time = forward + max(backward, communication); cpu (gloo on the compute cores): added, not overlapped",
    "optimizer update: bound by memory bandwidth (fused: ~30 bytes/param moved, CPU foreach AdamW ~80)",
    "pipeline: 1F1B schedule, step = (M + P - 1) x (busiest stage's micro-batch + its sends) + DDP all-reduce;"
    " bubble (P-1)/(M+P-1); the first stage holds min(P, M) micro-batches of activations",
    "fits: total <= headroom x device memory (the rest: CUDA context, allocator, fragmentation)",
]


def gib(n: float) -> str:
    return f"{n / GIB:.2f}"


def human_bytes(n: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def flops(n: float) -> str:
    for unit, size in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} FLOP"


def duration(s: float) -> str:
    if s < 1:
        return f"{s * 1000:.3g} ms"
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if s >= size:
            return f"{s / size:.3g} {unit}"
    return f"{s:.3g} s"


def label(st: Strategy) -> str:
    if st.name == "pipeline" and st.pipeline:
        return f"pipeline P{st.pipeline['stages']}xM{st.pipeline['microbatches']}"
    return st.name


def header(job: Job) -> list[str]:
    m, c, d = job.model, job.cluster, job.cluster.device
    pc = count_params(m)
    arch = f"{m.layers} layers, hidden {m.hidden}, {m.heads} heads, ffn {m.ffn}"
    arch += f", image {m.image_size}/{m.patch_size}" if m.family == "vit" else f", vocab {m.vocab_size}"
    where = f"{c.devices} x {d.name}" + (f" on {c.nodes} nodes ({c.devices_per_node} per node)" if c.nodes > 1 else "")
    mfu = job.mfu or d.mfu
    peak = d.peak_flops(job.precision) / 1e12
    mixed = "fp32" if not job.mixed else f"{job.precision} mixed"
    tokens = f"{job.tokens} tokens/row (mean)" if job.mean_tokens else f"{job.seq} tokens/row"
    detected = [f"hardware {d.description}"] if d.description else []
    return [
        *detected,
        f"model    {m.name} ({m.family}): {pc.total / 1e6:,.1f} M parameters; {arch}",
        f"devices  {where}: {d.memory_gib:g} GiB, {peak:g} TFLOP/s {'fp32' if not job.mixed else job.precision} at MFU"
        f" {mfu:g}; links {d.intra_bw_gbs:g} GB/s in a node, {d.inter_bw_gbs:g} GB/s per node between nodes",
        f"batch    seq {job.seq}, micro-batch {job.micro_batch}, grad-accum {job.grad_accum}; {mixed}, {job.optimizer},"
        f" {job.attention} attention",
        f"data     {job.rows:,} rows x {tokens}, {job.epochs} epoch{'s' if job.epochs > 1 else ''};"
        f" {flops(training_flops_per_sequence(job))} per row trained",
    ]


def memory_table(job: Job, strategies: list[Strategy]) -> list[str]:
    usable = job.cluster.memory_bytes() * job.headroom
    lines = [f"memory per device, GiB (usable {gib(usable)} = {job.headroom:.0%} of"
             f" {gib(job.cluster.memory_bytes())})",
             f"  {'strategy':<16}{'params':>8}{'grads':>8}{'optim':>8}{'activ':>8}{'buffers':>9}{'total':>8}"
             f"  {'fits':<5}{'max micro-batch':>16}"]
    for st in strategies:
        if not st.applicable:
            lines.append(f"  {st.name:<16}n/a: {st.note}")
            continue
        lines.append(f"  {label(st):<16}{gib(st.params_bytes):>8}{gib(st.grads_bytes):>8}{gib(st.optimizer_bytes):>8}"
                     f"{gib(st.activations_bytes):>8}{gib(st.buffers_bytes):>9}{gib(st.total_bytes):>8}"
                     f"  {'yes' if st.fits else 'NO':<5}{st.max_micro_batch:>16}")
    return lines


def time_table(job: Job, strategies: list[Strategy]) -> list[str]:
    lines = ["time per optimizer step and for the run",
             f"  {'strategy':<16}{'samples/step':>13}{'compute':>10}{'comm/step':>11}{'comm':>10}{'optim':>9}"
             f"{'step':>10}{'samples/s':>11}{'epoch':>10}{'total':>10}"]
    for st in strategies:
        if not st.applicable:
            continue
        lines.append(f"  {label(st):<16}{st.samples_per_step:>13,}{duration(st.compute_s):>10}"
                     f"{human_bytes(st.comm_bytes):>11}{duration(st.comm_s):>10}{duration(st.optimizer_s):>9}"
                     f"{duration(st.step_s):>10}{st.samples_per_s:>11,.0f}{duration(st.epoch_s):>10}"
                     f"{duration(st.total_s):>10}")
    return lines


def stages_table(job: Job, around: list[StageEstimate]) -> list[str]:
    lines = [f"the stages around training, for {job.rows:,} rows of data (--rows; prepare caps the held-out splits)"]
    for st in around:
        lines.append(f"  {st.stage:<10}{duration(st.seconds):>9}  {st.how}")
        lines.append(f"  {'':<10}{'':>9}  memory: {st.memory}")
    return lines


def render(job: Job, strategies: list[Strategy], advice: Advice, around: list[StageEstimate] | None = None) -> str:
    ps = parameter_server(job)
    n = job.cluster.devices
    lines = [*header(job), "", *memory_table(job, strategies), "", *time_table(job, strategies), ""]
    if around:
        lines += [*stages_table(job, around), ""]
    pipe = next((s for s in strategies if s.name == "pipeline" and s.applicable), None)
    if pipe:
        pp = pipe.pipeline
        lines.append(f"pipeline: {pp['stages']} stages of {pp['layers_per_stage']} layers, {pp['microbatches']}"
                     f" micro-batches, {pp['replicas']} pipeline(s) side by side; bubble (P-1)/(M+P-1) ="
                     f" {pp['bubble']:.1%}")
    if n > 1:
        lines.append(f"gradient exchange of {human_bytes(ps['gradient_bytes'])} per step: ring all-reduce sends"
                     f" {human_bytes(ps['ring_bytes_per_device'])} per device in {duration(ps['ring_seconds'])};"
                     f" a parameter server instead: {human_bytes(ps['worker_bytes'])} per worker, its link carries"
                     f" {human_bytes(ps['server_link_bytes'])}: {duration(ps['seconds'])}")
    if lines[-1]:
        lines.append("")
    if advice.strategy:
        lines.append(f"recommendation: {advice.strategy} on the {advice.engine} engine")
    else:
        lines.append(f"recommendation: no strategy fits as asked; engine {advice.engine}")
    lines += [f"  - {r}" for r in advice.reasons + advice.engine_reasons]
    lines.append("formulas: docs/parallelism.md; every number: --json")
    return "\n".join(lines)


def to_json(job: Job, strategies: list[Strategy], advice: Advice, around: list[StageEstimate] | None = None
            ) -> dict:
    pc = count_params(job.model)
    c = job.cluster
    out_strategies = []
    for st in strategies:
        d = asdict(st)
        d.update(total_bytes=st.total_bytes, fits=st.fits, samples_per_s=st.samples_per_s)
        out_strategies.append(d)
    return {
        "model": {**asdict(job.model), "params": pc.total, "params_embeddings": pc.embeddings,
                  "params_per_layer": pc.per_layer, "params_layers": pc.layers, "params_head": pc.head,
                  "params_matmul": pc.matmul},
        "cluster": {"device": asdict(c.device), "nodes": c.nodes, "devices_per_node": c.devices_per_node,
                    "devices": c.devices, "memory_bytes_per_device": c.memory_bytes(),
                    "peak_flops_per_device": c.flops(job.precision), "mfu": job.mfu or c.device.mfu},
        "job": {"seq": job.seq, "micro_batch": job.micro_batch, "grad_accum": job.grad_accum,
                "precision": job.precision, "optimizer": job.optimizer, "attention": job.attention,
                "rows": job.rows, "mean_tokens": job.mean_tokens, "tokens_per_row": job.tokens,
                "epochs": job.epochs, "headroom": job.headroom, "overlap": job.overlap,
                "training_flops_per_row": training_flops_per_sequence(job)},
        "strategies": out_strategies,
        "parameter_server": parameter_server(job),
        "recommendation": asdict(advice),
        "stages": [asdict(st) for st in around or []],
        "assumptions": ASSUMPTIONS,
    }
