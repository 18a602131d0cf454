"""How a text longer than max_length tokens is cut: one rule for prepare (and so training and evaluate)
and for every inference path (predict, serve, Spark batch, MLflow), read from the exported model.

- head: the first max_length tokens (the tokenizer's own truncation; special tokens kept).
- head_tail: the first quarter of the window from the start of the text and the rest from its end
  (special tokens at both ends kept): the beginning says what a document is about, the end often
  concludes it (Sun et al. 2019 found head + tail best for long documents with BERT).
- chunks: the whole text, as overlapping windows of max_length tokens (special tokens around each), the
  next starting `stride` tokens after the last (fewer when the windows fit evenly; at most `max_chunks`,
  then spread evenly from the start to the end). Training sees every window with the text's label;
  evaluate, predict, serve and Spark batch score the text as the mean of its windows' logits.
"""

from __future__ import annotations

from typing import TypeVar

STRATEGIES = ("head", "head_tail", "chunks")
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


def default_stride(max_length: int, specials: int = 2) -> int:
    """Three quarters of a window's text tokens: consecutive windows share a quarter."""
    return max(1, (max_length - specials) * 3 // 4)


def window_starts(tokens: int, width: int, stride: int, max_chunks: int) -> list[int]:
    """Where each window of `width` text tokens starts in a text of `tokens` text tokens: the first at 0,
    the last ending at the text's end, evenly spaced no more than `stride` apart (max_chunks 0: no cap;
    else at most max_chunks windows, evenly spaced however far apart that makes them)."""
    if tokens <= width:
        return [0]
    n = 1 + -(-(tokens - width) // stride)  # ceil
    if max_chunks:
        n = min(n, max_chunks)
    if n == 1:
        return [0]
    last = tokens - width
    return [round(i * last / (n - 1)) for i in range(n)]


def windows(ids: list[T], max_length: int, stride: int, max_chunks: int, front: int = 1, back: int = 1
            ) -> list[list[T]]:
    """A whole encoding's ids (or any per-token list beside them) as chunks: each window of the text's
    tokens with the encoding's `front` leading and `back` trailing special tokens around it."""
    if len(ids) <= max_length:
        return [ids]
    head, text, tail = ids[:front], ids[front:len(ids) - back], ids[len(ids) - back:]
    width = max_length - front - back
    if width < 1:
        raise ValueError(f"max_length {max_length} leaves no room for text between {front + back} special tokens")
    return [head + text[s:s + width] + tail for s in window_starts(len(text), width, stride, max_chunks)]


def special_layout(mask: list[int]) -> tuple[int, int]:
    """(leading, trailing) special tokens of one encoding, from its special-tokens mask."""
    front = next((i for i, m in enumerate(mask) if not m), len(mask))
    back = next((i for i, m in enumerate(reversed(mask)) if not m), 0)
    return front, back


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


def prefix_holds(text: str, start: str, past: int) -> bool:
    """Whether `start`, prefix(text, max_length), gives the whole text's head ids: it is the whole text, or
    its tokens pass max_length by at least MARGIN (`past`: by how many)."""
    return len(start) == len(text) or past >= MARGIN
