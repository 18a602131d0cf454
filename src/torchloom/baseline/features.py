"""The baseline's features where the tasks compute them (baseline/spark.py): scikit-learn's own analyzer and
counts, the driver path's vectorizer taken apart, so both paths give a text the same vector by construction.

Two passes over the train texts, each a mapInArrow function that runs on the executors:
- term_stats: each term's document frequency and total count, summed per task until FLUSH_TERMS distinct terms
  (then handed to Spark, which sums them across tasks): a task's memory is bounded, not its partition's vocabulary;
- feature_batches: each text's vector over the chosen vocabulary: (1 + ln tf) * idf, unit length, its indices
  ascending, handed to Spark as MLlib's sparse vector; a text with no known term the zero vector (as
  scikit-learn gives it).
The vocabulary is chosen between them by TfidfVectorizer's rule, in Spark (baseline/spark.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import numpy as np
import pyarrow as pa

from torchloom.baseline import model as baseline

STATS_SCHEMA = "term string, df long, total long"
FLUSH_TERMS = 500_000  # distinct terms a task holds before it hands its sums on (~100 MB of Python dicts)


def counter(vocabulary: dict[str, int] | None = None):
    """scikit-learn's CountVectorizer with the baseline's analyzer (the driver path's TfidfVectorizer's)."""
    from sklearn.feature_extraction.text import CountVectorizer

    return CountVectorizer(lowercase=True, token_pattern=baseline.TOKEN_PATTERN, ngram_range=(1, 2),
                           vocabulary=vocabulary, dtype=np.int64)


def term_stats(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """A mapInArrow function: (text) -> (term, df, total) partial sums."""
    analyze = counter().build_analyzer()
    df: Counter = Counter()
    total: Counter = Counter()
    for batch in batches:
        for text in batch.column("text").to_pylist():
            counts = Counter(analyze(text or ""))
            df.update(counts.keys())
            total.update(counts)
        if len(total) >= FLUSH_TERMS:
            yield _stats(df, total)
            df, total = Counter(), Counter()
    if total:
        yield _stats(df, total)


def _stats(df: Counter, total: Counter) -> pa.RecordBatch:
    terms = list(total)
    return pa.RecordBatch.from_arrays([pa.array(terms, pa.string()), pa.array([df[t] for t in terms], pa.int64()),
                                       pa.array([total[t] for t in terms], pa.int64())], ["term", "df", "total"])


def idf(df: np.ndarray, n_docs: int) -> np.ndarray:
    """scikit-learn's smoothed idf: ln((1 + n) / (1 + df)) + 1."""
    return np.log((1.0 + n_docs) / (1.0 + df.astype(np.float64))) + 1.0


def vectors(texts: list[str], vocabulary: dict[str, int], idf: np.ndarray):
    """The texts' sublinear TF-IDF vectors at unit length as a CSR matrix (indices ascending in each row)."""
    x = counter(vocabulary).transform(texts).astype(np.float64)
    x.data = (1.0 + np.log(x.data)) * idf[x.indices]
    lengths = np.diff(x.indptr)
    norms = np.zeros(len(lengths))
    if x.nnz:
        norms[lengths > 0] = np.sqrt(np.add.reduceat(x.data * x.data, x.indptr[:-1][lengths > 0]))
    x.data /= np.repeat(np.where(norms > 0, norms, 1.0), lengths)
    return x


def feature_batches(batches: Iterator[pa.RecordBatch], terms: list[str], idf: np.ndarray, keep: tuple[str, ...]
                    ) -> Iterator[pa.RecordBatch]:
    """A mapInArrow function: (text, *keep) -> (*keep, features), features the text's vector in the layout of
    MLlib's sparse vector type (type 0, size, indices, values), which Spark reads as that type."""
    vocabulary = {term: i for i, term in enumerate(terms)}
    for batch in batches:
        x = vectors([t or "" for t in batch.column("text").to_pylist()], vocabulary, idf)
        offsets = pa.array(x.indptr.astype(np.int32))
        vector = pa.StructArray.from_arrays(
            [pa.array(np.zeros(batch.num_rows, np.int8)), pa.array(np.full(batch.num_rows, len(terms), np.int32)),
             pa.ListArray.from_arrays(offsets, pa.array(x.indices.astype(np.int32))),
             pa.ListArray.from_arrays(offsets, pa.array(x.data))], ["type", "size", "indices", "values"])
        yield pa.RecordBatch.from_arrays([batch.column(name) for name in keep] + [vector], [*keep, "features"])


def as_csr(table: pa.Table, num_features: int):
    """A collected table's features (feature_batches' vectors) as the CSR matrix its rows are."""
    from scipy import sparse

    vector = table.column("features").combine_chunks()
    indices, values = vector.field("indices"), vector.field("values")
    offsets = indices.offsets.to_numpy()
    return sparse.csr_matrix((values.flatten().to_numpy(zero_copy_only=False),
                              indices.flatten().to_numpy(zero_copy_only=False), offsets - offsets[0]),
                             shape=(table.num_rows, num_features))
