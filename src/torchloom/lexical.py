"""The classical baseline as plain data and numpy: TF-IDF over word 1-2-grams and a logistic regression.

The shipped model may be a mix of the transformer's probabilities and this model's (scoring.mix), so every
path that scores texts (predict, serve, Spark batch, evaluate, the MLflow model) must compute the baseline's
probabilities the way scikit-learn did when it was fitted (baseline/driver.py), without scikit-learn and
without pickle. A fitted baseline is saved as two files in a directory (`baseline/` of a run, and of an
exported model that ships the mix):

    terms.json            {"format", "labels", "classes", "terms"}: the vocabulary in column order
    weights.safetensors   idf [F], coef [K', F], intercept [K'] (float64)

The rules are scikit-learn's TfidfVectorizer(lowercase, token_pattern TOKEN_PATTERN, ngram_range (1, 2),
sublinear_tf, smooth idf, norm l2) and LogisticRegression.predict_proba (the softmax of the decision function;
with two classes, the logistic of its one column). A multi-label baseline (task "multi_label", terms.json) is one
logistic regression per tag: coef [K, F] and intercept [K], each tag's probability the logistic of its own
column. tests/test_mix.py holds them equal to scikit-learn's to 1e-9.

numpy only (safetensors' numpy half, when reading or writing), nothing from torchloom: every layer may use it.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = "torchloom-tfidf/1"
TOKEN_PATTERN = r"(?u)\b\w\w+\b"  # scikit-learn's default: runs of 2+ word characters, any script
TERMS_FILE = "terms.json"
WEIGHTS_FILE = "weights.safetensors"


class Lexical:
    """A fitted TF-IDF + logistic regression; `probabilities(texts)` gives [N, len(labels)] float64. task
    "multi_label": one regression per tag (classes: every label, in order), each probability on its own."""

    def __init__(self, labels: list[str], classes: list[int], terms: list[str], idf: np.ndarray,
                 coef: np.ndarray, intercept: np.ndarray, task: str = "single_label") -> None:
        self.labels, self.classes = list(labels), np.asarray(classes, dtype=np.int64)
        self.task = task
        self.index = {term: i for i, term in enumerate(terms)}
        self.idf = np.asarray(idf, dtype=np.float64)
        self.coef = np.asarray(coef, dtype=np.float64)
        self.intercept = np.asarray(intercept, dtype=np.float64)
        self._token = re.compile(TOKEN_PATTERN)
        if self.coef.shape != (len(self.intercept), len(self.idf)) or len(self.index) != len(self.idf):
            raise ValueError("a baseline whose terms, idf and coefficients do not fit together")

    def features(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """(columns, values) of one text's unit-length TF-IDF row."""
        tokens = self._token.findall(text.lower())
        grams = tokens + [f"{a} {b}" for a, b in zip(tokens, tokens[1:])]
        counts = Counter(self.index[g] for g in grams if g in self.index)
        if not counts:
            return np.zeros(0, np.int64), np.zeros(0, np.float64)
        cols = np.fromiter(counts.keys(), np.int64, len(counts))
        tf = np.fromiter((1.0 + math.log(n) for n in counts.values()), np.float64, len(counts))
        values = tf * self.idf[cols]
        return cols, values / np.sqrt(np.dot(values, values))

    def decision(self, texts: list[str]) -> np.ndarray:
        out = np.tile(self.intercept, (len(texts), 1))
        for i, text in enumerate(texts):
            cols, values = self.features(text)
            if len(cols):
                out[i] += self.coef[:, cols] @ values
        return out

    def probabilities(self, texts: list[str]) -> np.ndarray:
        """Each text's class probabilities, columns in `labels` order (a class the baseline never saw: 0)."""
        d = self.decision(texts)
        if self.task == "multi_label":
            probs = np.zeros((len(texts), len(self.labels)), np.float64)
            probs[:, self.classes] = 1.0 / (1.0 + np.exp(-np.clip(d, -60.0, 60.0)))
            return probs
        if d.shape[1] == 1:  # two classes: one column, the logistic of it is the second class's
            p1 = 1.0 / (1.0 + np.exp(-d[:, 0]))
            seen = np.stack([1.0 - p1, p1], axis=1)
        else:
            shifted = np.exp(d - d.max(axis=1, keepdims=True))
            seen = shifted / shifted.sum(axis=1, keepdims=True)
        probs = np.zeros((len(texts), len(self.labels)), np.float64)
        probs[:, self.classes] = seen
        return probs

    # -- as files --------------------------------------------------------------------------------
    def save(self, directory: str | Path) -> Path:
        from safetensors.numpy import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        terms = sorted(self.index, key=self.index.__getitem__)
        (directory / TERMS_FILE).write_text(json.dumps(
            {"format": FORMAT, "labels": self.labels, "classes": self.classes.tolist(), "terms": terms,
             "task": self.task},
            ensure_ascii=False), encoding="utf-8")
        # contiguous: scikit-learn's coef_ may be column-major, and safetensors writes the buffer as it lies
        save_file({k: np.ascontiguousarray(v) for k, v in (("idf", self.idf), ("coef", self.coef),
                                                            ("intercept", self.intercept))},
                  str(directory / WEIGHTS_FILE))
        return directory

    @classmethod
    def load(cls, directory: str | Path) -> Lexical:
        from safetensors.numpy import load_file

        directory = Path(directory)
        meta: dict[str, Any] = json.loads((directory / TERMS_FILE).read_text(encoding="utf-8"))
        if meta.get("format") != FORMAT:
            raise ValueError(f"{directory / TERMS_FILE}: not a {FORMAT} baseline")
        arrays = load_file(str(directory / WEIGHTS_FILE))
        return cls(meta["labels"], meta["classes"], meta["terms"], arrays["idf"], arrays["coef"],
                   arrays["intercept"], meta.get("task", "single_label"))

    @staticmethod
    def exists(directory: str | Path) -> bool:
        return (Path(directory) / TERMS_FILE).is_file() and (Path(directory) / WEIGHTS_FILE).is_file()
