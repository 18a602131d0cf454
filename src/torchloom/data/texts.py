"""A prepared split read for scoring: which rows make one text, the texts themselves, the rows a gate scores.

With truncation chunks prepare writes each text as consecutive rows, its windows, chunk 0 first; otherwise
a row is a text. Every reader that scores texts (validation in training, evaluate, the ONNX gate) asks here
which text a row belongs to, and takes the score itself from torchloom.scoring.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pyarrow.parquet as pq

from torchloom.manifest import Manifest
from torchloom.scoring import text_scores
from torchloom.tag_scoring import concat_labels, label_array

if TYPE_CHECKING:
    from torchloom.model.onnx import GateRows


def text_of_rows(chunk: np.ndarray) -> np.ndarray:
    """The text each row is a window of, numbered from 0 in file order, from the rows' chunk numbers."""
    return np.cumsum(np.asarray(chunk) == 0) - 1


def chunk_documents(manifest: Manifest, split: str) -> np.ndarray | None:
    """The text each row of `split` (file order) is a window of, numbered from 0, when it was prepared with
    truncation chunks; else None."""
    if manifest.tokenizer.get("truncation") != "chunks":
        return None
    chunks = [pq.read_table(manifest.shard_uri(shard), columns=["chunk"]).column("chunk").to_numpy()
              for shard in manifest.split(split).shards]
    return text_of_rows(np.concatenate(chunks) if chunks else np.zeros(0, np.int64))


def to_documents(manifest: Manifest, split: str, logits: np.ndarray, labels: np.ndarray, index: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(probabilities in float32, labels, row indices) per text: scoring.text_scores of its rows' logits
    (index: a chunked text's first window's row). The rows may come in any order (several ranks' shares)."""
    docs = chunk_documents(manifest, split)
    multi = manifest.multi_label
    if docs is None or not len(logits):
        return text_scores(logits, multi_label=multi).probs.astype(np.float32), labels, index
    doc = docs[index]
    scores = text_scores(logits, doc, multi_label=multi)
    starts = np.nonzero(np.r_[True, docs[1:] != docs[:-1]])[0]  # each text's first row
    return scores.probs.astype(np.float32), labels[scores.first], starts[doc[scores.first]]


def texts_at(manifest: Manifest, split: str, wanted: set[int]) -> dict[int, str]:
    """Texts of the rows at these positions (file order), reading only the row groups that hold them."""
    out: dict[int, str] = {}
    start = 0
    for shard in manifest.split(split).shards:
        pf = None
        for g, rows in enumerate(shard.row_groups):
            hits = [i for i in wanted if start <= i < start + rows]
            if hits:
                pf = pf or pq.ParquetFile(manifest.shard_uri(shard))
                col = pf.read_row_group(g, columns=["text"]).column("text").to_pylist()
                for i in hits:
                    out[i] = col[i - start]
            start += rows
    return out


def gate_rows(m: Manifest, limit: int) -> GateRows:
    """Up to `limit` rows of the test split (else val) in file order, whole texts only: what the ONNX parity
    gate scores (model.onnx.GateRows: the gate defines what it takes)."""
    from torchloom.model.onnx import GateRows

    split = "test" if m.split("test").rows else "val"
    chunked = m.tokenizer.get("truncation") == "chunks"
    ids: list[list[int]] = []
    parts: list[np.ndarray] = []
    chunk: list[int] = []
    for shard in m.split(split).shards:
        table = pq.read_table(m.shard_uri(shard), columns=["input_ids", "label_id"] + (["chunk"] if chunked else []))
        ids += table.column("input_ids").to_pylist()
        parts.append(label_array(table.column("label_id")))
        if chunked:
            chunk += table.column("chunk").to_pylist()
        if len(ids) > limit:
            break
    labels = concat_labels(parts)
    if chunked:
        docs = text_of_rows(np.array(chunk, np.int64))
        keep = int(np.searchsorted(docs, docs[min(limit, len(docs)) - 1], side="right")) if len(docs) else 0
        return GateRows(split, ids[:keep], labels[:keep], docs[:keep])
    return GateRows(split, ids[:limit], labels[:limit])


def labelled_texts(manifest: Manifest, split: str, limit: int) -> tuple[list[str], list[str]]:
    """(texts, labels) of a split's first `limit` texts, in file order: a chunked text once, by its first window. A
    multi-label run's label is the text's tag set as prepare's label column writes one (text/tags.as_label)."""
    from torchloom.text import tags

    texts: list[str] = []
    labels: list[str] = []
    if split not in manifest.splits:
        return texts, labels
    column = "label_id" if manifest.multi_label else "label"
    for shard in manifest.split(split).shards:
        pf = pq.ParquetFile(manifest.shard_uri(shard))
        chunked = "chunk" in pf.schema_arrow.names  # shards written before chunks have a row per text
        table = pf.read(columns=["text", column, *(["chunk"] if chunked else [])])
        first = np.asarray(table.column("chunk")) == 0 if chunked else np.ones(table.num_rows, bool)
        values = table.column(column).to_pylist()
        if manifest.multi_label:
            values = [tags.as_label(tags.decode(mask, manifest.labels)) for mask in values]
        for text, label, keep in zip(table.column("text").to_pylist(), values, first):
            if keep and len(texts) < limit:
                texts.append(text)
                labels.append(label)
        if len(texts) >= limit:
            break
    return texts, labels
