"""Padding-free forwards of BERT-family classifiers on packed batches (data/packing.py's layout).

The model runs on the packed rows with position ids that restart per sequence and an attention mask that keeps
each sequence to itself: block-diagonal, built on the device from `sequence_ids` ([R, 1, L, L], boolean for
SDPA, additive for the eager kernel). The padding at a row's end forms a block of its own, so no query row is
fully masked (SDPA gives NaN there, which would spread) and no real token sees it. The model's own pooler and
classifier then run on each sequence's [CLS] hidden state, gathered in a forward pre-hook on the pooler, so the
logits come back [B, classes] in the batch's order through the model's (or the DDP/FSDP wrapper's) own forward:
gradient hooks, activation checkpointing and autocast see an ordinary forward.

The mask costs R * L^2 of attention (as a padded batch's B * L^2 does, with R <= B), computed by SDPA's kernels
on any device; a varlen kernel (flash-attention with cumulative sequence lengths) would skip the masked blocks,
but is not wired here: it exists only on CUDA with the flash-attn package, where this code has not been run.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from torchloom.errors import UserError

# Model types whose classifier reads the pooler's [CLS] state and whose embeddings take position_ids as given
# (MiniLM, BERT, and their fine-tunes are "bert").
PACKED_MODEL_TYPES = ("bert",)
# Attention kernels that take a 4D mask as given.
PACKED_ATTENTION = ("sdpa", "eager")


def packing_refusal(model: torch.nn.Module) -> str | None:
    """Why train.packing cannot run `model` (one line), or None where it can."""
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", type(model).__name__)
    if kind not in PACKED_MODEL_TYPES or getattr(getattr(model, "base_model", None), "pooler", None) is None:
        return (f"train.packing: model {type(model).__name__} (model_type {kind}) is not supported; packing covers"
                f" BERT-family classifiers ({', '.join(PACKED_MODEL_TYPES)}) with a pooler; set train.packing false")
    attention = getattr(config, "_attn_implementation", None) or "eager"
    if attention not in PACKED_ATTENTION:
        return (f"train.packing: the model's attention kernel {attention!r} takes no block-diagonal mask; packing"
                f" runs with {' or '.join(PACKED_ATTENTION)}; set train.packing false")
    return None


def check_packing(model: torch.nn.Module) -> None:
    """Refuse, in one line, a model that packed batches cannot run."""
    refusal = packing_refusal(model)
    if refusal:
        raise UserError(refusal)


def block_mask(sequence_ids: torch.Tensor, attention: str, dtype: torch.dtype) -> torch.Tensor:
    """[R, 1, L, L]: token q may attend to token k when both lie in the same sequence (or both in the padding)."""
    same = (sequence_ids[:, None, :, None] == sequence_ids[:, None, None, :])
    if attention == "sdpa":
        return same
    # The eager kernel adds the mask to the scores.
    return torch.zeros(same.shape, dtype=dtype, device=same.device).masked_fill_(~same, torch.finfo(dtype).min)


@contextmanager
def class_tokens(pooler: torch.nn.Module, cls_index: torch.Tensor) -> Iterator[None]:
    """While open, the pooler sees each sequence's first token ([B, 1, H]) instead of the packed rows' states."""
    def gather(_module: torch.nn.Module, args: tuple) -> tuple:
        hidden = args[0]
        return (hidden.reshape(-1, hidden.shape[-1]).index_select(0, cls_index).unsqueeze(1), *args[1:])

    handle = pooler.register_forward_pre_hook(gather)
    try:
        yield
    finally:
        handle.remove()


def packed_logits(module: torch.nn.Module, model: torch.nn.Module, batch: dict, device: torch.device
                  ) -> torch.Tensor:
    """[B, classes] logits of a packed batch. module: what to call (the model, or its DDP/FSDP wrapper); model:
    the Hugging Face model under it, whose pooler gathers the [CLS] states."""
    attention = getattr(model.config, "_attn_implementation", None) or "eager"
    sequence_ids = batch["sequence_ids"].to(device, non_blocking=True)
    mask = block_mask(sequence_ids, attention, next(model.parameters()).dtype)
    with class_tokens(model.base_model.pooler, batch["cls_index"].to(device, non_blocking=True)):
        return module(input_ids=batch["input_ids"].to(device, non_blocking=True), attention_mask=mask,
                      position_ids=batch["position_ids"].to(device, non_blocking=True)).logits
