"""The baseline on Spark: baseline/__init__.py's model, the features in Spark SQL and the classifier in MLlib.

MLlib's own text stages differ from scikit-learn's standard baseline (its IDF lacks the + 1 of the smoothed
idf, and nothing in it takes the log of a term count), so the features are built in Spark SQL with the
same formulas as scikit-learn's TfidfVectorizer: the terms in at least MIN_DF train texts, the
MAX_FEATURES most frequent, weight (1 + ln tf) * (ln((1 + n) / (1 + df)) + 1), unit length. No Python runs
on the executors but that reading. MLlib averages the loss over rows where scikit-learn sums it, so C becomes
regParam = 1 / (C * rows). Shards on a store this Spark has no Hadoop connector for (a run on s3:// from a
standalone cluster) are read by the tasks with pyarrow (inputs/store_read.py).
"""

from __future__ import annotations

import time

from torchloom.baseline import model as baseline
from torchloom.manifest import Manifest


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


def term_counts(df):
    """The texts with a doc id (df's columns and doc), and (doc, term, count) for their words and word bigrams."""
    from pyspark.ml.feature import NGram, RegexTokenizer
    from pyspark.sql import functions as F

    docs = df.withColumn("doc", F.monotonically_increasing_id())
    words = RegexTokenizer(inputCol="text", outputCol="words", pattern=baseline.SPARK_GAPS, gaps=True,
                           minTokenLength=2, toLowercase=True).transform(docs)
    grams = NGram(n=2, inputCol="words", outputCol="bigrams").transform(words)
    terms = grams.select("doc", F.explode(F.concat("words", "bigrams")).alias("term"))
    return docs, terms.groupBy("doc", "term").count()


def vocabulary(counts, n_docs: int):
    """(term, index, idf): the train terms in MIN_DF texts or more, the MAX_FEATURES most frequent."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    per_term = (counts.groupBy("term").agg(F.count("*").alias("df"), F.sum("count").alias("total"))
                .filter(F.col("df") >= baseline.MIN_DF))
    top = per_term.orderBy(F.desc("total"), "term").limit(baseline.MAX_FEATURES)
    by_term = Window.partitionBy(F.lit(0)).orderBy("term")  # one partition: at most MAX_FEATURES rows
    return top.select("term", (F.row_number().over(by_term) - 1).alias("index"),
                      (F.log((1.0 + n_docs) / (1.0 + F.col("df"))) + 1.0).alias("idf"))


def features(docs, counts, vocab, num_features: int):
    """docs' columns but doc, and features: each text's sublinear TF-IDF vector at unit length, sparse; a
    text with no known term gets the zero vector (as scikit-learn gives it)."""
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    weighted = counts.join(F.broadcast(vocab), "term").select(
        "doc", "index", ((1.0 + F.log("count")) * F.col("idf")).alias("w"))
    per_doc = weighted.groupBy("doc").agg(F.sort_array(F.collect_list(F.struct("index", "w"))).alias("pairs"),
                                          F.sqrt(F.sum(F.col("w") * F.col("w"))).alias("norm"))
    rows = docs.join(per_doc, "doc", "left")
    indices = F.coalesce(F.transform("pairs", lambda p: p["index"]), F.array().cast("array<int>"))
    values = F.coalesce(F.transform("pairs", lambda p: p["w"] / F.col("norm")), F.array().cast("array<double>"))
    # a vector column from arrays without a Python UDF: the vector type's own JSON form
    sparse = F.struct(F.lit(0).cast("byte").alias("type"), F.lit(num_features).alias("size"),
                      indices.alias("indices"), values.alias("values"))
    schema = T.StructType([T.StructField("v", VectorUDT())])
    vector = F.from_json(F.to_json(F.struct(sparse.alias("v"))), schema)["v"]
    return rows.select(*[c for c in docs.columns if c != "doc"], vector.alias("features"))


def classifier(c: float, rows: int, num_labels: int):
    from pyspark.ml.classification import LogisticRegression

    # scikit-learn's C sums the loss over rows; MLlib averages it: regParam = 1 / (C * rows). Two classes:
    # one coefficient vector, as scikit-learn fits them (a multinomial pair would halve the penalty).
    return LogisticRegression(featuresCol="features", labelCol="label_id",
                              family="binomial" if num_labels == 2 else "multinomial",
                              regParam=1.0 / (c * max(1, rows)), elasticNetParam=0.0, standardization=False,
                              maxIter=baseline.MAX_ITER, tol=baseline.TOL)


def confusion(model, feats, k: int) -> list[list[int]]:
    counts = model.transform(feats).groupBy("label_id", "prediction").count().collect()
    matrix = [[0] * k for _ in range(k)]
    for row in counts:
        matrix[int(row["label_id"])][int(row["prediction"])] += int(row["count"])
    return matrix


def fit(spark, manifest: Manifest, splits: list[str]) -> baseline.Fitted:
    """Fit on train, C chosen on val; the chosen model's confusion matrix on each of `splits`."""
    started = time.perf_counter()
    rows, k = baseline.train_texts(manifest), manifest.num_labels
    cached = []

    def keep(df):
        cached.append(df.cache())
        return df

    try:
        docs, counts = term_counts(read_split(spark, manifest, "train"))
        vocab = keep(vocabulary(keep(counts), rows))
        num_features = vocab.count()
        feats = {"train": keep(features(docs.select("doc", "label_id"), counts, vocab, num_features))}
        for split in dict.fromkeys(["val", *splits]):
            if split != "train" and (split != "val" or baseline.has_val(manifest)):
                docs, counts = term_counts(read_split(spark, manifest, split))
                feats[split] = keep(features(docs.select("doc", "label_id"), counts, vocab, num_features))

        def val_accuracy(model) -> float:
            matrix = confusion(model, feats["val"], k)
            return sum(matrix[i][i] for i in range(k)) / max(1, sum(map(sum, matrix)))

        c, model, grid = baseline.choose_c(lambda c: classifier(c, rows, k).fit(feats["train"]),
                                           val_accuracy if "val" in feats else None)
        fit_s = time.perf_counter() - started
        return baseline.Fitted(engine="spark", c=c, grid=grid, num_features=num_features, fit_s=fit_s,
                               confusion={s: confusion(model, feats[s], k) for s in splits})
    finally:
        for df in cached:
            df.unpersist()
