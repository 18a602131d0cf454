"""Pipeline parallelism for BERT-style classifiers: one stage per rank, torch.distributed.pipelining's GPipe.

Stage 0 runs the embeddings and the first layers, the last stage the remaining layers, the pooler and
the classifier, the stages between only layers. Each rank removes the other stages' modules from its
model, so its optimizer and its checkpoint shard hold only its own parameters, under their Hugging
Face names. Every stage reads the same batches (the pipeline is the only data-parallel replica); a
micro-step's batch is cut into train.microbatches micro-batches that flow through the stages, and the
last stage computes the loss.

torch's stages exchange buffers whose shapes are fixed at the first step, so every training batch is
padded to one shape: rows to the micro-step's batch size (copies of its first row, labelled -100, which
the loss ignores) and tokens to the prepared max_length (masked out, as any padding is).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from torchloom.errors import UserError
from torchloom.model.device import autocast
from torchloom.train.distributed import Dist

IGNORE_INDEX = -100  # the label of padding rows


def stage_layers(num_layers: int, stages: int, stage: int) -> range:
    """The layers of `stage`: consecutive, the first stages take one more when they do not divide evenly."""
    per, extra = divmod(num_layers, stages)
    start = stage * per + min(stage, extra)
    return range(start, start + per + (stage < extra))


class StageModule(torch.nn.Module):
    """One stage's forward: (input_ids or hidden states, attention_mask) -> hidden states, or logits on the last."""

    def __init__(self, model: torch.nn.Module, layers: range, first: bool, last: bool, precision: str,
                 device: torch.device):
        super().__init__()
        base = model.base_model
        self.config, self.first, self.last, self.precision, self.device = (
            model.config, first, last, precision, device)
        self.embeddings = base.embeddings if first else None
        self.layers = torch.nn.ModuleList(base.encoder.layer[i] for i in layers)
        if last:
            self.pooler, self.dropout, self.classifier = base.pooler, model.dropout, model.classifier

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_bidirectional_mask

        # Autocast here rather than around the schedule: it then covers the forward only, as in DDP.
        with autocast(self.device, self.precision):
            hidden = self.embeddings(input_ids=x) if self.first else x
            # What BertModel.forward builds from the 2-D mask; every stage builds its own.
            mask = create_bidirectional_mask(config=self.config, inputs_embeds=hidden, attention_mask=attention_mask)
            for layer in self.layers:
                hidden = layer(hidden, mask)
            if self.last:
                return self.classifier(self.dropout(self.pooler(hidden)))
            return hidden


def split_model(model: torch.nn.Module, stage: int, stages: int, precision: str, device: torch.device) -> StageModule:
    """This stage's part of `model`; the other stages' modules are replaced in `model` by empty ones."""
    base = getattr(model, "base_model", None)
    layers = getattr(getattr(base, "encoder", None), "layer", None)
    needed = (getattr(base, "embeddings", None), layers, getattr(base, "pooler", None),
              getattr(model, "dropout", None), getattr(model, "classifier", None))
    if any(m is None for m in needed) or getattr(model.config, "is_decoder", False):
        raise UserError(f"train.strategy pipeline: splits BERT-style classifiers (embeddings, encoder.layer,"
                        f" pooler, classifier); {type(model).__name__} is not one; use train.strategy fsdp or ddp")
    if len(layers) < stages:
        raise UserError(f"train.pipeline_stages {stages}: the model has only {len(layers)} layers;"
                        " use as many stages as layers at most")
    mine = stage_layers(len(layers), stages, stage)
    first, last = stage == 0, stage == stages - 1
    module = StageModule(model, mine, first, last, precision, device)
    for i in range(len(layers)):
        if i not in mine:
            layers[i] = torch.nn.Identity()
    if not first:
        base.embeddings = torch.nn.Identity()
    if not last:
        base.pooler, model.classifier = torch.nn.Identity(), torch.nn.Identity()
    return module


class Pipeline:
    """This rank's stage and the GPipe schedule that runs it, one call per micro-step."""

    def __init__(self, model: torch.nn.Module, d: Dist, microbatches: int, precision: str, max_length: int | None,
                 loss_weights: torch.Tensor | None):
        from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

        self.d, self.microbatches = d, microbatches
        self.stage, self.stages = d.rank, d.world_size
        self.first, self.last = self.stage == 0, self.stage == self.stages - 1
        self.hidden_size = model.config.hidden_size
        self.pad_id = model.config.pad_token_id or 0
        self.max_length = max_length or model.config.max_position_embeddings
        self.loss_weights = loss_weights
        self.stage_module = split_model(model, self.stage, self.stages, precision, d.device)
        self.schedule = ScheduleGPipe(
            PipelineStage(self.stage_module, self.stage, self.stages, d.device),
            n_microbatches=microbatches, loss_fn=self._loss,
            scale_grads=False,  # the loss is already normalised by the rows of the whole step
        )
        self._scale = 1.0  # the current step's loss scale (the schedule's loss_fn takes no extra argument)

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        summed = F.cross_entropy(logits.float(), labels, weight=self.loss_weights, reduction="sum",
                                 ignore_index=IGNORE_INDEX)
        return summed * self._scale

    def pad(self, batch: dict, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """input_ids, attention_mask and labels of `batch` padded to [rows, max_length]."""
        ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
        extra_rows, extra_tokens = rows - ids.shape[0], self.max_length - ids.shape[1]
        if extra_tokens < 0:
            raise UserError(f"a batch of {ids.shape[1]} tokens is longer than the prepared max_length"
                            f" {self.max_length}; prepare the data again")
        ids = F.pad(ids, (0, extra_tokens), value=self.pad_id)
        mask = F.pad(mask, (0, extra_tokens), value=0)
        if extra_rows:
            ids = torch.cat([ids, ids[:1].expand(extra_rows, -1)])
            mask = torch.cat([mask, mask[:1].expand(extra_rows, -1)])
            labels = torch.cat([labels, labels.new_full((extra_rows,), IGNORE_INDEX)])
        to = self.d.device
        return ids.to(to, non_blocking=True), mask.to(to, non_blocking=True), labels.to(to, non_blocking=True)

    def step(self, batch: dict, rows: int, loss_scale: float) -> torch.Tensor:
        """Forward and backward of one micro-step's batch; its summed loss on the last stage, 0 elsewhere.

        rows: the micro-step's batch size (the loader's), which every batch is padded to.
        loss_scale: what the summed loss is multiplied by before backward.
        """
        if rows % self.microbatches:
            raise UserError(f"train.microbatches {self.microbatches}: must divide the rows of a micro-step ({rows});"
                            " choose train.batch_size / train.grad_accum as a multiple of it")
        ids, mask, labels = self.pad(batch, rows)
        self._scale = loss_scale
        args = (ids,) if self.first else ()
        target = labels if self.last else None
        losses: list[torch.Tensor] = []  # the micro-batches' scaled losses, on the last stage
        self.schedule.step(*args, target=target, losses=losses, attention_mask=mask, return_outputs=False)
        if not losses:
            return torch.zeros((), device=self.d.device)
        return torch.stack(losses).detach().sum() / loss_scale

    def clip_grad_norm_(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        grads = [p.grad for p in params if p.grad is not None]
        squared = torch.nn.utils.get_total_norm(grads).pow(2)
        dist.all_reduce(squared)  # the model's norm: the stages' squares add up
        total = squared.sqrt()
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total

    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor | None:
        """Evaluation forward through the stages, every rank with the same batch; logits on the last stage.

        Not through the schedule, whose buffers are fixed to the training shape: every stage has the
        batch, so it knows the shape of the hidden states it receives.
        """
        device = self.d.device
        if self.first:
            x = input_ids.to(device)
        else:
            x = torch.empty(*input_ids.shape, self.hidden_size, dtype=torch.float32, device=device)
            dist.recv(x, src=self.stage - 1)
        out = self.stage_module(x, attention_mask.to(device))
        if self.last:
            return out
        dist.send(out.float().contiguous(), dst=self.stage + 1)
        return None
