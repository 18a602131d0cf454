"""The baseline on Spark: baseline/__init__.py's model, the features computed by the tasks, C chosen on the
driver, the model fitted by MLlib.

MLlib's own text stages differ from scikit-learn's standard baseline (its IDF lacks the + 1 of the smoothed idf,
and nothing in it takes the log of a term count), so the tasks run scikit-learn's own analyzer and counts in
Python (baseline/features.py: the driver path's vectorizer taken apart): the terms in at least MIN_DF train
texts, the MAX_FEATURES most frequent, weight (1 + ln tf) * (ln((1 + n) / (1 + df)) + 1), unit length. That was
Spark SQL before (a shuffle per (text, term) pair, and two more): 66 s against 45-51 s for 240,000 train texts.
Past VOCAB_TEXTS train texts the vocabulary and idf are counted on a hashed sample of that many.

C: scikit-learn fits the grid, warm-started along it as the driver path does, on at most GRID_TEXTS train and
GRID_VAL_TEXTS val texts collected to the driver; below that line, on all of them, so the two paths choose the
same C. Then MLlib fits that C on every train text, once (four fits of the whole split were most of the stage's
time at 240,000 texts). MLlib averages the loss over rows where scikit-learn sums it, so C becomes
regParam = 1 / (C * rows). Shards on a store this Spark has no Hadoop connector for (a run on s3:// from a
standalone cluster) are read by the tasks with pyarrow (inputs/store_read.py).
"""

from __future__ import annotations

import time
import warnings

import numpy as np

from torchloom.baseline import features
from torchloom.baseline import model as baseline
from torchloom.manifest import Manifest

# C is chosen on at most this many train texts and val texts (the same ones every time: grid_sample), each C
# fitted by scikit-learn on the driver; then the chosen C is fitted by MLlib on every train text, once.
# 50,000 texts gave the C the whole split gives (docs/evaluation.md, "The baseline at scale").
GRID_TEXTS = 50_000
GRID_VAL_TEXTS = 50_000
# The vocabulary and its idf are counted on at most this many train texts (grid_sample's, the same every run): the
# 300,000 most frequent terms and their document frequencies are estimated closely from a million texts, and
# counting every text's terms was the one pass whose cost grew with the distinct terms as well as the rows.
VOCAB_TEXTS = 1_000_000
HASH_RANGE = 1 << 30
SCALE_TOL = 1e-4


def read_split(spark, manifest: Manifest, split: str):
    """The split's texts and labels, one row per text (with truncation chunks, its first window's row)."""
    from torchloom.inputs.read import who_reads

    paths = [manifest.shard_uri(s) for s in manifest.split(split).shards]
    chunks = manifest.tokenizer.get("truncation") == "chunks"
    if paths and who_reads(paths[0], spark=spark) == "pyarrow":  # shards on a store this Spark has no connector for
        from torchloom.inputs.store_read import parquet_frame

        df = parquet_frame(spark, paths, ["text", "label_id", *(["chunk"] if chunks else [])])
    else:
        df = spark.read.parquet(*paths)
    if chunks:
        df = df.filter(df["chunk"] == 0)
    return df.select("text", "label_id")


def vocabulary(train, n_docs: int) -> tuple[list[str], np.ndarray]:
    """TfidfVectorizer's vocabulary of the train texts: the terms in MIN_DF texts or more, the MAX_FEATURES most
    frequent (by total count, a tie by term), in term order; and their idf. The tasks count (term_stats), Spark
    sums and ranks; only the chosen terms reach the driver."""
    from pyspark.sql import functions as F

    stats = (train.select("text").mapInArrow(features.term_stats, features.STATS_SCHEMA)
             .groupBy("term").agg(F.sum("df").alias("df"), F.sum("total").alias("total"))
             .filter(F.col("df") >= baseline.MIN_DF))
    top = stats.orderBy(F.desc("total"), "term").limit(baseline.MAX_FEATURES).select("term", "df").toArrow()
    terms = top.column("term").to_pylist()
    order = sorted(range(len(terms)), key=terms.__getitem__)
    return [terms[i] for i in order], features.idf(top.column("df").to_numpy()[order], n_docs)


def vectors(df, vocab: tuple[list[str], np.ndarray], keep: tuple[str, ...] = ("label_id",)):
    """df's `keep` columns and features, each text's vector (MLlib's sparse vector), computed by the tasks."""
    from functools import partial

    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql import types as T

    fields = {f.name: f for f in df.schema.fields}
    schema = T.StructType([fields[k] for k in keep] + [T.StructField("features", VectorUDT())])
    terms, idf = vocab
    return df.mapInArrow(partial(features.feature_batches, terms=terms, idf=idf, keep=keep), schema)


def grid_sample(df, rows: int, limit: int):
    """At most about `limit` of df's rows, the same ones on every run and engine: those whose text hashes below
    limit / rows of the range (all of them where rows <= limit)."""
    from pyspark.sql import functions as F

    if rows <= limit:
        return df
    return df.filter(F.pmod(F.xxhash64("text"), F.lit(HASH_RANGE)) < int(HASH_RANGE * limit / rows))


def classifier(c: float, rows: int, num_labels: int, tol: float = baseline.TOL):
    from pyspark.ml.classification import LogisticRegression

    # scikit-learn's C sums the loss over rows; MLlib averages it: regParam = 1 / (C * rows). Two classes:
    # one coefficient vector, as scikit-learn fits them (a multinomial pair would halve the penalty).
    return LogisticRegression(featuresCol="features", labelCol="label_id",
                              family="binomial" if num_labels == 2 else "multinomial",
                              regParam=1.0 / (c * max(1, rows)), elasticNetParam=0.0, standardization=False,
                              maxIter=baseline.MAX_ITER, tol=tol)


def confusion(model, feats, k: int) -> list[list[int]]:
    counts = model.transform(feats).groupBy("label_id", "prediction").count().collect()
    matrix = [[0] * k for _ in range(k)]
    for row in counts:
        matrix[int(row["label_id"])][int(row["prediction"])] += int(row["count"])
    return matrix


def collected(df, vocab) -> tuple[object, np.ndarray]:
    """df's texts as a CSR matrix on the driver, and their label ids."""
    table = vectors(df, vocab).toArrow()
    return features.as_csr(table, len(vocab[0])), table.column("label_id").to_numpy().astype(np.int64)


def choose_c_on_sample(train, val, vocab, rows: tuple[int, int]) -> tuple[float, list, dict[str, int]]:
    """C by val accuracy as the driver path chooses it (scikit-learn along the grid, warm-started), on at most
    GRID_TEXTS train and GRID_VAL_TEXTS val texts collected to the driver: (C, the grid, the texts it saw)."""
    from threadpoolctl import threadpool_limits

    from torchloom.baseline import driver

    x, y = collected(grid_sample(train, rows[0], GRID_TEXTS), vocab)
    x_val, y_val = collected(grid_sample(val, rows[1], GRID_VAL_TEXTS), vocab)
    with threadpool_limits(limits=1, user_api="blas"):  # as the driver path fits (baseline/driver.py)
        c, _, grid = baseline.choose_c(driver.grid_fitter(x, y),
                                       lambda model: float(np.mean(model.predict(x_val) == y_val)))
    return c, grid, {"train": x.shape[0], "val": x_val.shape[0]}


def fit(spark, manifest: Manifest, splits: list[str]) -> baseline.Fitted:
    """Fit on train with C chosen on val (on a sample of both past GRID_TEXTS); the model's confusion matrix on
    each of `splits`."""
    with warnings.catch_warnings():
        # mapInArrow checks the pandas version on every call and warns about pandas 3 each time; nothing here
        # uses pandas
        warnings.filterwarnings("ignore", "PySpark does not yet fully support pandas", FutureWarning)
        return _fit(spark, manifest, splits)


def _fit(spark, manifest: Manifest, splits: list[str]) -> baseline.Fitted:
    started = time.perf_counter()
    rows, k = baseline.train_texts(manifest), manifest.num_labels
    cached = []
    try:
        train = read_split(spark, manifest, "train")
        counted = grid_sample(train, rows, VOCAB_TEXTS)
        counted_rows = rows if rows <= VOCAB_TEXTS else counted.count()
        vocab = vocabulary(counted, counted_rows)
        num_features = len(vocab[0])
        if baseline.has_val(manifest):
            val_rows = manifest.split("val").documents or manifest.split("val").rows
            c, grid, sample = choose_c_on_sample(train, read_split(spark, manifest, "val"), vocab, (rows, val_rows))
            sample = sample if rows > GRID_TEXTS or val_rows > GRID_VAL_TEXTS else {}
        else:
            c, grid, sample = baseline.DEFAULT_C, [], {}
        feats = cached_vectors(train, vocab, cached)
        # past the sample, the one fit over every train text stops at SCALE_TOL (docs/evaluation.md: the iterations
        # it spares, the predictions it keeps); within it, at the driver path's optimum
        model = classifier(c, rows, k, tol=baseline.TOL if rows <= GRID_TEXTS else SCALE_TOL).fit(feats)
        # each other split is scored once: vectorised as it is read, not cached
        matrices = {split: confusion(model, feats if split == "train" else
                                     vectors(read_split(spark, manifest, split), vocab), k)
                    for split in splits}
        return baseline.Fitted(engine="spark", c=c, grid=grid, num_features=num_features, confusion=matrices,
                               fit_s=time.perf_counter() - started, grid_sample=sample,
                               vocabulary_texts=counted_rows if rows > VOCAB_TEXTS else 0)
    finally:
        for df in cached:
            df.unpersist()


def cached_vectors(df, vocab, cached: list):
    """df's label ids and vectors (MLlib's input), cached (and recorded in `cached`, for the caller to let go)."""
    cached.append(vectors(df, vocab).cache())
    return cached[-1]
