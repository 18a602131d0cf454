"""The classical baseline (baseline/__init__.py, evaluate/baseline.py): what it trains on, what it scores,
and how it is reported beside the transformer."""

from __future__ import annotations

import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from torchloom.data.synthetic import write_synthetic_dataset
from torchloom.manifest import Manifest, Shard, Split
from torchloom.manifest import read as read_manifest
from torchloom.scoring import classification_metrics

pytest.importorskip("sklearn")
pytestmark = pytest.mark.heavy(9)  # see tests/support/schedule.py


def topic_texts(n: int, rng: np.random.Generator, priors=(0.55, 0.15, 0.15, 0.15)) -> tuple[list[str], np.ndarray]:
    """Texts of 3 words from their class's own 40 and 30 shared noise words; one class is most of the rows.
    A strong L2 penalty (C=1 on ~400 rows) leans on the priors and underfits the other classes."""
    labels = rng.choice(len(priors), n, p=priors)
    texts = []
    for label in labels:
        words = [f"s{label}x{rng.integers(40)}" for _ in range(3)] + [f"n{rng.integers(400)}" for _ in range(30)]
        rng.shuffle(words)
        texts.append(" ".join(words))
    return texts, labels


def write_prepared(out, splits: dict[str, tuple[list[str], np.ndarray]], num_labels: int) -> Manifest:
    """A prepared data dir (the shards' text, label and label_id columns, and the manifest) from texts."""
    names = [f"topic_{k}" for k in range(num_labels)]
    written = {}
    for split, (texts, labels) in splits.items():
        (out / split).mkdir(parents=True)
        for i, first in enumerate(range(0, len(texts), 150)):  # a few shards, as prepare writes them
            chunk = slice(first, first + 150)
            pq.write_table(pa.table({"text": texts[chunk], "label": [names[k] for k in labels[chunk]],
                                     "label_id": pa.array(labels[chunk], pa.int32())}),
                           out / split / f"part-{i:05d}.parquet", row_group_size=64)
        shards = [Shard(path=f"{split}/{f.name}", rows=pq.read_metadata(f).num_rows, row_groups=[])
                  for f in sorted((out / split).glob("*.parquet"))]
        counts = np.bincount(labels, minlength=num_labels)
        written[split] = Split(rows=len(texts), shards=shards, per_class=dict(zip(names, map(int, counts))))
    Manifest(labels=names, splits=written, tokenizer={"truncation": "head"}, fingerprint="topics").write(out)
    return read_manifest(out)


@pytest.fixture(scope="module")
def topics(tmp_path_factory) -> Manifest:
    rng = np.random.default_rng(0)
    splits = {"train": topic_texts(400, rng), "val": topic_texts(200, rng), "test": topic_texts(400, rng)}
    return write_prepared(tmp_path_factory.mktemp("topics"), splits, 4)


@pytest.fixture(scope="module")
def two_topics(tmp_path_factory) -> Manifest:
    """Two classes: scikit-learn fits one coefficient vector, so must MLlib (binomial, not a multinomial pair)."""
    rng = np.random.default_rng(1)
    splits = {name: topic_texts(n, rng, priors=(0.7, 0.3)) for name, n in (("train", 300), ("val", 150),
                                                                              ("test", 300))}
    return write_prepared(tmp_path_factory.mktemp("two_topics"), splits, 2)


def test_baseline_scores_agree_with_the_evaluation_metrics():
    from torchloom.baseline import scores

    rng = np.random.default_rng(0)
    labels = rng.integers(0, 3, 300)  # class 3 never occurs in the labels but is predicted at times
    pred = np.where(rng.random(300) < 0.7, labels, rng.integers(0, 4, 300))
    confusion = [[int(np.sum((labels == t) & (pred == p))) for p in range(4)] for t in range(4)]
    m = classification_metrics(np.eye(4)[pred], labels, ["a", "b", "c", "d"])
    s = scores(confusion)
    assert s["n"] == 300
    assert s["accuracy"] == pytest.approx(m["accuracy"]) and s["macro_f1"] == pytest.approx(m["macro_f1"])


def test_the_baseline_trains_on_train_and_scores_exactly_the_prepared_splits(tmp_path):
    from torchloom.baseline import C_GRID, fit_and_score

    written = write_synthetic_dataset(tmp_path / "data", rows={"train": 150, "val": 30, "test": 45})
    m = read_manifest(tmp_path / "data")
    result = fit_and_score(None, m, ["val", "test"])  # small: scikit-learn on the driver, no Spark
    assert result["engine"] == "driver" and result["num_features"] > 0
    assert result["train_rows"] == 150 and result["fingerprint"] == written.fingerprint
    assert set(result["splits"]) == {"val", "test"}
    assert [g["C"] for g in result["grid"]] == list(C_GRID) and result["C_from"] == "val"
    for split in ("val", "test"):
        confusion = result["splits"][split]["confusion_matrix"]
        # every row of the split scored once, under its own label
        assert [sum(row) for row in confusion] == [m.split(split).per_class.get(lb, 0) for lb in m.labels]
    # the synthetic texts draw most words from their label's band of the vocabulary: learnable (chance: 1/3)
    assert result["splits"]["test"]["accuracy"] >= 0.7, result["splits"]["test"]


def test_c_is_chosen_on_val_where_c_1_underfits(topics):
    from torchloom import baseline
    from torchloom.baseline import driver as baseline_driver

    result = baseline.fit_and_score(None, topics, ["val", "test"], engine="driver")
    by_c = {g["C"]: g["val_accuracy"] for g in result["grid"]}
    assert result["C"] != 1 and by_c[result["C"]] == max(by_c.values()), result["grid"]
    assert result["splits"]["val"]["accuracy"] == by_c[result["C"]]  # the chosen model is the one scored
    # and the choice holds on test: the chosen C beats C=1 there by a wide margin
    c1 = driver_predictions(topics, 1.0)
    test_texts, test_labels = baseline_driver.read_split(topics, "test")
    c1_accuracy = float(np.mean([c1[t] for t in test_texts] == test_labels))
    assert result["splits"]["test"]["accuracy"] >= c1_accuracy + 0.1, (result["splits"]["test"], c1_accuracy)


def test_without_val_rows_the_default_c_is_used_and_said(tmp_path):
    from torchloom import baseline

    write_synthetic_dataset(tmp_path / "data", rows={"train": 150, "val": 0, "test": 45})
    result = baseline.fit_and_score(None, read_manifest(tmp_path / "data"), ["val", "test"], engine="driver")
    assert result["C"] == baseline.DEFAULT_C and result["grid"] == [] and set(result["splits"]) == {"test"}
    assert result["C_from"].startswith("default")
    assert f"C={baseline.DEFAULT_C:g}, the default: no val rows" in baseline.summary_line(result)


def driver_predictions(m: Manifest, c: float) -> dict[str, int]:
    """scikit-learn's prediction for each test text, fitted on train at C=c."""
    from torchloom.baseline import driver as baseline_driver

    texts, labels = baseline_driver.read_split(m, "train")
    vec = baseline_driver.vectorizer()
    model = baseline_driver.classifier(c).fit(vec.fit_transform(texts), labels)
    test_texts, _ = baseline_driver.read_split(m, "test")
    return dict(zip(test_texts, model.predict(vec.transform(test_texts)).tolist()))


def spark_predictions(spark, m: Manifest, c: float) -> dict[str, int]:
    """MLlib's prediction for each test text, fitted on train at C=c."""
    from torchloom import baseline
    from torchloom.baseline import spark as baseline_spark

    rows = baseline.train_texts(m)
    vocab = baseline_spark.vocabulary(baseline_spark.read_split(spark, m, "train"), rows)
    model = baseline_spark.classifier(c, rows, m.num_labels).fit(
        baseline_spark.vectors(baseline_spark.read_split(spark, m, "train"), vocab))
    test = baseline_spark.vectors(baseline_spark.read_split(spark, m, "test"), vocab, keep=("text",))
    scored = model.transform(test).select("text", "prediction")
    return {r["text"]: int(r["prediction"]) for r in scored.collect()}


@pytest.mark.slow
@pytest.mark.parametrize("data", ["topics", "two_topics"])
def test_the_driver_and_spark_paths_fit_the_same_model(spark, data, request):
    """Same features, same C, same predictions: at least 98% of the test rows identical, accuracy within a
    point (both fit to the optimum, each with its own optimiser and stopping rule)."""
    from torchloom import baseline

    m = request.getfixturevalue(data)
    driver = baseline.fit_and_score(None, m, ["val", "test"], engine="driver")
    on_spark = baseline.fit_and_score(spark, m, ["val", "test"], engine="spark")
    assert on_spark["engine"] == "spark" and on_spark["num_features"] == driver["num_features"]
    assert on_spark["C"] == driver["C"], (driver["grid"], on_spark["grid"])
    for split in ("val", "test"):
        assert abs(on_spark["splits"][split]["accuracy"] - driver["splits"][split]["accuracy"]) <= 0.01
    mine, theirs = driver_predictions(m, driver["C"]), spark_predictions(spark, m, driver["C"])
    assert theirs.keys() == mine.keys()
    same = sum(theirs[t] == mine[t] for t in mine) / len(mine)
    assert same >= 0.98, same


def comparison_with(transformer_accuracy: float, baseline_accuracy: float, split: str = "test") -> dict:
    from torchloom.evaluate.baseline import comparison

    stored = {"name": "TF-IDF + logistic regression", "description": "d", "seconds": 1.0,
              "splits": {split: {"n": 10, "accuracy": baseline_accuracy, "macro_f1": baseline_accuracy}}}
    return comparison({"accuracy": transformer_accuracy, "macro_f1": transformer_accuracy}, stored, split)


def test_the_verdict_names_the_likely_cause_only_when_the_transformer_does_not_win(tmp_path):
    from torchloom.evaluate.baseline import verdict

    # every text reaches max_length (min_len = max_len): all truncated
    write_synthetic_dataset(tmp_path / "cut", rows={"train": 8, "test": 8}, min_len=24, max_len=24)
    write_synthetic_dataset(tmp_path / "whole", rows={"train": 8, "test": 8}, min_len=4, max_len=12)
    cut, whole = read_manifest(tmp_path / "cut"), read_manifest(tmp_path / "whole")
    assert verdict(comparison_with(0.91, 0.90), cut, None) is None  # it won: nothing to say
    line = verdict(comparison_with(0.85, 0.90), cut, None)
    assert line.startswith("the transformer trails the TF-IDF + logistic regression baseline on test"
                           " (accuracy 0.8500 against 0.9000); likely cause: truncation: 100% of the test texts")
    assert "\n" not in line
    assert "ties with" in verdict(comparison_with(0.9, 0.9), cut, None)
    still_improving = {"steps": 40, "best_step": 40, "stopped_early": False, "epochs": 2.0, "train_s": 60.0}
    line = verdict(comparison_with(0.85, 0.90), whole, still_improving)
    assert "too few epochs: validation was still improving at the last step of 2 epochs" in line
    assert "--train.epochs 4 or a time, --train.budget 2h (~30 s an epoch here)" in line  # what to do, and its cost
    plateaued = {"steps": 40, "best_step": 20, "stopped_early": True, "epochs": 4.0, "train_s": 100.0}
    line = verdict(comparison_with(0.85, 0.90), whole, plateaued)
    assert "likely cause: the baseline suits this data: 4 epochs, stopped once validation stopped improving," in line
    assert "a larger pretrained model (--model.path), more labelled rows, or torchloom tune" in line


def test_the_tasks_features_are_scikit_learns(monkeypatch):
    """The Spark path's tasks (baseline/features.py) count terms in partial sums (a task hands its sums on every
    FLUSH_TERMS distinct terms) and vectorise over the chosen vocabulary: summed, the counts give TfidfVectorizer's
    vocabulary and idf, and the vectors are its vectors, a text without a known term the zero vector."""
    import pyarrow as pa

    from torchloom.baseline import driver as baseline_driver
    from torchloom.baseline import features

    texts, _ = topic_texts(300, np.random.default_rng(3))
    texts += ["Ünïcode wörds and 数字 1234 x", "", "?!", "s0x1 s0x1 s0x1 s0x2"]
    batches = [pa.RecordBatch.from_pydict({"text": texts[i:i + 64]}) for i in range(0, len(texts), 64)]
    assert len(list(features.term_stats(iter(batches)))) == 1  # well within FLUSH_TERMS: held to the end
    monkeypatch.setattr(features, "FLUSH_TERMS", 50)
    partial = list(features.term_stats(iter(batches)))
    assert len(partial) == len(batches)  # past it after every batch: handed on as it went
    df, total = {}, {}
    for batch in partial:
        for term, d, t in zip(*(batch.column(c).to_pylist() for c in ("term", "df", "total"))):
            df[term], total[term] = df.get(term, 0) + d, total.get(term, 0) + t
    vec = baseline_driver.vectorizer().fit(texts)
    terms = sorted(t for t in df if df[t] >= 2)  # fewer than MAX_FEATURES: all of them
    assert terms == sorted(vec.vocabulary_, key=vec.vocabulary_.get)
    idf = features.idf(np.array([df[t] for t in terms]), len(texts))
    np.testing.assert_allclose(idf, vec.idf_)
    mine = features.vectors(texts, {t: i for i, t in enumerate(terms)}, idf)
    theirs = vec.transform(texts)
    np.testing.assert_allclose(mine.toarray(), theirs.toarray(), atol=1e-12)
    assert mine[len(texts) - 2].nnz == 0 and mine[len(texts) - 3].nnz == 0
    assert all(np.all(np.diff(mine.indices[a:b]) > 0) for a, b in zip(mine.indptr[:-1], mine.indptr[1:]))


@pytest.mark.slow
def test_past_the_grid_line_c_is_chosen_on_a_sample_and_every_train_text_fitted(spark, topics, monkeypatch):
    """Past GRID_TEXTS the Spark path chooses C on a sample (the same texts every time, about GRID_TEXTS of them),
    says so, and fits that C on every train text; past VOCAB_TEXTS the vocabulary is counted on a sample, and said;
    the vocabulary keeps the MAX_FEATURES most frequent terms."""
    from sklearn.feature_extraction.text import CountVectorizer

    from torchloom import baseline
    from torchloom.baseline import driver as baseline_driver
    from torchloom.baseline import model as baseline_model
    from torchloom.baseline import spark as baseline_spark

    train = baseline_spark.read_split(spark, topics, "train")
    picked = [sorted(r["text"] for r in baseline_spark.grid_sample(train, 400, 150).collect()) for _ in range(2)]
    assert picked[0] == picked[1] and 90 <= len(picked[0]) <= 220, len(picked[0])

    monkeypatch.setattr(baseline_spark, "GRID_TEXTS", 150)
    monkeypatch.setattr(baseline_spark, "GRID_VAL_TEXTS", 100)
    sampled = baseline.fit_and_score(spark, topics, ["val", "test"], engine="spark")
    driver = baseline.fit_and_score(None, topics, ["val", "test"], engine="driver")
    assert sampled["train_rows"] == 400 and "on a sample" in sampled["C_from"], sampled["C_from"]
    assert 90 <= int(re.search(r"([\d,]+) train", sampled["C_from"])[1]) <= 220
    assert [g["C"] for g in sampled["grid"]] == list(baseline.C_GRID)
    assert "chosen on val, on a sample" in baseline.summary_line(sampled)
    assert sum(map(sum, sampled["splits"]["test"]["confusion_matrix"])) == 400  # every test text scored
    assert abs(sampled["splits"]["test"]["accuracy"] - driver["splits"]["test"]["accuracy"]) <= 0.05
    assert "vocabulary_texts" not in sampled and "counted on" not in baseline.summary_line(sampled)

    monkeypatch.setattr(baseline_spark, "VOCAB_TEXTS", 250)
    counted = baseline.fit_and_score(spark, topics, ["test"], engine="spark")
    assert 170 <= counted["vocabulary_texts"] <= 330 and counted["num_features"] < sampled["num_features"]
    assert f"counted on {counted['vocabulary_texts']:,} train texts" in baseline.summary_line(counted)
    assert abs(counted["splits"]["test"]["accuracy"] - driver["splits"]["test"]["accuracy"]) <= 0.08

    monkeypatch.setattr(baseline_model, "MAX_FEATURES", 30)
    terms, _ = baseline_spark.vocabulary(train, 400)
    texts, _ = baseline_driver.read_split(topics, "train")
    counts = CountVectorizer(token_pattern=baseline_model.TOKEN_PATTERN, ngram_range=(1, 2)).fit(texts)
    x = counts.transform(texts)
    total = dict(zip(counts.get_feature_names_out(), np.asarray(x.sum(0)).ravel()))
    df = dict(zip(counts.get_feature_names_out(), np.asarray((x > 0).sum(0)).ravel()))
    assert len(terms) == 30 and terms == sorted(terms)
    left_out = [total[t] for t in total if df[t] >= 2 and t not in set(terms)]
    assert min(total[t] for t in terms) >= max(left_out)
