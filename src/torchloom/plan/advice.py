"""Which strategy and which engine, and why."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from torchloom.plan.estimate import (
    OPTIMIZER_STATE_BYTES,
    STRATEGIES,
    Job,
    Strategy,
    activation_bytes,
    fsdp_buffer_bytes,
)
from torchloom.plan.models import count_params

GIB = 2**30
# A simpler strategy wins unless a more complex one is more than 10% faster: the estimates carry tens of
# percent of error, and sharding has costs this arithmetic leaves out (per-unit launches, buffer copies).
SIMPLER_WITHIN = 1.10


# How torchloom runs each strategy; ZeRO-1/2 have no switch of their own.
RUN_WITH = {
    "ddp": "--train.strategy ddp",
    "ddp+ckpt": "--train.strategy ddp --train.activation_checkpointing true",
    "zero3": "--train.strategy fsdp",
    "zero3+ckpt": "--train.strategy fsdp --train.activation_checkpointing true",
    "pipeline": "--train.strategy pipeline",
}


@dataclass
class Site:
    """What the user already runs: steers the engine advice."""

    have_spark: bool = False
    have_ray: bool = False
    tuning: bool = False  # many trainings (hyper-parameter search)
    serving: bool = False  # the model will be served online


@dataclass
class Advice:
    strategy: str | None  # None: nothing fits
    engine: str
    reasons: list[str] = field(default_factory=list)
    engine_reasons: list[str] = field(default_factory=list)


def gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def model_state_bytes(job: Job) -> float:
    """Parameters, gradients and optimizer states of the whole model (ZeRO's (2 + 2 + K) x params)."""
    per_param = (4 if job.mixed else 8) + OPTIMIZER_STATE_BYTES[(job.optimizer, job.mixed)]
    return count_params(job.model).total * per_param


def devices_for_zero3(job: Job) -> int | None:
    """The fewest devices on which ZeRO-3 with checkpointing holds this model, or None (activations too big)."""
    usable = job.cluster.memory_bytes() * job.headroom
    room = usable - activation_bytes(job, job.micro_batch, job.model.layers, checkpointed=True)
    room -= fsdp_buffer_bytes(job)
    return math.ceil(model_state_bytes(job) / room) if room > 0 else None


def choose(job: Job, strategies: list[Strategy]) -> tuple[Strategy | None, list[str]]:
    by_name = {s.name: s for s in strategies}
    fitting = [s for s in strategies if s.fits]
    psi = count_params(job.model).total
    usable = job.cluster.memory_bytes() * job.headroom
    if not fitting:
        smallest = min((s for s in strategies if s.applicable), key=lambda s: s.total_bytes)
        reasons = [f"nothing fits in {gib(usable)} usable per device; the smallest is {smallest.name} at"
                   f" {gib(smallest.total_bytes)}"]
        need = devices_for_zero3(job)
        if need:
            reasons.append(f"zero3+ckpt fits on about {need} devices of this kind (model states"
                           f" {gib(model_state_bytes(job))} in all, split {need} ways)")
        reasons.append("or lower --micro-batch / --seq, or pick a device with more memory")
        return None, reasons
    fastest = min(fitting, key=lambda s: s.total_s)
    pick = next(s for s in sorted(fitting, key=lambda s: STRATEGIES.index(s.name))
                if s.total_s <= fastest.total_s * SIMPLER_WITHIN)
    share = pick.total_bytes / usable
    reasons = [f"{pick.name} needs {gib(pick.total_bytes)} per device of {gib(usable)} usable ({share:.0%})"]
    if pick is fastest:
        reasons.append("fastest of the strategies that fit")
    else:
        reasons.append(f"within {SIMPLER_WITHIN - 1:.0%} of the fastest ({fastest.name}) and simpler to run")
    ddp = by_name["ddp"]
    if not ddp.fits:
        states = ddp.params_bytes + ddp.grads_bytes + ddp.optimizer_bytes
        reasons.append(f"ddp does not fit: {gib(ddp.total_bytes)} per device (model states alone {gib(states)}:"
                       f" {states / psi:.0f} bytes x {psi / 1e6:,.0f} M params)")
    exposed = pick.step_s - pick.compute_s - pick.optimizer_s
    if pick.comm_s > 0 and exposed > 0.25 * pick.step_s:
        reasons.append(f"communication is not hidden ({exposed:.3g} s of a {pick.step_s:.3g} s step):"
                       " raise --grad-accum or --micro-batch to send less per sample, or use faster links")
    gpu = not job.cluster.device.shared_host  # a CPU is busy at small batches already
    if gpu and pick.max_micro_batch >= 2 * job.micro_batch and pick.name != "pipeline":
        reasons.append(f"memory allows micro-batch up to {pick.max_micro_batch}: a larger one uses the device"
                       " better and all-reduces less often per sample")
    if pick.name == "pipeline":
        pp = pick.pipeline
        reasons.append(f"in torchloom: torchloom train {RUN_WITH['pipeline']} --train.pipeline_stages {pp['stages']}"
                       f" --train.microbatches {pp['microbatches']} --engine.workers {pp['stages']}")
        if pp["replicas"] > 1:
            reasons.append(f"this estimate runs {pp['replicas']} pipelines side by side (data x pipeline parallel);"
                           f" torchloom runs one, on {pp['stages']} workers")
    elif pick.name in RUN_WITH:
        reasons.append(f"in torchloom: torchloom train {RUN_WITH[pick.name]}")
    else:
        zero3 = by_name["zero3"]
        reasons.append(f"torchloom shards as zero3 (--train.strategy fsdp), {zero3.total_s / pick.total_s - 1:.0%}"
                       " slower here; DeepSpeed runs ZeRO stages 1 and 2 as such")
    if pick.name == "pipeline":
        reasons.append(f"pipeline bubble {pp['bubble']:.0%} with P={pp['stages']}, M={pp['microbatches']}:"
                       " more micro-batches shrink it")
    return pick, reasons


def engine(job: Job, site: Site) -> tuple[str, list[str]]:
    """local (torchrun), spark (TorchDistributor) or ray (Ray Train), with the reason."""
    multi_node = job.cluster.nodes > 1
    if site.tuning or site.serving:
        why = [("heavy tuning: Ray Tune runs many trials of the same training entry and stops bad ones early"
                if site.tuning else "serving: Ray Serve deploys the exported model with autoscaling"),
               "one Ray cluster then trains, tunes and serves"]
        if site.have_spark and not site.have_ray:
            why.append("Ray can run on the Spark cluster's machines (ray.util.spark), next to the data")
        return "ray", why
    if site.have_spark:
        return "spark", ["an existing Spark cluster with its ETL: TorchDistributor trains on the executors next"
                         " to the prepared Parquet, no copy and no second cluster to run"]
    if site.have_ray:
        return "ray", ["an existing Ray cluster: Ray Train schedules the workers and restarts failed ones"]
    if multi_node:
        return "local", [f"raw multi-node throughput: torchrun on each of the {job.cluster.nodes} nodes"
                         " (torchloom's local engine), nothing between the workers and the network"]
    n = job.cluster.devices
    return "local", [f"one machine: torchloom's local engine (torchrun) starts {n} worker{'s' if n > 1 else ''}"]


def advise(job: Job, strategies: list[Strategy], site: Site) -> Advice:
    pick, reasons = choose(job, strategies)
    name, engine_reasons = engine(job, site)
    return Advice(pick.name if pick else None, name, reasons, engine_reasons)
