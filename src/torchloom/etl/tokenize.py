"""Tokenization on the executors: one tokenizers.Tokenizer per Python worker, batched encodes."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

from torchloom.errors import UserError
from torchloom.text import truncation

# chunk: the window's place in its text (prepare.truncation chunks); 0 for every other strategy
TOKENIZED_SCHEMA = ("text string, label string, label_id int, input_ids array<int>, length int, chunk int,"
                    " split string")

# Per Python worker process: tokenizer.json hash -> Tokenizer (built once, reused by every batch/task).
_TOKENIZERS: dict = {}


def read_tokenizer_json(model_dir: str) -> str:
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise UserError(
            f"model.path {model_dir}: no tokenizer.json (a fast tokenizer) there;"
            " save one with AutoTokenizer.from_pretrained(...).save_pretrained(dir)"
        )
    return path.read_bytes().decode("utf-8")  # bytes as on disk, so the hash is the file's


def tokenizer_hash(content: str) -> str:
    return hashlib.sha256(content.encode("utf-8")).hexdigest()


def get_tokenizer(content: str, key: str, max_length: int):
    """A Tokenizer that truncates at max_length (0: not at all), built once per worker process."""
    tok = _TOKENIZERS.get((key, max_length))
    if tok is None:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_str(content)
        if max_length:
            tok.enable_truncation(max_length)
        else:
            tok.no_truncation()
        tok.no_padding()  # padding happens per batch in the loader, never stored
        _TOKENIZERS[(key, max_length)] = tok
    return tok


def vocab_size(content: str) -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_str(content).get_vocab_size(with_added_tokens=True)


def encode_ids(tok, texts: list[str], max_length: int) -> list[list[int]]:
    """Token ids of `texts` as tok.encode_batch(texts) gives them (tok truncates at max_length).

    encode_batch_fast gives the same ids without tracking character offsets, which we never use:
    25% less tokenizing time.
    """
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    prefixes = [truncation.prefix(t, max_length) for t in texts]  # the shortcut text/truncation.py describes
    encodings = encode(prefixes, add_special_tokens=True)
    ids = [e.ids for e in encodings]
    specials = tok.post_processor.num_special_tokens_to_add(False) if tok.post_processor else 0
    redo = [
        i for i, (text, prefix, enc) in enumerate(zip(texts, prefixes, encodings))
        if not truncation.prefix_holds(text, prefix, sum(len(o.ids) - specials for o in enc.overflowing))
    ]
    if redo:
        for i, enc in zip(redo, encode([texts[i] for i in redo], add_special_tokens=True)):
            ids[i] = enc.ids
    return ids


def encode_cut(tok, texts: list[str], max_length: int, strategy: str) -> list[list[int]]:
    """Whole encodings (tok does not truncate) cut by truncation.cut: what head_tail needs."""
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    return [truncation.cut(e.ids, max_length, strategy) for e in encode(texts, add_special_tokens=True)]


def special_layout(tok) -> tuple[int, int]:
    """(leading, trailing) special tokens the tokenizer puts around one text."""
    return truncation.special_layout(tok.encode("a", add_special_tokens=True).special_tokens_mask)


def encode_chunks(tok, texts: list[str], max_length: int, stride: int, max_chunks: int) -> list[list[list[int]]]:
    """Each text's windows (truncation.windows) of its whole encoding (tok does not truncate)."""
    front, back = special_layout(tok)
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    return [truncation.windows(e.ids, max_length, stride, max_chunks, front, back)
            for e in encode(texts, add_special_tokens=True)]


def tokenize_batches(content_bc, key: str, max_length: int, strategy: str = "head", stride: int = 0,
                     max_chunks: int = 0):
    """A mapInArrow function: (text, label, label_id, split) -> TOKENIZED_SCHEMA.

    `content_bc` is a broadcast of tokenizer.json's text, so it ships once per executor. strategy: how
    a text longer than max_length is cut (truncation.STRATEGIES); with chunks, one row per window, the
    windows of a text next to each other in order (chunk 0, 1, ...).
    """

    def run(batches: Iterator) -> Iterator:
        import pyarrow as pa

        head = strategy == "head"  # the tokenizer's own truncation, and the prefix shortcut
        tok = get_tokenizer(content_bc.value, key, max_length if head else 0)
        for batch in batches:
            texts = batch.column("text").to_pylist()
            take = None
            if not texts:
                ids = []
            elif strategy == "chunks":
                per_text = encode_chunks(tok, texts, max_length, stride, max_chunks)
                take = pa.array([i for i, chunks in enumerate(per_text) for _ in chunks], pa.int64())
                chunk = [c for chunks in per_text for c in range(len(chunks))]
                ids = [w for chunks in per_text for w in chunks]
            else:
                ids = encode_ids(tok, texts, max_length) if head else encode_cut(tok, texts, max_length, strategy)
            if take is None:
                chunk = [0] * len(ids)
                columns = [batch.column(name) for name in ("text", "label", "label_id", "split")]
            else:
                columns = [batch.column(name).take(take) for name in ("text", "label", "label_id", "split")]
            yield pa.RecordBatch.from_arrays(
                [*columns[:3], pa.array(ids, pa.list_(pa.int32())), pa.array([len(x) for x in ids], pa.int32()),
                 pa.array(chunk, pa.int32()), columns[3]],
                names=["text", "label", "label_id", "input_ids", "length", "chunk", "split"],
            )

    return run


def tokenizer_info(model_dir: str, content: str, max_length: int, strategy: str = "head", stride: int = 0,
                   max_chunks: int = 0) -> dict:
    """The manifest's tokenizer entry (stride and max_chunks only with chunks)."""
    return {"path": str(model_dir), "hash": tokenizer_hash(content), "max_length": max_length,
            "truncation": strategy, "vocab_size": vocab_size(content),
            **({"stride": stride, "max_chunks": max_chunks} if strategy == "chunks" else {})}

