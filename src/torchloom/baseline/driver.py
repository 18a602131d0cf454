"""The baseline with scikit-learn on the driver: the prepared splits read with pyarrow, no Spark.

The model is baseline/__init__.py's: TfidfVectorizer (word 1-2-grams, min_df 2, at most 300,000 terms,
sublinear tf, smoothed idf, L2 unit length) and a LogisticRegression (Newton-CG) per C of the grid. A multi-label
run's (label_id: the text's tag ids) is one-vs-rest: a binary LogisticRegression per tag on the same features,
C chosen by val micro-F1, the thresholds chosen on val by the transformer's rule (tag_scoring.choose_thresholds).
"""

from __future__ import annotations

import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from torchloom.baseline import model as baseline
from torchloom.baseline.model import open_parquet
from torchloom.lexical import Lexical
from torchloom.manifest import Manifest
from torchloom.tag_scoring import label_array


def read_split(manifest: Manifest, split: str) -> tuple[list[str], np.ndarray]:
    """The split's texts and label ids, one per text (with truncation chunks, its first window's row)."""
    chunks = manifest.tokenizer.get("truncation") == "chunks"
    columns = ["text", "label_id", "chunk"] if chunks else ["text", "label_id"]
    table = pa.concat_tables([open_parquet(manifest.shard_uri(s)).read(columns=columns)
                              for s in manifest.split(split).shards])
    if chunks:
        table = table.filter(pc.equal(table.column("chunk"), 0))
    return table.column("text").to_pylist(), label_array(table.column("label_id"))


def vectorizer():
    from sklearn.feature_extraction.text import TfidfVectorizer

    return TfidfVectorizer(lowercase=True, token_pattern=baseline.TOKEN_PATTERN, ngram_range=(1, 2),
                           min_df=baseline.MIN_DF, max_features=baseline.MAX_FEATURES, sublinear_tf=True,
                           norm="l2", use_idf=True, smooth_idf=True, dtype=np.float64)


def classifier(c: float, warm_start: bool = False):
    from sklearn.linear_model import LogisticRegression

    # Newton-CG to a tight tolerance: the optimum MLlib's L-BFGS reaches too, in a few Newton steps; scikit-learn's
    # default L-BFGS-B took several times longer to get there (docs/evaluation.md, "Measured choices").
    return LogisticRegression(C=c, solver="newton-cg", tol=baseline.TOL, max_iter=baseline.MAX_ITER,
                              warm_start=warm_start)


def grid_fitter(x, y):
    """fit(C) for baseline.choose_c: one estimator through the grid (C ascending), each fit starting from the
    last one's coefficients, which spares most Newton steps at the weakly regularised end; returns copies."""
    import copy

    model = classifier(baseline.C_GRID[0], warm_start=True)
    return lambda c: copy.deepcopy(model.set_params(C=c).fit(x, y))


def confusion(labels: np.ndarray, predicted: np.ndarray, k: int) -> list[list[int]]:
    counts = np.zeros((k, k), np.int64)
    np.add.at(counts, (labels, predicted), 1)
    return counts.tolist()


def fit(manifest: Manifest, splits: list[str]) -> baseline.Fitted:
    """Fit on train, C chosen on val; the chosen model's confusion matrix on each of `splits`."""
    from threadpoolctl import threadpool_limits

    # One BLAS thread: Newton-CG's work is sparse products (one thread anyway) and vector operations, and
    # OpenBLAS's waiting threads spin, which costs the most where other work shares the cores (docs/evaluation.md).
    with threadpool_limits(limits=1, user_api="blas"):
        return _fit(manifest, splits)


def _fit(manifest: Manifest, splits: list[str]) -> baseline.Fitted:
    if manifest.multi_label:
        return _fit_tags(manifest, splits)
    started = time.perf_counter()
    texts, labels = read_split(manifest, "train")
    vec = vectorizer()
    x_train = vec.fit_transform(texts)
    features = {"train": (x_train, labels)}
    for split in dict.fromkeys(["val", *splits]):
        if split != "train" and (split != "val" or baseline.has_val(manifest)):
            texts, y = read_split(manifest, split)
            features[split] = (vec.transform(texts), y)

    def val_accuracy(model) -> float:
        x_val, y_val = features["val"]
        return float(np.mean(model.predict(x_val) == y_val))

    c, model, grid = baseline.choose_c(grid_fitter(x_train, labels),
                                       val_accuracy if "val" in features else None)
    fit_s = time.perf_counter() - started
    k = manifest.num_labels
    return baseline.Fitted(engine="driver", c=c, grid=grid, num_features=x_train.shape[1], fit_s=fit_s,
                           confusion={s: confusion(features[s][1], model.predict(features[s][0]), k)
                                      for s in splits}, lexical=as_lexical(vec, model, manifest.labels))


def as_lexical(vec, model, labels: list[str]) -> Lexical:
    """The fitted vectorizer and classifier as plain arrays, for the shipped mix (lexical.py scores them)."""
    return Lexical(labels, model.classes_.tolist(), _terms(vec), vec.idf_, model.coef_, model.intercept_)


def _terms(vec) -> list[str]:
    terms = [""] * len(vec.vocabulary_)
    for term, column in vec.vocabulary_.items():
        terms[column] = term
    return terms


# -- multi-label: one logistic regression per tag ---------------------------------------------------------------
CONSTANT_LOGIT = 30.0  # a tag all or none of the train texts hold: its probability that, whatever the text


def tag_fitter(x, hot: np.ndarray):
    """fit(C) -> (coef [K, F], intercept [K]): one binary regression per tag, each warm-started along the grid."""
    models = [classifier(baseline.C_GRID[0], warm_start=True) for _ in range(hot.shape[1])]

    def fit(c: float) -> tuple[np.ndarray, np.ndarray]:
        coef, intercept = np.zeros((hot.shape[1], x.shape[1])), np.zeros(hot.shape[1])
        for j, model in enumerate(models):
            positives = int(hot[:, j].sum())
            if 0 < positives < len(hot):
                model.set_params(C=c).fit(x, hot[:, j])
                coef[j], intercept[j] = model.coef_[0], model.intercept_[0]
            else:
                intercept[j] = CONSTANT_LOGIT if positives else -CONSTANT_LOGIT
        return coef, intercept

    return fit


def tag_probabilities(model: tuple[np.ndarray, np.ndarray], x) -> np.ndarray:
    coef, intercept = model
    return 1.0 / (1.0 + np.exp(-np.clip(np.asarray(x @ coef.T) + intercept[None, :], -60.0, 60.0)))


def _fit_tags(manifest: Manifest, splits: list[str]) -> baseline.Fitted:
    from torchloom import tag_scoring as ts

    started, labels = time.perf_counter(), manifest.labels
    at_least_one = not manifest.tags.get("keep_untagged", False)
    texts, masks = read_split(manifest, "train")
    vec = vectorizer()
    x_train = vec.fit_transform(texts)
    features = {}
    for split in dict.fromkeys(["val", *splits]):
        if split == "train":
            features[split] = (x_train, masks)
        elif split != "val" or baseline.has_val(manifest):
            texts, split_masks = read_split(manifest, split)
            features[split] = (vec.transform(texts), split_masks)

    def chosen(model) -> ts.Thresholds:
        x_val, val_masks = features["val"]
        return ts.choose_thresholds(tag_probabilities(model, x_val), ts.multi_hot(val_masks, len(labels)),
                                    at_least_one=at_least_one)

    def val_micro_f1(model) -> float:
        x_val, val_masks = features["val"]
        probs = tag_probabilities(model, x_val)
        return ts.tag_metrics(ts.predict(probs, chosen(model)), ts.multi_hot(val_masks, len(labels)),
                              labels)["micro_f1"]

    c, model, grid = baseline.choose_c(tag_fitter(x_train, ts.multi_hot(masks, len(labels))),
                                       val_micro_f1 if "val" in features else None, key="val_micro_f1")
    thresholds = chosen(model) if "val" in features else ts.Thresholds(0.5, at_least_one=at_least_one)
    metrics = {s: ts.evaluation(tag_probabilities(model, features[s][0]), features[s][1], labels, thresholds)
               for s in splits}
    return baseline.Fitted(engine="driver", c=c, grid=grid, num_features=x_train.shape[1],
                           fit_s=time.perf_counter() - started, metrics=metrics,
                           lexical=Lexical(labels, list(range(len(labels))), _terms(vec), vec.idf_, model[0],
                                           model[1], task="multi_label"))
