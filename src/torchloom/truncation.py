"""How a text longer than max_length tokens is cut: one rule for prepare (and so training and evaluate)
and for every inference path (predict, serve, Spark batch, MLflow), read from the exported model.

- head: the first max_length tokens (the tokenizer's own truncation; special tokens kept).
- head_tail: the first quarter of the window from the start of the text and the rest from its end
  (special tokens at both ends kept): the beginning says what a document is about, the end often
  concludes it (Sun et al. 2019 found head + tail best for long documents with BERT).
"""

from __future__ import annotations

from typing import TypeVar

STRATEGIES = ("head", "head_tail")
HEAD_SHARE = 0.25

T = TypeVar("T")


def head_tokens(max_length: int) -> int:
    return max(1, int(max_length * HEAD_SHARE))


def cut(ids: list[T], max_length: int, strategy: str) -> list[T]:
    """A whole encoding's ids (special tokens included; or any per-token list beside them, such as the
    attention mask) cut to max_length by `strategy`."""
    if len(ids) <= max_length:
        return ids
    if strategy == "head_tail":
        head = head_tokens(max_length)
        return ids[:head] + ids[len(ids) - (max_length - head):]
    if strategy == "head":  # the start, and the closing special token the tokenizer would keep
        return ids[:max_length - 1] + ids[-1:]
    raise ValueError(f"unknown truncation strategy {strategy!r}; use one of {', '.join(STRATEGIES)}")
