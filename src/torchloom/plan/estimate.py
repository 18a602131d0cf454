"""Memory, communication, compute and time per device for each parallel strategy.

Sources of the formulas (docs/parallelism.md explains each):
- model states: ZeRO (Rajbhandari et al. 2020): mixed-precision Adam keeps 2 (16-bit params) + 2 (16-bit
  grads) + 12 (fp32 master, momentum, variance) = 16 bytes/param; ZeRO-1 4 + 12/N, ZeRO-2 2 + 14/N, ZeRO-3 16/N.
- activations: Korthikanti et al. 2022, sbh(34 + 5as/h) bytes per layer in 16-bit; the 5as/h term (stored
  attention scores) is absent with fused SDPA / flash attention, what transformers uses by default.
- FLOPs: 6 x (parameters that multiply each token) x tokens + 12 x layers x seq^2 x hidden per sequence.
- collectives: ring all-reduce moves 2(N-1)/N x S per device, all-gather and reduce-scatter (N-1)/N x S.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from torchloom.plan.hardware import Cluster
from torchloom.plan.models import ModelSpec, count_params

STRATEGIES = ("ddp", "ddp+ckpt", "zero1", "zero2", "zero3", "zero3+ckpt", "pipeline")
DESCRIPTIONS = {
    "ddp": "data parallel, full replica per device, gradients all-reduced",
    "ddp+ckpt": "DDP with activation checkpointing (recompute each layer in backward)",
    "zero1": "FSDP/ZeRO-1: optimizer states sharded",
    "zero2": "FSDP/ZeRO-2: optimizer states and gradients sharded",
    "zero3": "FSDP/ZeRO-3: optimizer states, gradients and parameters sharded",
    "zero3+ckpt": "ZeRO-3 with activation checkpointing",
    "pipeline": "pipeline parallel (1F1B), P stages x M micro-batches, DDP across pipelines",
}

DDP_BUCKET_BYTES = 25 * 2**20  # torch DDP's default bucket_cap_mb

# Optimizer-state bytes per parameter (ZeRO's K): fp32 master copy (mixed precision only) + moments.
OPTIMIZER_STATE_BYTES = {("adamw", True): 12, ("adamw", False): 8, ("sgd", True): 8, ("sgd", False): 4}
# Memory traffic of one update, bytes/param: fused kernels read p, g, moments and write p, moments once;
# foreach (CPU) runs ~8 elementwise kernels over them (lerp, mul, addcmul, sqrt, div, add, addcdiv, decay).
OPTIMIZER_TRAFFIC = {("adamw", True): 30, ("adamw", False): 80, ("sgd", True): 20, ("sgd", False): 40}


@dataclass(frozen=True)
class Job:
    model: ModelSpec
    cluster: Cluster
    seq: int
    micro_batch: int
    grad_accum: int = 1
    precision: str = "bf16"  # fp32 | bf16 | fp16 (the last two: mixed precision)
    optimizer: str = "adamw"
    attention: str = "sdpa"  # sdpa (fused, scores not stored) | eager (Korthikanti's 5as/h term)
    rows: int = 1_000_000
    mean_tokens: int = 0  # 0: every row fills the sequence
    epochs: int = 1
    pipeline_stages: int = 0  # 0: the fewest stages that fit
    pipeline_microbatches: int = 0  # 0: grad_accum x stages (the global batch of the other strategies)
    headroom: float = 0.9  # fraction of device memory usable (allocator, CUDA context, fragmentation)
    mfu: float = 0.0  # 0: the device's default
    overlap: bool = True  # False: communication never overlaps compute

    @property
    def mixed(self) -> bool:
        return self.precision != "fp32"

    @property
    def tokens(self) -> int:
        """Tokens a sequence costs in compute: rows are padded to their batch's longest (length bucketing)."""
        return min(self.mean_tokens, self.seq) if self.mean_tokens else self.seq


@dataclass
class Strategy:
    name: str
    description: str
    applicable: bool = True
    note: str = ""
    devices: int = 1
    # memory per device, bytes
    params_bytes: float = 0.0
    grads_bytes: float = 0.0
    optimizer_bytes: float = 0.0
    activations_bytes: float = 0.0
    buffers_bytes: float = 0.0  # gathered parameters / gradients of FSDP units in flight
    usable_bytes: float = 0.0
    max_micro_batch: int = 0  # the largest micro-batch whose activations still fit
    # one optimizer step, per device
    samples_per_step: int = 0
    flops_per_step: float = 0.0  # hardware FLOPs (recomputation included)
    compute_s: float = 0.0
    comm_bytes: float = 0.0  # sent per device (received is the same for ring collectives)
    comm_s: float = 0.0
    optimizer_s: float = 0.0
    step_s: float = 0.0
    collectives: list = field(default_factory=list)  # [{"op", "bytes", "seconds", "per_step"}]
    pipeline: dict = field(default_factory=dict)  # stages, microbatches, bubble
    # the whole run
    steps_per_epoch: int = 0
    epoch_s: float = 0.0
    total_s: float = 0.0

    @property
    def total_bytes(self) -> float:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes + self.activations_bytes + self.buffers_bytes

    @property
    def fits(self) -> bool:
        return self.applicable and self.total_bytes <= self.usable_bytes

    @property
    def samples_per_s(self) -> float:
        return self.samples_per_step / self.step_s if self.step_s else 0.0


# -- per-layer quantities -----------------------------------------------------------------------------


def activation_bytes_per_layer(job: Job, batch: int) -> float:
    """Korthikanti et al.: sbh(34 + 5as/h) in 16-bit for f = 4h; the 34 is 18 + 4f/h (gated MLPs store
    twice the f-wide tensors). fp32 doubles every tensor but the two 1-byte dropout masks."""
    m, s = job.model, job.seq
    coef = 17 + 8 * m.ffn / m.hidden if m.gated_mlp else 18 + 4 * m.ffn / m.hidden
    scores = 5 * m.heads * s / m.hidden  # 2-byte softmax output and dropout output, 1-byte mask: 5 per score
    if not job.mixed:
        coef, scores = 2 * coef - 2, 9 * m.heads * s / m.hidden
    if job.attention != "eager":
        scores = 0.0
    return s * batch * m.hidden * (coef + scores)


def activation_bytes(job: Job, batch: int, layers: int, checkpointed: bool) -> float:
    """Activations kept for backward: `layers` layers plus the embeddings' output."""
    m = job.model
    elem = 2 if job.mixed else 4
    sbh = job.seq * batch * m.hidden
    embeddings = sbh * (2 * elem + 1)  # output, its dropout mask, the first LayerNorm's input
    if checkpointed:  # each layer's input, plus one layer recomputed in full during backward
        return layers * sbh * elem + activation_bytes_per_layer(job, batch) + embeddings
    return layers * activation_bytes_per_layer(job, batch) + embeddings


def fsdp_buffer_bytes(job: Job) -> float:
    """ZeRO-3's unsharded working set: two units' parameters (the current one and the prefetched next)
    and one unit's gradients before their reduce-scatter; the largest unit is a layer or the embeddings."""
    pc = count_params(job.model)
    elem = 2 if job.mixed else 4
    return max(pc.per_layer, pc.embeddings) * 3 * elem


def training_flops_per_sequence(job: Job) -> float:
    """Model FLOPs of forward + backward for one sequence: 6 N t + 12 L t^2 h."""
    m, t = job.model, job.tokens
    return 6 * count_params(m).matmul * t + 12 * m.layers * t * t * m.hidden


# -- collectives --------------------------------------------------------------------------------------


def ring(cluster: Cluster, op: str, size: float, group: int, spans_nodes: bool, per_step: int = 1,
         calls: int = 1) -> dict:
    """A ring collective over `group` devices on `size` bytes in all, issued as `calls` pieces (buckets,
    FSDP units) that each pay the ring's latency, repeated per_step times."""
    if group <= 1:
        return {"op": op, "bytes": 0.0, "seconds": 0.0, "per_step": per_step}
    factor, hops = ((2 * (group - 1) / group, 2 * (group - 1)) if op == "all-reduce" else
        ((group - 1) / group, group - 1))
    sent = factor * size
    seconds = sent / cluster.collective_bw(spans_nodes) + calls * hops * cluster.latency(spans_nodes)
    return {"op": op, "bytes": sent * per_step, "seconds": seconds * per_step, "per_step": per_step}


def parameter_server(job: Job) -> dict:
    """DDP's gradient exchange through one parameter server instead of a ring, for comparison:
    each worker sends S and receives S; the server's link carries N x S each way (2NS in all)."""
    c, n = job.cluster, job.cluster.devices
    size = count_params(job.model).total * (2 if job.mixed else 4)
    bw = c.device.inter_bw_gbs * 1e9 if c.nodes > 1 else c.device.intra_bw_gbs * 1e9
    seconds = n * size / bw if n > 1 else 0.0  # full duplex: in and out at once, the server link is the bound
    ring_bytes = 2 * (n - 1) / n * size
    return {"gradient_bytes": size, "worker_bytes": 2 * size, "server_link_bytes": 2 * n * size,
            "seconds": seconds, "ring_bytes_per_device": ring_bytes,
            "ring_seconds": ring(c, "all-reduce", size, n, c.nodes > 1,
                                 calls=math.ceil(size / DDP_BUCKET_BYTES))["seconds"]}


# -- the strategies -----------------------------------------------------------------------------------


def device_rate(job: Job) -> float:
    """FLOP/s one device sustains in forward + backward."""
    return job.cluster.flops(job.precision) * (job.mfu or job.cluster.device.mfu)


def _overlap(job: Job, compute: float, comm: float, tail: float) -> float:
    """Compute with communication alongside; the last `tail` fraction of the communication (the final
    bucket or FSDP unit, issued when the compute ends) cannot hide. Without overlap, they add up."""
    if not (job.overlap and job.cluster.device.overlap):
        return compute + comm
    return max(compute, comm * (1 - tail)) + comm * tail


def _finish(job: Job, st: Strategy) -> Strategy:
    st.steps_per_epoch = math.ceil(job.rows / st.samples_per_step)
    st.epoch_s = st.steps_per_epoch * st.step_s
    st.total_s = st.epoch_s * job.epochs
    st.comm_bytes = sum(c["bytes"] for c in st.collectives)
    st.comm_s = sum(c["seconds"] for c in st.collectives)
    return st


def _max_micro_batch(st: Strategy, job: Job, activations_at: callable) -> int:
    """The largest micro-batch that fits, activations being linear in it."""
    static = st.params_bytes + st.grads_bytes + st.optimizer_bytes + st.buffers_bytes
    per_sample = activations_at(1)
    return max(0, int((st.usable_bytes - static) // per_sample)) if per_sample > 0 else 0


def data_parallel(job: Job, name: str) -> Strategy:
    """ddp, ddp+ckpt, zero1, zero2, zero3, zero3+ckpt: every device runs the whole model on its batch."""
    c, m, n, a, b = job.cluster, job.model, job.cluster.devices, job.grad_accum, job.micro_batch
    pc = count_params(m)
    psi = pc.total
    p, g = (2, 2) if job.mixed else (4, 4)
    k = OPTIMIZER_STATE_BYTES[(job.optimizer, job.mixed)]
    stage = 0 if name.startswith("ddp") else int(name[4])
    ckpt = name.endswith("+ckpt")
    st = Strategy(name, DESCRIPTIONS[name], devices=n, usable_bytes=c.memory_bytes() * job.headroom)
    st.params_bytes = psi * p / (n if stage >= 3 else 1)
    st.grads_bytes = psi * g / (n if stage >= 2 else 1)
    st.optimizer_bytes = psi * k / (n if stage >= 1 else 1)
    if stage == 3:
        st.buffers_bytes = fsdp_buffer_bytes(job) if n > 1 else 0.0
    st.activations_bytes = activation_bytes(job, b, m.layers, ckpt)
    st.max_micro_batch = _max_micro_batch(st, job, lambda bb: activation_bytes(job, bb, m.layers, ckpt))

    rate = device_rate(job)
    st.flops_per_step = a * b * training_flops_per_sequence(job) * (4 / 3 if ckpt else 1)
    st.compute_s = st.flops_per_step / rate
    micro = st.compute_s / a
    fwd = micro * (1 / 4 if ckpt else 1 / 3)  # backward is 2x forward; recomputation adds one forward
    bwd = micro - fwd
    spans = c.nodes > 1
    grad_bytes, param_bytes = psi * g, psi * p
    buckets = math.ceil(grad_bytes / DDP_BUCKET_BYTES)
    bucket = 1 / buckets  # share of the gradients in the last bucket
    units = m.layers + 1  # FSDP units: one per layer plus the root (embeddings, head)
    unit = 1 / units
    if stage == 0:
        ar = ring(c, "all-reduce", grad_bytes, n, spans, calls=buckets)
        st.collectives = [ar]
        # no_sync on all but the last micro-step: one all-reduce per step, hidden behind the last backward
        st.step_s = (a - 1) * micro + fwd + _overlap(job, bwd, ar["seconds"], bucket)
    elif stage in (1, 2):
        # Sharded parameters are gathered once per step, unit by unit during the first forward. ZeRO-1 keeps
        # whole gradients, so it reduce-scatters once per step; ZeRO-2 does it every micro-step.
        ag = ring(c, "all-gather", param_bytes, n, spans, calls=units)
        rs = ring(c, "reduce-scatter", grad_bytes, n, spans, per_step=a if stage == 2 else 1, calls=units)
        st.collectives = [ag, rs]
        rs_each = rs["seconds"] / rs["per_step"]
        st.step_s = _overlap(job, fwd, ag["seconds"], unit) + (a - 1) * fwd
        if stage == 1:
            st.step_s += (a - 1) * bwd + _overlap(job, bwd, rs_each, unit)
        else:
            st.step_s += a * _overlap(job, bwd, rs_each, unit)
    else:
        # Parameters are gathered unit by unit in forward and again in backward, every micro-step.
        ag = ring(c, "all-gather", param_bytes, n, spans, per_step=2 * a, calls=units)
        rs = ring(c, "reduce-scatter", grad_bytes, n, spans, per_step=a, calls=units)
        st.collectives = [ag, rs]
        ag_each, rs_each = ag["seconds"] / (2 * a), rs["seconds"] / a
        st.step_s = a * (_overlap(job, fwd, ag_each, unit) + _overlap(job, bwd, ag_each + rs_each, unit))
    st.optimizer_s = (psi / (n if stage >= 1 else 1) * OPTIMIZER_TRAFFIC[(job.optimizer, c.device.fused_optimizer)]
        / c.mem_bw())
    st.step_s += st.optimizer_s
    st.samples_per_step = b * a * n
    return _finish(job, st)


def _stage_params(job: Job, stages: int) -> float:
    pc = count_params(job.model)
    per_stage = math.ceil(job.model.layers / stages) * pc.per_layer
    return max(pc.embeddings + per_stage, per_stage + pc.head)


def pipeline(job: Job, stages: int) -> Strategy:
    """P stages of consecutive layers on consecutive devices; M micro-batches per step on a 1F1B schedule;
    N / P pipelines side by side, each stage's gradients all-reduced across them."""
    c, m, n, b = job.cluster, job.model, job.cluster.devices, job.micro_batch
    st = Strategy("pipeline", DESCRIPTIONS["pipeline"], devices=n, usable_bytes=c.memory_bytes() * job.headroom)
    # By default each pipeline takes A x P micro-batches per step: the same global batch as the other strategies.
    micro_batches = job.pipeline_microbatches or job.grad_accum * stages
    replicas = n // stages
    psi = _stage_params(job, stages)
    p, g = (2, 2) if job.mixed else (4, 4)
    k = OPTIMIZER_STATE_BYTES[(job.optimizer, job.mixed)]
    st.params_bytes, st.grads_bytes, st.optimizer_bytes = psi * p, psi * g, psi * k
    layers = math.ceil(m.layers / stages)
    in_flight = min(stages, micro_batches)  # 1F1B: the first stage holds P micro-batches' activations
    st.activations_bytes = in_flight * activation_bytes(job, b, layers, checkpointed=False)
    st.max_micro_batch = _max_micro_batch(
        st, job, lambda bb: in_flight * activation_bytes(job, bb, layers, checkpointed=False))

    rate = device_rate(job)
    flops_micro = b * training_flops_per_sequence(job) * layers / m.layers  # the busiest stage
    st.flops_per_step = micro_batches * flops_micro
    st.compute_s = st.flops_per_step / rate
    crosses = stages > c.devices_per_node
    elem = 2 if job.mixed else 4
    boundary = b * job.seq * m.hidden * elem  # one micro-batch's activations (and their gradient)
    p2p_s = boundary / c.p2p_bw(crosses) + c.latency(crosses)
    p2p = {"op": "send/recv activations", "bytes": 2 * micro_batches * boundary,
           "seconds": 2 * micro_batches * p2p_s, "per_step": 2 * micro_batches}
    ar = ring(c, "all-reduce", psi * g, replicas, c.nodes > 1, calls=math.ceil(psi * g / DDP_BUCKET_BYTES))
    st.collectives = [p2p, ar]
    slot = flops_micro / rate + 2 * p2p_s  # sends sit on the critical path between stages
    bubble = (stages - 1) / (micro_batches + stages - 1)
    st.optimizer_s = psi * OPTIMIZER_TRAFFIC[(job.optimizer, c.device.fused_optimizer)] / c.mem_bw()
    st.step_s = (micro_batches + stages - 1) * slot + ar["seconds"] + st.optimizer_s
    st.samples_per_step = b * micro_batches * replicas
    st.pipeline = {"stages": stages, "microbatches": micro_batches, "replicas": replicas,
                   "layers_per_stage": layers, "bubble": bubble}
    return _finish(job, st)


def pipeline_stages(job: Job) -> list[int]:
    """Stage counts that divide the devices and the layers allow, fewest first."""
    n, layers = job.cluster.devices, job.model.layers
    if job.pipeline_stages:
        return [job.pipeline_stages]
    return [s for s in range(2, min(n, layers) + 1) if n % s == 0]


def estimate(job: Job) -> list[Strategy]:
    """Every strategy in STRATEGIES for this job (those that need several devices marked n/a on one)."""
    n = job.cluster.devices
    out = []
    for name in STRATEGIES[:-1]:
        if n == 1 and name.startswith("zero"):
            out.append(Strategy(name, DESCRIPTIONS[name], applicable=False,
                                note="one device: nothing to shard (same as ddp)"))
        else:
            out.append(data_parallel(job, name))
    candidates = pipeline_stages(job)
    if n < 2 or not candidates:
        out.append(Strategy("pipeline", DESCRIPTIONS["pipeline"], applicable=False,
                            note="needs at least 2 devices and a stage count that divides them"))
    elif n % candidates[0] or candidates[0] > job.model.layers:
        out.append(Strategy("pipeline", DESCRIPTIONS["pipeline"], applicable=False,
                            note=f"{candidates[0]} stages must divide the {n} devices and be at most"
                                 f" {job.model.layers} (the layers)"))
    else:
        plans = [pipeline(job, s) for s in candidates]
        out.append(next((p for p in plans if p.fits), plans[-1]))
    return out
