"""The one place that applies parallelism to the model; the loop never calls DDP, FSDP or pipelining itself.

In this order:
  1. activation checkpointing (train.activation_checkpointing): each transformer layer's forward runs
     under torch.utils.checkpoint (non-reentrant), so backward recomputes the layer instead of keeping
     its activations. It wraps the layer's own forward, inside the module's hooks: FSDP's all-gather
     hooks stay outside the recomputed region, and the weights keep their names.
  2. torch.compile (train.compile) of each transformer layer, in place, as torchtitan does: the layers share one
     code object, so one graph serves them all; embeddings and head stay eager. Layer by layer, DDP still
     all-reduces a layer's gradients while backward goes on. In place (Module.compile), so the weights keep their
     names. With ddp only: FSDP's hooks would run inside the compiled region (config/load.py refuses the rest).
  3. the strategy (train.strategy):
     ddp       DistributedDataParallel: every rank holds the whole model; gradients are all-reduced.
     fsdp      FSDP2 `fully_shard` on each transformer layer, then on the root (ZeRO-3): a rank keeps
               1/N of the parameters, gradients and optimizer states; a layer's parameters are
               all-gathered just before it runs and freed after, its gradients reduce-scattered.
     pipeline  one stage of consecutive layers per rank (train/pipeline_parallel.py).

Mixed precision is the loop's autocast for every strategy, not FSDP's MixedPrecisionPolicy: parameters,
gradients and their reduce-scatter stay fp32, exactly as under DDP, so fsdp computes what ddp computes
(MixedPrecisionPolicy(param_dtype=bf16) would halve the all-gather bytes, at DDP-different numerics).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass

import torch
from torch.nn.parallel import DistributedDataParallel

from torchloom.config.schema import TrainConfig
from torchloom.errors import UserError
from torchloom.model.packing import check_packing
from torchloom.train.distributed import Dist
from torchloom.train.pipeline_parallel import Pipeline

# Where Hugging Face encoders keep their list of transformer layers, under model.base_model.
LAYER_PATHS = ("encoder.layer", "transformer.layer", "encoder.layers", "layers")


@dataclass
class Parallel:
    """The model as parallelize() left it, and the few things that differ per strategy in a step."""

    strategy: str
    model: torch.nn.Module  # this rank's parameters under their Hugging Face names: optimizer, clipping, checkpoints
    module: torch.nn.Module  # what the loop runs forward on: the DDP wrapper or the (sharded) model
    dp_rank: int  # this rank among the data-parallel replicas, which read different batches
    dp_size: int
    sharded: bool  # checkpoints are torch.distributed.checkpoint directories, each rank writing its shard
    pipeline: Pipeline | None = None

    @property
    def eval_in_lockstep(self) -> bool:
        """Every forward is a collective (FSDP all-gathers), so all ranks must run as many."""
        return self.strategy == "fsdp" and self.sharded

    def grad_sync(self, sync: bool) -> AbstractContextManager:
        """Around one micro-step: sync=False accumulates gradients locally, without communicating."""
        if sync:
            return nullcontext()
        if isinstance(self.module, DistributedDataParallel):
            return self.module.no_sync()
        if self.eval_in_lockstep:
            return _no_gradient_sync(self.module)
        return nullcontext()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale the gradients to a global norm of at most max_norm; returns the norm before."""
        params = list(self.model.parameters())
        if self.pipeline is not None:
            return self.pipeline.clip_grad_norm_(params, max_norm)
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        # Sharded gradients are DTensors; their norm is one too, the same number on every rank.
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor | None:
        """Forward for evaluation; None on the pipeline stages before the last."""
        if self.pipeline is not None:
            return self.pipeline.logits(input_ids, attention_mask)
        # The model, not the DDP wrapper, whose forward would broadcast buffers: ranks' shares may differ.
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits


@contextmanager
def _no_gradient_sync(model) -> Iterator[None]:
    # FSDP2's counterpart of DDP's no_sync(): keep unsharded gradients, reduce-scatter on the last micro-step.
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def transformer_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    base = getattr(model, "base_model", model)
    for path in LAYER_PATHS:
        found = base
        for name in path.split("."):
            found = getattr(found, name, None)
        if isinstance(found, torch.nn.ModuleList) and len(found):
            return found
    raise UserError(f"model {type(model).__name__}: no list of transformer layers at {', '.join(LAYER_PATHS)};"
                    " train.strategy fsdp and pipeline and train.activation_checkpointing need one; use ddp")


def checkpoint_layers(model: torch.nn.Module) -> None:
    """Recompute each transformer layer in backward instead of keeping its activations."""
    for layer in transformer_layers(model):
        # The bound forward, not the module: hooks (FSDP's unshard) run once, outside the recomputation.
        # Non-reentrant checkpointing restores the RNG and autocast state, so dropout draws the same masks.
        layer.forward = functools.partial(torch.utils.checkpoint.checkpoint, layer.forward, use_reentrant=False)


# Widths of training batches under train.compile: a few shapes to compile, aligned for tensor cores.
COMPILE_PAD = 16
# The compiler backend; tests set aot_eager (dynamo and AOTAutograd without code generation), which is seconds.
COMPILE_BACKEND_ENV = "TORCHLOOM_COMPILE_BACKEND"


def compile_layers(model: torch.nn.Module) -> None:
    for layer in transformer_layers(model):
        layer.compile(backend=os.environ.get(COMPILE_BACKEND_ENV, "inductor"))


def compiled_graphs() -> int:
    """Graphs torch.compile has made in this process so far (a recompile for a new shape adds one)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def parallelize(model: torch.nn.Module, d: Dist, tc: TrainConfig, manifest_max_length: int | None = None,
                loss_weights: torch.Tensor | None = None) -> Parallel:
    """Apply train.activation_checkpointing and train.strategy to `model`, in place.

    manifest_max_length: tokens per row after prepare; pipeline stages pad every batch to it.
    loss_weights: class weights of the loss, which a pipeline's last stage computes.
    """
    if tc.packing:  # before anything wraps it: packed batches run BERT-family models only (model/packing.py)
        check_packing(model)
    model.to(d.device)
    if tc.activation_checkpointing:
        checkpoint_layers(model)
    if tc.compile:
        compile_layers(model)
    if tc.strategy == "pipeline":
        stages = tc.pipeline_stages or d.world_size
        if stages != d.world_size or stages < 2:
            raise UserError(f"train.pipeline_stages {stages}: must equal the number of workers ({d.world_size})"
                            " and be at least 2; set train.pipeline_stages and engine.workers to the same number")
        pipeline = Pipeline(model, d, tc.microbatches, tc.precision, manifest_max_length, loss_weights)
        return Parallel("pipeline", model, pipeline.stage_module, 0, 1, sharded=True, pipeline=pipeline)
    if tc.strategy not in ("ddp", "fsdp"):
        raise ValueError(f"unknown strategy {tc.strategy!r}")
    if not d.enabled:
        return Parallel(tc.strategy, model, model, 0, 1, sharded=False)
    if tc.strategy == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        # On this worker's device type: torch's default mesh would be cuda on a GPU machine told to use the CPU.
        mesh = init_device_mesh(d.device.type, (d.world_size,))
        # Layers first, then the root (embeddings, pooler, head): each layer is one all-gather unit.
        for layer in transformer_layers(model):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return Parallel("fsdp", model, model, d.rank, d.world_size, sharded=True)
    ddp = DistributedDataParallel(
        model,
        device_ids=[d.device.index] if d.device.type == "cuda" else None,
        # Gradients live in the all-reduce buckets: one copy fewer of every gradient.
        gradient_as_bucket_view=True,
    )
    return Parallel("ddp", model, ddp, d.rank, d.world_size, sharded=False)
