"""The classical baseline every evaluation is measured against: the standard TF-IDF + logistic regression.

Words (lower-cased runs of two or more letters, digits or underscores, any script) and word bigrams;
the terms in at least 2 train texts, at most the 300,000 most frequent; sublinear term frequency
(1 + log tf), TF-IDF (scikit-learn's smoothed idf) and unit length; then a multinomial logistic regression
(L2) whose strength C is chosen from C_GRID by accuracy on the val split, each C fitted on the train split.
It scores the other splits' rows, the same rows the transformer is scored on.

Two paths fit the same model (tests/test_baseline.py holds them to the same predictions):
- driver: scikit-learn in this process, the splits read from the prepared Parquet with pyarrow; no Spark.
  Used while the train split is small enough for one process (DRIVER_MAX_TEXTS, DRIVER_MAX_TEXT_BYTES).
- spark: the same features as Spark SQL and MLlib's LogisticRegression, where prepare runs; on a cluster the
  fit and the scoring are jobs on the executors and only confusion counts come back (baseline_spark.py).
`eval.baseline_engine` (auto, driver, spark) picks one; auto goes by the train split's size.

A multi-label run's baseline is one-vs-rest (a binary logistic regression per tag on the same features, C chosen
by val micro-F1, the thresholds by the transformer's rule on val); the driver path fits it, the Spark path not yet.

Neither scikit-learn nor MLlib offers more for text than sparse linear models on bag-of-words features: no
contextual model, no fine-tuning of a pretrained network, no GPU; that is what the transformer is for.
The baseline is there to say whether the transformer earned its cost on this data.
"""

from __future__ import annotations

import time
from typing import Any

from torchloom.baseline.model import (  # the baseline's public face: what callers read from here
    C_GRID,
    DEFAULT_C,
    MAX_FEATURES,
    MIN_DF,
    Fitted,
    choose_c,
    has_val,
    train_texts,
)
from torchloom.errors import UserError
from torchloom.manifest import Manifest

__all__ = ["C_GRID", "DEFAULT_C", "DESCRIPTION", "ENGINES", "ENGINE_NAMES", "MAX_FEATURES", "MIN_DF", "NAME",
           "TAGS_NAME", "Fitted", "choose_c", "engine_for", "fit_and_score", "has_val", "name_of", "scores",
           "summary_line", "train_texts"]

NAME = "TF-IDF + logistic regression"
DESCRIPTION = ("word 1-2-grams (in 2+ train texts, at most 300,000), sublinear TF-IDF, unit length; multinomial"
               " logistic regression, C chosen on val")
TAGS_NAME = "TF-IDF + one-vs-rest logistic regression"
TAGS_DESCRIPTION = ("word 1-2-grams (in 2+ train texts, at most 300,000), sublinear TF-IDF, unit length; a logistic"
                    " regression per tag, C chosen by val micro-F1, thresholds chosen on val")
ENGINES = ("auto", "driver", "spark")
ENGINE_NAMES = {"driver": "scikit-learn on the driver", "spark": "Spark MLlib"}
# auto: scikit-learn on the driver up to here, Spark beyond. One process's memory and time grow with the
# train text; past this a cluster's executors do better (docs/evaluation.md, "Where the line is, and why").
DRIVER_MAX_TEXTS = 200_000
DRIVER_MAX_TEXT_BYTES = 50_000_000  # the train split's text column, uncompressed (UTF-8)


def engine_for(manifest: Manifest, requested: str = "auto") -> str:
    """driver or spark: the requested one, or (auto) driver while the train split is within the driver's line."""
    if requested not in ENGINES:
        raise UserError(f"eval.baseline_engine {requested!r}: not one of {', '.join(ENGINES)}")
    if manifest.multi_label:
        if requested == "spark":
            raise UserError("eval.baseline_engine spark: the multi-label (one-vs-rest) baseline runs on the driver"
                            " only yet; use --eval.baseline_engine auto or driver")
        return "driver"
    if requested != "auto":
        return requested
    if train_texts(manifest) > DRIVER_MAX_TEXTS:
        return "spark"
    return "driver" if text_bytes(manifest, "train") <= DRIVER_MAX_TEXT_BYTES else "spark"


def text_bytes(manifest: Manifest, split: str) -> int:
    """The split's text column, uncompressed, from the Parquet footers alone (with truncation chunks each
    window's row repeats its text: an overestimate, which errs towards Spark)."""
    from torchloom.baseline.model import open_parquet

    total = 0
    for shard in manifest.split(split).shards:
        meta = open_parquet(manifest.shard_uri(shard)).metadata
        column = meta.schema.names.index("text")
        total += sum(meta.row_group(i).column(column).total_uncompressed_size for i in range(meta.num_row_groups))
    return total


def name_of(manifest: Manifest) -> str:
    return TAGS_NAME if manifest.multi_label else NAME


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


def summary_line(result: dict[str, Any]) -> str:
    """The line the baseline stage prints: its scores, the chosen C and where it came from, the time."""
    scored = ", ".join(f"{k} accuracy {v['accuracy']:.4f}" for k, v in result["splits"].items())
    if result.get("task") == "multi_label":
        scored = ", ".join(f"{k} micro-F1 {v['micro_f1']:.4f} (macro {v['macro_f1']:.4f})"
                           for k, v in result["splits"].items())
    key = "val_micro_f1" if result.get("task") == "multi_label" else "val_accuracy"
    if result["grid"]:
        grid = ", ".join(f"{g['C']:g}: {g[key]:.4f}" for g in result["grid"])
        on = result.get("C_from") or "val"
        chosen = f"C={result['C']:g} chosen on {on} (val {'micro-F1' if 'micro' in key else 'accuracy'} by C: {grid})"
    else:
        chosen = f"C={result['C']:g}, the default: no val rows to choose on"
    counted = f" (counted on {result['vocabulary_texts']:,} train texts)" if result.get("vocabulary_texts") else ""
    return f"{scored}; {chosen}; {result['num_features']} features{counted} ({result['seconds']:.0f} s)"


def c_from(fitted: Fitted) -> str:
    if not fitted.grid:
        return f"default (no val rows to choose on; grid {list(C_GRID)})"
    if fitted.grid_sample:
        return (f"val, on a sample: {fitted.grid_sample['train']:,} train and {fitted.grid_sample['val']:,} val texts"
                " (then fitted on every train text)")
    return "val"


def scored_splits(manifest: Manifest, splits: list[str]) -> list[str]:
    return [s for s in dict.fromkeys(splits) if s in manifest.splits and manifest.split(s).rows > 0]


def fit_and_score(spark, manifest: Manifest, splits: list[str], engine: str = "auto") -> dict[str, Any]:
    """Fit on the train split (C chosen on val), score each of `splits` that has rows; returns what
    baseline.json holds. `spark` may be None where the driver path runs."""
    started = time.perf_counter()
    wanted = scored_splits(manifest, splits)
    if engine_for(manifest, engine) == "driver":
        from torchloom.baseline import driver as baseline_driver

        fitted = baseline_driver.fit(manifest, wanted)
    else:
        if spark is None:
            raise ValueError("the Spark baseline needs a SparkSession")
        from torchloom.baseline import spark as baseline_spark

        fitted = baseline_spark.fit(spark, manifest, wanted)
    return {
        "name": name_of(manifest), "fingerprint": manifest.fingerprint,
        "description": TAGS_DESCRIPTION if manifest.multi_label else DESCRIPTION,
        "engine": fitted.engine, "C": fitted.c,
        "C_from": c_from(fitted),
        "grid": fitted.grid, "train_rows": train_texts(manifest), "num_features": fitted.num_features,
        **({"vocabulary_texts": fitted.vocabulary_texts} if fitted.vocabulary_texts else {}),
        "fit_s": round(fitted.fit_s, 2), "seconds": round(time.perf_counter() - started, 2),
        "splits": fitted.metrics or {split: scores(m) for split, m in fitted.confusion.items()},
        **({"task": "multi_label", "thresholds": next(iter(fitted.metrics.values()))["thresholds"]}
           if fitted.metrics else {}),
        "lexical": fitted.lexical,  # not JSON: the caller saves it as files (lexical.Lexical.save) and drops it
    }
