"""prepare's length choice: max_length (the configured one, or auto from a sample's token counts) within
the model's positions, and the token lengths the manifest records."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from torchloom.config.schema import PrepareConfig
from torchloom.etl.tokenize import tokenizer_info
from torchloom.text.truncation import default_stride

LENGTH_SAMPLE = 2000
AUTO_LENGTHS = (128, 256, 512)
CUT_NOTES = {"head": " (cut: the model reads their start only)",
             "head_tail": " (cut: the model reads their start and end)",
             "chunks": " (each read as overlapping windows)"}


def choose_length(p: PrepareConfig, model_dir: str, tokenizer_json: str, kept, rows: int,
                  say: Callable[[str], object]) -> dict:
    """The tokenizer's record for the manifest, with max_length (p.max_length, or auto from the token counts
    of a sample of `kept`, a DataFrame of `rows` rows with a text column) and the sample's lengths."""
    sample = token_counts(kept, rows, tokenizer_json, p.seed)
    positions = model_positions(model_dir)
    max_length = choose_max_length(sample, positions) if p.max_length == "auto" else int(p.max_length)
    stride = min(p.stride or default_stride(max_length), max_length - 2) if p.truncation == "chunks" else 0
    info = tokenizer_info(model_dir, tokenizer_json, max_length, p.truncation, stride, p.max_chunks)
    info["lengths"] = lengths = length_stats(sample, max_length)
    if p.max_length == "auto":
        say(f"max_length auto: {max_length}, the shortest of {'/'.join(map(str, AUTO_LENGTHS))} that holds the"
            f" 90th percentile ({lengths['p90']} tokens)" + (f", within the model's {positions} positions"
                                                            if positions and lengths["p90"] > max_length else ""))
    say(f"token lengths (a sample of {lengths['sample']} rows): p50 {lengths['p50']}, p90 {lengths['p90']},"
        f" p99 {lengths['p99']}; {lengths['truncated_share']:.0%} longer than max_length {max_length}"
        + (CUT_NOTES[p.truncation] if lengths["truncated_share"] >= 0.2 else ""))
    return info


def token_counts(kept, rows: int, tokenizer_json: str, seed: int):
    """Token counts (special tokens included, nothing cut) of a seeded sample of up to LENGTH_SAMPLE kept
    rows, tokenized on the driver."""
    import numpy as np
    from tokenizers import Tokenizer

    fraction = min(1.0, 1.2 * LENGTH_SAMPLE / max(1, rows))
    texts = kept.select("text").sample(fraction=fraction, seed=seed).limit(LENGTH_SAMPLE).toArrow()
    texts = texts.column("text").to_pylist()
    if not texts:
        return np.zeros(0, np.int64)
    tok = Tokenizer.from_str(tokenizer_json)
    tok.no_truncation()
    tok.no_padding()
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    return np.array([len(e.ids) for e in encode(texts, add_special_tokens=True)])


def length_stats(counts, max_length: int) -> dict:
    """Percentiles of the sampled token counts and the share longer than max_length."""
    import numpy as np

    if not len(counts):
        return {"sample": 0, "p50": 0, "p90": 0, "p99": 0, "truncated_share": 0.0}
    p50, p90, p99 = (int(np.percentile(counts, q)) for q in (50, 90, 99))
    return {"sample": len(counts), "p50": p50, "p90": p90, "p99": p99,
            "truncated_share": round(float(np.mean(counts > max_length)), 4)}


def choose_max_length(counts, positions: int) -> int:
    """prepare.max_length auto: the shortest of AUTO_LENGTHS that holds the 90th percentile of the token
    counts, within the model's positions (the longest then, or the model's limit if shorter than all)."""
    import numpy as np

    p90 = int(np.percentile(counts, 90)) if len(counts) else 0
    allowed = [n for n in AUTO_LENGTHS if not positions or n <= positions] or [positions]
    return next((n for n in allowed if n >= p90), allowed[-1])


def model_positions(model_dir: str) -> int:
    """Tokens the model can read at once (0: unknown): config.json's position embeddings (less the two
    RoBERTa-style models reserve), and tokenizer_config.json's model_max_length when it is set."""
    limits = []
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
        n = int(config.get("max_position_embeddings") or 0)
        if n and config.get("model_type") in ("roberta", "xlm-roberta", "camembert", "longformer"):
            n -= 2
        if n > 0:
            limits.append(n)
    except (OSError, ValueError, TypeError):
        pass
    try:
        tok = json.loads((Path(model_dir) / "tokenizer_config.json").read_text(encoding="utf-8"))
        n = int(tok.get("model_max_length") or 0)
        if 0 < n < 1_000_000:  # transformers writes a huge number for "not set"
            limits.append(n)
    except (OSError, ValueError, TypeError):
        pass
    return min(limits) if limits else 0
