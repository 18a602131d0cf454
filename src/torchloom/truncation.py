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


# Tokenizing a whole article to keep its first 128 tokens wastes most of the work (BBC News: 3.7 s
# against 0.5 s). So `head` encodes a prefix cut at a space first: tokenizers split words at spaces, and
# the cleaned text's only whitespace is single spaces, so the prefix's leading tokens equal the whole
# text's. If the prefix's tokens pass max_length by at least MARGIN (so a tokenizer that looks across
# word boundaries cannot change the kept ones), its head is the answer; else the whole text is encoded.
# prepare (etl/tokenize.py) and the Predictor both follow this rule, so they give the same ids.
CHARS_PER_TOKEN = 6
MARGIN = 32


def prefix(text: str, max_length: int) -> str:
    """The start of `text` that `head` encodes first: cut at a space, long enough for max_length + 2 x MARGIN
    tokens of CHARS_PER_TOKEN characters."""
    limit = (max_length + 2 * MARGIN) * CHARS_PER_TOKEN
    if len(text) <= limit:
        return text
    cut_at = text.rfind(" ", 0, limit)
    return text[:cut_at] if cut_at > 0 else text
