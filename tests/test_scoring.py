"""How a text is scored (torchloom.scoring) and which rows make one text (torchloom.data.texts): every
scoring path, torch or numpy, gives a chunked text the softmax of its windows' mean logits."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from torchloom import scoring
from torchloom.data.texts import chunk_documents, gate_rows, text_of_rows, texts_at, to_documents
from torchloom.manifest import Manifest, Shard, Split
from torchloom.model.predict import Predictor
from torchloom.scoring import softmax, text_scores

ROOT = Path(__file__).resolve().parent.parent
LABELS = ["a", "b", "c"]


def windows_per_text(rng: np.random.Generator, texts: int) -> list[int]:
    counts = rng.integers(1, 7, texts).tolist()
    counts[0] = 1  # a text prepared whole among chunked ones
    return counts


def torch_reference(logits: np.ndarray, counts: list[int]) -> np.ndarray:
    """The rule written out with torch, one text at a time: softmax of the mean of its windows' logits."""
    parts = torch.from_numpy(logits).double().split(counts)
    return torch.stack([torch.softmax(p.mean(0), -1) for p in parts]).numpy()


class TablePredictor(Predictor):
    """Predictor's batching and aggregation over a fixed table of logits, one row per window (no model):
    each window's input carries its row number."""

    def __init__(self, table: np.ndarray, batch_size: int) -> None:
        self.table = torch.from_numpy(table)
        self.labels = list(LABELS)
        self.batch_size = batch_size
        self.forward_tokens = 0
        self.tokenizer = self

    def pad(self, features: list[dict], return_tensors: str) -> dict:
        return {"row": torch.tensor([f["row"] for f in features])}

    def logits(self, batch: dict) -> torch.Tensor:
        return self.table[batch["row"]]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_predict_scores_a_text_as_scoring_does_with_uneven_window_counts(seed):
    rng = np.random.default_rng(seed)
    counts = windows_per_text(rng, 40)
    logits = (rng.normal(size=(sum(counts), len(LABELS))) * 4).astype(np.float32)
    owner = np.repeat(np.arange(len(counts)), counts)
    # windows of different lengths, so predict's length sort runs them out of input order
    per_text, row = [], 0
    for n in counts:
        per_text.append([{"input_ids": [0] * int(rng.integers(1, 50)), "row": row + k} for k in range(n)])
        row += n

    answers = TablePredictor(logits, batch_size=7).predict_encoded(per_text, with_logits=True)
    predicted = np.array([[a["probabilities"][lb] for lb in LABELS] for a in answers])
    means = np.array([[a["logits"][lb] for lb in LABELS] for a in answers])

    scores = text_scores(logits, owner)
    np.testing.assert_allclose(predicted, scores.probs, rtol=0, atol=1e-7)  # float32 answers of float64 scores
    np.testing.assert_allclose(predicted, torch_reference(logits, counts), rtol=0, atol=1e-7)
    np.testing.assert_allclose(means, scores.logits, rtol=0, atol=1e-6)
    assert [a["label"] for a in answers] == [LABELS[i] for i in scores.probs.argmax(1)]
    assert scores.first.tolist() == np.r_[0, np.cumsum(counts)[:-1]].tolist()
    assert not np.allclose(scores.probs, softmax(logits[scores.first]))  # the mean is not the first window's


def test_text_scores_take_rows_in_any_order_and_one_row_per_text_without_docs():
    rng = np.random.default_rng(3)
    counts = windows_per_text(rng, 25)
    logits = rng.normal(size=(sum(counts), 4)).astype(np.float32)
    docs = np.repeat(np.arange(len(counts)), counts)
    shuffled = rng.permutation(len(docs))  # several ranks' shares, gathered
    in_order, any_order = text_scores(logits, docs), text_scores(logits[shuffled], docs[shuffled])
    np.testing.assert_allclose(any_order.probs, in_order.probs, rtol=0, atol=1e-12)
    assert (docs[shuffled][any_order.first] == np.arange(len(counts))).all()

    whole = text_scores(logits)
    np.testing.assert_allclose(whole.probs, torch.softmax(torch.from_numpy(logits).double(), -1).numpy(), atol=1e-12)
    assert whole.first.tolist() == list(range(len(logits)))
    np.testing.assert_allclose(softmax(np.array([[1000.0, 0.0]])), [[1.0, 0.0]])  # no overflow
    empty = text_scores(np.zeros((0, 3), np.float32), np.zeros(0, np.int64))
    assert empty.probs.shape == (0, 3) and empty.first.shape == (0,)
    with pytest.raises(ValueError, match="docs has 2 entries for 3 rows"):
        text_scores(np.zeros((3, 2)), np.array([0, 1]))


def test_scoring_imports_numpy_and_nothing_from_torchloom():
    tree = ast.parse(Path(scoring.__file__).read_text(encoding="utf-8"))
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module}
    assert imported - set(sys.stdlib_module_names) == {"numpy"}, imported
    code = "import sys, torchloom.scoring; print(' '.join(sorted(sys.modules)))"
    loaded = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                            cwd=ROOT).stdout.split()
    assert sorted(m for m in loaded if m.startswith("torchloom")) == ["torchloom", "torchloom.scoring"]
    assert not {m.split(".")[0] for m in loaded} & {"torch", "pyarrow", "pandas", "transformers"}


@pytest.fixture
def chunked(tmp_path) -> tuple[Manifest, list[int], np.ndarray]:
    """A prepared-looking test split with truncation chunks in two shards: (manifest, windows per text, labels per
    text)."""
    rng = np.random.default_rng(4)
    counts = windows_per_text(rng, 9)
    text_labels = rng.integers(0, len(LABELS), len(counts))
    chunk = np.concatenate([np.arange(n) for n in counts])
    doc = np.repeat(np.arange(len(counts)), counts)
    cut = int(np.cumsum(counts)[4])  # a shard boundary between texts
    (tmp_path / "test").mkdir()
    shards = []
    for i, rows in enumerate([slice(0, cut), slice(cut, len(doc))]):
        path = tmp_path / "test" / f"part-{i}.parquet"
        pq.write_table(pa.table({
            "text": [f"text {d}" for d in doc[rows]], "label_id": text_labels[doc[rows]].astype(np.int32),
            "input_ids": [[101, int(d), int(c), 102] for d, c in zip(doc[rows], chunk[rows])],
            "chunk": chunk[rows].astype(np.int32)}), path, row_group_size=4)
        meta = pq.ParquetFile(path).metadata
        shards.append(Shard(path=f"test/{path.name}", rows=meta.num_rows,
                            row_groups=[meta.row_group(g).num_rows for g in range(meta.num_row_groups)]))
    m = Manifest(labels=LABELS, splits={"test": Split(rows=len(doc), shards=shards, documents=len(counts)),
                                        "val": Split(rows=0, shards=[])},
                 tokenizer={"truncation": "chunks", "max_length": 4}, fingerprint="chunked", root=str(tmp_path))
    return m, counts, text_labels


def test_the_rows_of_a_prepared_split_make_texts_as_prepare_wrote_them(chunked):
    m, counts, text_labels = chunked
    assert text_of_rows(np.array([0, 1, 2, 0, 0, 1])).tolist() == [0, 0, 0, 1, 2, 2]
    docs = chunk_documents(m, "test")
    assert docs.tolist() == np.repeat(np.arange(len(counts)), counts).tolist()

    # evaluate's and validation's path: rows from any rank in any order, one score per text
    rng = np.random.default_rng(5)
    logits = rng.normal(size=(len(docs), len(LABELS))).astype(np.float32)
    order = rng.permutation(len(docs))
    probs, labels, index = to_documents(m, "test", logits[order], text_labels[docs][order], order)
    starts = np.r_[0, np.cumsum(counts)[:-1]]
    assert index.tolist() == starts.tolist() and labels.tolist() == text_labels.tolist()
    np.testing.assert_allclose(probs, torch_reference(logits, counts), atol=1e-7)
    assert texts_at(m, "test", {int(starts[3]), int(starts[7])}) == {int(starts[3]): "text 3", int(starts[7]): "text 7"}

    # the ONNX gate's rows: whole texts only, never a text cut at the limit
    limit = int(starts[5]) + 1  # one window into text 5
    rows = gate_rows(m, limit)
    assert rows.split == "test" and len(rows.input_ids) == int(starts[5]) + counts[5]
    assert rows.docs.tolist() == docs[:len(rows.input_ids)].tolist()
    assert rows.labels.tolist() == text_labels[docs][:len(rows.input_ids)].tolist()
