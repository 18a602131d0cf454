"""A tiny random-initialised BERT with the embedded MiniLM's tokenizer, for fast tests and benchmarks."""

from __future__ import annotations

import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")


def write_tiny_model(out_dir: str | Path, tokenizer_from: str | None = None, hidden: int = 32,
                     layers: int = 2, heads: int = 2, seed: int = 0, dropout: float = 0.1,
                     intermediate: int = 0) -> str:
    """Write a tiny BERT (random weights) plus tokenizer files to `out_dir`; returns the path.

    intermediate: the feed-forward width (0: twice `hidden`; BERT's own is four times). Any size can be written:
    benchmarks/gpu.py writes a BERT-base-sized one (12 layers, 768 hidden, 12 heads, 3072)."""
    import torch
    from transformers import BertConfig, BertModel

    from torchloom.embedded import model_path

    src = Path(model_path(tokenizer_from or ""))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab_size = sum(1 for _ in open(src / "vocab.txt", encoding="utf-8"))
    config = BertConfig(
        vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        intermediate_size=intermediate or hidden * 2, max_position_embeddings=512,
        hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
    )
    torch.manual_seed(seed)
    BertModel(config).save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, out / name)
    return str(out)
