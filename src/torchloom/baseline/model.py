"""What both paths of the classical baseline share (baseline/__init__.py): the features, the grid of C, the
fitted result's shape, the choice of C on val. The driver path (baseline_driver.py) and the Spark path
(baseline_spark.py) import this; baseline/__init__.py picks one of them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torchloom.manifest import Manifest
from torchloom.uri import has_scheme

# The features, the same on both paths. scikit-learn's default token pattern: runs of 2+ word characters
# (letters, digits, underscore). Spark's RegexTokenizer splits at everything else and drops 1-character tokens.
TOKEN_PATTERN = r"(?u)\b\w\w+\b"
SPARK_GAPS = r"[^\p{L}\p{N}_]+"
MIN_DF = 2
MAX_FEATURES = 300_000
# C by val accuracy (docs/evaluation.md: which C won on which data); DEFAULT_C where there is no val row.
C_GRID = (1.0, 10.0, 100.0, 1000.0)
DEFAULT_C = 10.0
MAX_ITER = 1000
# Both paths fit to the optimum, not near it: scikit-learn's default stop (L-BFGS, tol 1e-4) left the objective
# measurably above its minimum, enough to move test predictions (docs/evaluation.md, "Measured choices").
TOL = 1e-6

@dataclass
class Fitted:
    """What either path hands back: the chosen C, each C's val score, and the chosen model's confusion
    matrix (rows true, columns predicted) per scored split; a multi-label fit, its metrics per scored split
    (tag_scoring.evaluation's, with the thresholds it chose on val) in place of the confusion matrices."""

    engine: str
    c: float
    grid: list[dict[str, float]]
    num_features: int
    confusion: dict[str, list[list[int]]] = field(default_factory=dict)
    fit_s: float = 0.0
    lexical: Any = None  # the chosen model as plain arrays (lexical.Lexical), where its path can give them
    metrics: dict[str, dict[str, Any]] = field(default_factory=dict)  # multi-label: per scored split
    grid_sample: dict[str, int] = field(default_factory=dict)  # C chosen on a sample: its train and val texts
    vocabulary_texts: int = 0  # the train texts the vocabulary and idf were counted on, where not all of them


def train_texts(manifest: Manifest) -> int:
    split = manifest.split("train")
    return split.documents or split.rows


def choose_c(fit: Callable[[float], Any], val_accuracy: Callable[[Any], float] | None, key: str = "val_accuracy"
             ) -> tuple[float, Any, list]:
    """Fit each C of C_GRID and keep the one with the best val score (accuracy; a multi-label fit's micro-F1, `key`
    val_micro_f1), the smaller C on a tie; without val rows (val_accuracy None) fit DEFAULT_C alone. Returns
    (C, its model, [{C, key}])."""
    if val_accuracy is None:
        return DEFAULT_C, fit(DEFAULT_C), []
    best, grid = None, []
    for c in C_GRID:
        model = fit(c)
        accuracy = val_accuracy(model)
        grid.append({"C": c, key: accuracy})
        if best is None or accuracy > best[2]:
            best = (c, model, accuracy)
    return best[0], best[1], grid


def has_val(manifest: Manifest) -> bool:
    return "val" in manifest.splits and manifest.split("val").rows > 0


def open_parquet(uri: str):
    """A Parquet file at a local path or on a store (s3://, s3a://, gs://, hdfs://: store/storage.py's client)."""
    import pyarrow.parquet as pq

    if has_scheme(uri):
        from torchloom.store import storage

        return pq.ParquetFile(storage.open_input(uri))
    return pq.ParquetFile(uri)
