"""The classical baseline every evaluation is measured against, as a Spark MLlib pipeline.

Words (lower-cased, split at non-word characters), hashed into a fixed feature space, weighted by
TF-IDF and scaled to unit length, then a multinomial logistic regression (L-BFGS, L2 with the strength
scikit-learn's default C=1 gives). It trains on the prepared train split and scores the
other splits' rows, the same rows the transformer is scored on. It runs where prepare runs: on a
cluster the fit and the scoring are Spark jobs on the executors, and only the confusion counts come
back to the driver, so it scales with the data as prepare does.

What MLlib offers for text stops about here: sparse linear models on bag-of-words features. It has no
contextual model, no fine-tuning of a pretrained network, no GPU; that is what the transformer is for.
The baseline is there to say whether the transformer earned its cost on this data.
"""

from __future__ import annotations

import time
from typing import Any

from torchloom.manifest import Manifest

NAME = "TF-IDF + logistic regression"
DESCRIPTION = ("words, hashed, TF-IDF weighted, unit length; multinomial logistic regression (Spark MLlib, L2 as"
               " scikit-learn's C=1)")
# Each L-BFGS iteration is a Spark job over the train split; on the demo (1,700 rows) 100 iterations at a
# tolerance of 1e-4 take ~15 s and reach scikit-learn's accuracy, 30 cost a point (docs/evaluation.md).
MAX_ITER = 100
TOL = 1e-4
# The coefficient matrix is classes x features doubles, and L-BFGS keeps about 20 copies of it: the
# feature space shrinks as classes grow, so the driver's share stays near 4M doubles (~700 MB in all).
# Word bigrams and 2^18 features gave no more accuracy on the demo for 3x the time (the dense gradient
# every iteration sends grows with the features).
FEATURE_BUDGET = 1 << 22
MIN_FEATURES, MAX_FEATURES = 1 << 12, 1 << 16


def num_features(num_labels: int) -> int:
    n = MAX_FEATURES
    while n > MIN_FEATURES and n * max(2, num_labels) > FEATURE_BUDGET:
        n //= 2
    return n


def read_split(spark, manifest: Manifest, split: str):
    """The split's texts and labels, one row per text (with truncation chunks, its first window's row)."""
    paths = [manifest.shard_uri(s) for s in manifest.split(split).shards]
    df = spark.read.parquet(*paths)
    if manifest.tokenizer.get("truncation") == "chunks":
        df = df.filter(df["chunk"] == 0)
    return df.select("text", "label_id")


def pipeline(num_labels: int, train_rows: int):
    from pyspark.ml import Pipeline
    from pyspark.ml.classification import LogisticRegression
    from pyspark.ml.feature import IDF, HashingTF, Normalizer, RegexTokenizer

    return Pipeline(stages=[
        # (?U): \W by Unicode, not ASCII only (the prepared text is NFKC-cleaned, any script)
        RegexTokenizer(inputCol="text", outputCol="words", pattern="(?U)\\W+", toLowercase=True),
        HashingTF(inputCol="words", outputCol="tf", numFeatures=num_features(num_labels)),
        IDF(inputCol="tf", outputCol="tfidf"),
        Normalizer(inputCol="tfidf", outputCol="features", p=2.0),
        # scikit-learn's C=1 sums the loss over rows; MLlib averages it: regParam = 1 / (C * rows)
        LogisticRegression(featuresCol="features", labelCol="label_id", family="multinomial",
                           maxIter=MAX_ITER, tol=TOL, regParam=1.0 / max(1, train_rows), elasticNetParam=0.0,
                           standardization=False),
    ])


def scores(confusion: list[list[int]]) -> dict[str, Any]:
    """Accuracy and macro-F1 from a confusion matrix (rows true, columns predicted), averaged as
    evaluate/metrics.py averages: over the classes that occur in the labels or the predictions."""
    k = len(confusion)
    total = sum(map(sum, confusion))
    correct = sum(confusion[i][i] for i in range(k))
    f1s = []
    for i in range(k):
        support = sum(confusion[i])
        predicted = sum(confusion[j][i] for j in range(k))
        if support + predicted:
            f1s.append(2 * confusion[i][i] / (support + predicted))  # 2tp / (2tp + fp + fn)
    return {"n": total, "accuracy": correct / total if total else 0.0,
            "macro_f1": sum(f1s) / len(f1s) if f1s else 0.0, "confusion_matrix": confusion}


def fit_and_score(spark, manifest: Manifest, splits: list[str]) -> dict[str, Any]:
    """Fit on the train split, score each of `splits` that has rows; returns what baseline.json holds."""
    started = time.perf_counter()
    k = manifest.num_labels
    train_rows = manifest.split("train").documents or manifest.split("train").rows
    model = pipeline(k, train_rows).fit(read_split(spark, manifest, "train"))
    fitted = time.perf_counter()
    results: dict[str, Any] = {}
    for split in splits:
        if split not in manifest.splits or manifest.split(split).rows == 0:
            continue
        counts = (model.transform(read_split(spark, manifest, split))
                  .groupBy("label_id", "prediction").count().collect())
        confusion = [[0] * k for _ in range(k)]
        for row in counts:
            confusion[int(row["label_id"])][int(row["prediction"])] += int(row["count"])
        results[split] = scores(confusion)
    return {
        "name": NAME, "description": DESCRIPTION, "fingerprint": manifest.fingerprint,
        "train_rows": train_rows, "num_features": num_features(k), "max_iter": MAX_ITER, "tol": TOL,
        "fit_s": round(fitted - started, 2), "seconds": round(time.perf_counter() - started, 2),
        "splits": results,
    }
