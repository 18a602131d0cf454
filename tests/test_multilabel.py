"""Multi-label runs end to end (issue 62): a JSON lines file whose labels are lists of tags, with the defaults
(data.task auto), through `torchloom run` in this process (the shared SparkSession, a tiny random model): prepare
reads the tags and stratifies the split on each row's rarest tag, training runs a sigmoid head with binary
cross-entropy, export chooses the thresholds on val, evaluate reports the tagger's metrics, and predict, file
scoring and the REST server answer with the tags over their thresholds. Bad tag columns are one line with
nothing written. About 60 s on 2 cores (one run, one server)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from torchloom import cli
from torchloom.manifest import read as read_manifest

pytest.importorskip("pyspark")

# tags as paths (data.label_path_delimiter "/"): five leaves under three parents
WORDS = {"news/sport": "match goal team league", "news/money": "bank market shares profit",
         "arts/film": "movie actor cinema scene", "arts/tech": "software chip computer network",
         "home/food": "recipe cook kitchen taste"}
UNTAGGED = 3


def tagged_rows(n: int, seed: int = 0) -> list[dict]:
    """Texts whose words give their tags away: one to three tags a text, and a few texts with none."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        chosen = rng.sample(list(WORDS), rng.choice([1, 1, 2, 2, 3]))
        text = " ".join(rng.choice(WORDS[t].split()) for t in chosen for _ in range(3)) + f" row {i}"
        rows.append({"text": text, "tags": [t.replace("/", " / ") if i % 4 == 0 else t for t in chosen]})
    return rows + [{"text": f"nothing here at all {i}", "tags": []} for i in range(UNTAGGED)]


def write_jsonl(path: Path, rows: list[dict], column: str = "tags") -> Path:
    path.write_text("".join(json.dumps({"text": r["text"], column: r["tags"]}) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def tagged_run(tiny_model_dir, tmp_path_factory) -> tuple[Path, list[dict]]:
    tmp = tmp_path_factory.mktemp("multilabel")
    rows = tagged_rows(600)  # val and test: the 100 texts a monitoring profile needs
    data = write_jsonl(tmp / "tags.jsonl", rows)
    out = tmp / "run"
    code = cli.main(["run", "--data.path", str(data), "--data.label_column", "tags", "--model.path", tiny_model_dir,
                     "--output.dir", str(out), "--engine.workers", "1", "--train.epochs", "6", "--train.lr", "3e-3",
                     "--train.batch_size", "16", "--tracking.enabled", "false", "--data.label_path_delimiter", "/"])
    assert code == 0
    return out, rows


def test_prepare_reads_tag_lists_and_keeps_every_tag_in_every_split(tagged_run):
    out, rows = tagged_run
    m = read_manifest(out)
    assert m.task == "multi_label" and m.labels == sorted(WORDS)
    assert m.counts["rows_rejected"]["no_tags"] == UNTAGGED  # set aside with a reason, counted
    for name in ("train", "val", "test"):  # stratified on the rarest tag: every tag in every split
        assert all(n > 0 for n in m.tags["per_split"][name].values()), (name, m.tags)
        assert m.splits[name].per_class == m.tags["per_split"][name]
    assert 1.5 < m.tags["cardinality"]["train"] < 2.2
    truth = {r["text"]: sorted(t.replace(" / ", "/") for t in r["tags"]) for r in rows}  # paths normalised
    table = pq.read_table(m.shard_uri(m.splits["train"].shards[0]), columns=["text", "label_id"])
    assert str(table.schema.field("label_id").type) == "list<element: int32>"  # each row its tags' ids
    for text, ids in zip(table.column("text").to_pylist(), table.column("label_id").to_pylist(), strict=True):
        assert [m.labels[i] for i in ids] == truth[text] and ids == sorted(ids)


def test_the_tagger_is_exported_with_thresholds_chosen_on_val_and_reported(tagged_run):
    out, _ = tagged_run
    info = json.loads((out / "model" / "torchloom.json").read_text())
    assert info["task"] == "multi_label" and info["thresholds"]["at_least_one"] is True
    assert 0.05 <= info["thresholds"]["default"] <= 0.95
    config = json.loads((out / "model" / "config.json").read_text())
    assert config["problem_type"] == "multi_label_classification"  # from_pretrained users get sigmoid
    report = json.loads((out / "report.json").read_text())
    metrics = report["metrics"]
    assert metrics["task"] == "multi_label" and set(metrics["per_class"]) == set(WORDS)
    for key in ("micro_f1", "macro_f1", "samples_f1", "hamming_loss", "subset_accuracy"):
        assert 0.0 <= metrics[key] <= 1.0
    assert metrics["micro_f1"] > 0.5, metrics  # the words give the tags away
    assert {"thresholds_plot", "cooccurrence_plot"} <= set(report["files"])
    assert "## Per tag" in (out / "report.md").read_text() and "## Per level" in (out / "report.md").read_text()
    top, leaves = metrics["levels"]  # the parents derived from the predicted leaves, scored too
    assert (top["level"], top["labels"], leaves["labels"]) == (1, 3, 5) and leaves["micro_f1"] == metrics["micro_f1"]
    assert top["micro_f1"] >= leaves["micro_f1"] - 0.05 and metrics["level1_macro_f1"] == top["macro_f1"]
    wrong = [json.loads(line) for line in (out / "misclassified.jsonl").read_text().splitlines()]
    assert all(isinstance(w["true"], list) and isinstance(w["predicted"], list) for w in wrong)


def test_the_one_vs_rest_baseline_is_fitted_and_the_shipped_mix_is_never_worse_on_val(tagged_run):
    out, _ = tagged_run
    baseline = json.loads((out / "baseline.json").read_text())
    assert baseline["task"] == "multi_label" and baseline["name"] == "TF-IDF + one-vs-rest logistic regression"
    assert baseline["splits"]["test"]["micro_f1"] > 0.8, baseline["splits"]  # the words give the tags away
    assert [g["C"] for g in baseline["grid"]] == [1.0, 10.0, 100.0, 1000.0]
    info = json.loads((out / "model" / "torchloom.json").read_text())
    combine = info["combine"]
    val = combine["val_micro_f1"]
    assert combine["metric"] == "micro_f1" and val["shipped"] >= max(val["transformer"], val["baseline"]) - 1e-9
    assert combine["weight"] == 1.0 or (out / "model" / "baseline" / "terms.json").is_file()
    report = json.loads((out / "report.json").read_text())
    cmp = report["baseline"]
    assert cmp["metric"] == "micro_f1" and cmp["micro_f1"] == baseline["splits"]["test"]["micro_f1"]
    if combine["weight"] < 1.0:  # the shipped mix, and the transformer alone beside it
        assert report["metrics"]["transformer"]["micro_f1"] == cmp["transformer_micro_f1"]
        assert cmp["shipped"]["micro_f1"] == report["metrics"]["micro_f1"]
    assert "| model | micro F1 | subset accuracy | macro F1 |" in (out / "report.md").read_text()
    # issue 78, item 5: which side wins each tag, from both sides' per-tag F1 on the same rows
    transformer = (report["metrics"].get("transformer") or report["metrics"])["per_class"]
    assert set(cmp["per_tag"]) == {t for t, c in transformer.items() if c["support"]}
    for tag, row in cmp["per_tag"].items():
        assert row["transformer_f1"] == transformer[tag]["f1"]
        assert row["baseline_f1"] == baseline["splits"]["test"]["per_class"][tag]["f1"]
        gap = row["transformer_f1"] - row["baseline_f1"]
        assert row["winner"] == ("tie" if abs(gap) <= 0.01 else "transformer" if gap > 0 else "baseline")
    md = (out / "report.md").read_text()
    assert "### Per tag: which side wins" in md and f"of {len(cmp['per_tag'])} tags" in md


def test_the_verdict_says_plainly_when_the_transformer_is_not_worth_its_cost(tagged_run):
    """Issue 78, item 5: a transformer that trails the baseline on micro- and macro-F1 (or is not run at all by
    the shipped model) gets the plain line; one that wins either gets none of it."""
    from torchloom.evaluate.baseline import not_worth_it, verdict

    out, _ = tagged_run
    m = read_manifest(out)
    cmp = json.loads((out / "report.json").read_text())["baseline"]
    trailing = {**cmp, "micro_f1_gain": -0.05, "macro_f1_gain": -0.10, "seconds": 7.0}
    line = verdict(trailing, m, None)
    assert not_worth_it(trailing) and "not worth its cost" in line and "fitted in 7 s" in line
    assert "macro-F1 trails too" in line and "tags' F1, the baseline" in line
    unused = {**trailing, "macro_f1_gain": 0.02, "shipped": {**(cmp.get("shipped") or {}), "weight": 0.0,
                                                            "micro_f1": cmp["micro_f1"]}}
    assert not_worth_it(unused) and "the shipped model is the baseline alone" in verdict(unused, m, None)
    rare_tags_won = {**trailing, "macro_f1_gain": 0.02, "shipped": None}
    assert not not_worth_it(rare_tags_won) and "not worth" not in verdict(rare_tags_won, m, None)
    assert verdict({**trailing, "micro_f1_gain": 0.01}, m, None) is None


def test_predict_files_and_the_server_answer_with_tags_over_their_thresholds(tagged_run, tmp_path):
    from support.served import Server

    from torchloom.batch.files import predict_local
    from torchloom.model.predict import Predictor

    out, _ = tagged_run
    texts = ["bank shares profit goal team league", "recipe cook kitchen"]
    got = Predictor(str(out / "model")).predict(texts)
    for p in got:
        probs = p["probabilities"]
        assert abs(sum(probs.values()) - 1.0) > 1e-3 or len(p["labels"]) > 1  # sigmoids, not a softmax
        assert p["labels"] and p["labels"][0] == p["label"]  # the most probable first; at least one
        assert sorted(p["labels"], key=lambda t: -probs[t]) == p["labels"]
        assert p["parents"] == list(dict.fromkeys(t.split("/")[0] for t in p["labels"]))
    inputs = tmp_path / "in.jsonl"
    inputs.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    predict_local(str(out / "model"), str(inputs), str(tmp_path / "out.parquet"))
    scored = pq.read_table(tmp_path / "out.parquet").to_pylist()
    assert [r["labels"] for r in scored] == [p["labels"] for p in got]
    server = Server(str(out / "model"), "--device", "cpu", log_dir=tmp_path)
    try:
        r = server.client.post("/v1/predict", json={"texts": texts})
        assert r.status_code == 200, r.text
        assert [(p["labels"], p["parents"]) for p in r.json()["predictions"]] == [(p["labels"], p["parents"])
                                                                                  for p in got]
        tei = server.client.post("/predict", json={"inputs": texts[0]})  # TEI's route: each tag's sigmoid too
        assert tei.status_code == 200, tei.text
        assert {s["label"]: s["score"] for s in tei.json()} == pytest.approx(got[0]["probabilities"], abs=1e-5)
    finally:
        assert server.terminate() == 0, server.stderr()[-3000:]


def test_a_tagger_is_monitored_by_its_top_tag_and_its_tags_a_text(tagged_run, tmp_path):
    from torchloom.monitor.batch import monitor_file

    out, rows = tagged_run
    profile = json.loads((out / "model" / "monitor" / "profile.json").read_text())
    assert profile["task"] == "multi_label" and profile["texts"] >= 100
    assert len(profile["reference"]["tags"]) == profile["texts"] and 0 < profile["accuracy"] <= 1
    window = tmp_path / "window.jsonl"  # texts of one tag alone: its share jumps, fewer tags a text
    window.write_text("".join(json.dumps({"text": r["text"], "tags": r["tags"]}) + "\n" for r in rows
                              if [t.replace(" / ", "/") for t in r["tags"]] == ["home/food"]))
    result = monitor_file(str(out / "model"), str(window), str(tmp_path / "report"), labels_column="tags",
                          say=lambda _: None)
    shares, per = result["tag_shares"], result["tags_per_text"]
    assert shares["home/food"]["window"] > shares["home/food"]["reference"] and per["window"] < per["reference"]
    assert result["labelled"] > 0 and 0 <= result["accuracy"] <= 1 and "classes" in result["drifted"]
    assert "Tags a text:" in (tmp_path / "report" / "report.md").read_text()


def test_export_top_k_predicts_each_text_s_k_most_probable_tags(tagged_run, tiny_model_dir):
    from torchloom.model.predict import Predictor

    out, _ = tagged_run  # the last of this module's tests on the run: it exports the model again
    code = cli.main(["export", "--output.dir", str(out), "--model.path", tiny_model_dir, "--export.top_k", "2",
                     "--export.format", "onnx", "--tracking.enabled", "false"])
    assert code == 0
    info = json.loads((out / "model" / "torchloom.json").read_text())
    assert info["thresholds"]["top_k"] == 2 and (out / "model" / info["onnx"]["file"]).is_file()  # its gate passed
    texts = ["bank shares", "recipe cook kitchen goal team", "nothing"]
    got = Predictor(str(out / "model")).predict(texts)
    for p in got:
        assert p["labels"] == sorted(p["probabilities"], key=lambda t: -p["probabilities"][t])[:2]
    onnx = Predictor(str(out / "model"), runtime="onnx").predict(texts)  # the ONNX graph's logits, sigmoids too
    assert [p["labels"] for p in onnx] == [p["labels"] for p in got]


@pytest.mark.parametrize(("rows", "flags", "message"), [
    ([{"text": "a b c", "tags": ["x"]}, {"text": "d e f", "tags": "y"}] * 20, [],
     "some labels are lists of tags"),
    ([{"text": f"a b {i}", "tags": "x,y" if i % 2 else "z"} for i in range(40)], ["--data.label_delimiter", "|"],
     "data.label_delimiter '|': occurs in none of"),
])
def test_bad_tag_columns_are_one_line_and_nothing_is_written(spark, tiny_model_dir, tmp_path, capsys, rows, flags,
                                                              message):
    data = write_jsonl(tmp_path / "bad.jsonl", rows)
    out = tmp_path / "run"
    code = cli.main(["prepare", "--data.path", str(data), "--data.label_column", "tags", "--model.path",
                     tiny_model_dir, "--output.dir", str(out), *flags])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err, err
    assert not (out / "data").exists() or not any((out / "data").iterdir())


def test_a_number_column_asked_to_hold_tags_is_one_line(spark, tiny_model_dir, tmp_path, capsys):
    import pyarrow as pa

    data = tmp_path / "numbers.parquet"
    pq.write_table(pa.table({"text": [f"a b {i}" for i in range(30)], "label": np.arange(30) % 3}), data)
    code = cli.main(["prepare", "--data.path", str(data), "--data.task", "multi_label", "--model.path",
                     tiny_model_dir, "--output.dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and "holds numbers (bigint) where tags belong" in err and "Traceback" not in err, err


def test_one_flag_column_per_tag_is_a_multi_label_run(spark, tiny_model_dir, tmp_path, capsys):
    import pyarrow as pa

    rng = random.Random(3)
    n = 90
    flags = {t: [rng.random() < 0.4 for _ in range(n)] for t in ("sport", "money", "film")}
    texts = [" ".join(t for t in flags if flags[t][i]) + f" text {i}" for i in range(n)]
    table = pa.table({"body": texts, "sport": [int(v) for v in flags["sport"]], "money": flags["money"],
                      "film": [("1" if v else "0") for v in flags["film"]]})
    table = table.set_column(3, "film", pa.array([*table.column("film").to_pylist()[:-1], "maybe"]))
    pq.write_table(table, tmp_path / "flags.parquet")
    out = tmp_path / "run"
    code = cli.main(["prepare", "--data.path", str(tmp_path / "flags.parquet"), "--data.text_column", "body",
                     "--data.label_columns", "sport, money,film", "--model.path", tiny_model_dir, "--output.dir",
                     str(out)])
    assert code == 0
    m = read_manifest(out)
    assert m.task == "multi_label" and m.labels == ["film", "money", "sport"]
    assert m.inputs["label_columns"] == ["sport", "money", "film"]
    none = sum(not any(flags[t][i] for t in flags) for i in range(n - 1))
    rejected = m.counts["rows_rejected"]
    assert rejected["invalid_tags"] == 1 and rejected["no_tags"] == none, rejected  # "maybe" is no flag
    kept = {t: sum(flags[t][:n - 1]) for t in flags}
    assert {t: sum(split.per_class[t] for split in m.splits.values()) for t in kept} == kept
    code = cli.main(["prepare", "--data.path", str(tmp_path / "flags.parquet"), "--data.text_column", "body",
                     "--data.label_columns", "sport,nope", "--model.path", tiny_model_dir, "--output.dir",
                     str(tmp_path / "other")])
    err = capsys.readouterr().err
    assert code == 2 and "no column 'nope'" in err and "--data.label_columns" in err and "Traceback" not in err, err
    assert not (tmp_path / "other" / "data").exists()


def many_tag_rows(tags: int, texts: int, seed: int = 0) -> tuple[list[str], list[dict]]:
    """`tags` tags, each with a made-up word of its own (syllables: WordPiece keeps them apart), and texts of one
    to three tags whose words give them away; every tag in at least a few texts."""
    rng = random.Random(seed)
    syllables = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
    names = [f"tag-{i:03d}" for i in range(tags)]
    n = len(syllables)  # 70: two syllables name up to 4,900 tags apart, a third makes the word long
    words = {name: syllables[i % n] + syllables[i // n % n] + syllables[(13 * i + 5) % n]
             for i, name in enumerate(names)}
    rows = []
    for i in range(texts):
        chosen = [names[i % tags], *rng.sample(names, rng.choice([0, 0, 1, 2]))]
        chosen = list(dict.fromkeys(chosen))
        rows.append({"text": " ".join(words[t] for t in chosen for _ in range(2)) + f" note {i}", "tags": chosen})
    return names, rows


def test_a_run_with_520_tags_prepares_trains_exports_serves_and_monitors(tiny_model_dir, tmp_path):
    """Issue 78, item 4: more tags than an int64 has bits. A row's tags are stored as the list of their ids, so
    prepare (Spark), training (the local engine's ranks), export (thresholds, the one-vs-rest baseline and the
    mix), evaluate, the server and the monitor take 520 tags as they take 5, and a row's label costs its own
    tags, not the vocabulary's. About 40 s on 2 cores (a tiny model, one epoch)."""
    from support.served import Server

    from torchloom.monitor.batch import monitor_file

    names, rows = many_tag_rows(520, 2600)
    data = write_jsonl(tmp_path / "tags.jsonl", rows)
    out = tmp_path / "run"
    code = cli.main(["run", "--data.path", str(data), "--data.label_column", "tags", "--model.path", tiny_model_dir,
                     "--output.dir", str(out), "--engine.workers", "2", "--train.epochs", "1", "--train.lr", "3e-3",
                     "--train.batch_size", "32", "--tracking.enabled", "false"])
    assert code == 0
    m = read_manifest(out)
    assert m.task == "multi_label" and m.labels == names and sum(m.tags["per_split"]["train"].values()) > 2000
    table = pq.read_table(m.shard_uri(m.splits["train"].shards[0]), columns=["text", "label_id"])
    truth = {r["text"]: sorted(names.index(t) for t in r["tags"]) for r in rows}
    assert str(table.schema.field("label_id").type) == "list<element: int32>"
    assert all(ids == truth[text] for text, ids in zip(table.column("text").to_pylist(),
                                                       table.column("label_id").to_pylist(), strict=True))
    assert any(max(ids) >= 63 for ids in table.column("label_id").to_pylist())  # past an int64's bits
    # a row's stored label is its tags, not the vocabulary: the column's ids are the tags the rows hold
    assert len(table.column("label_id").combine_chunks().values) == sum(len(truth[t]) for t in
                                                                          table.column("text").to_pylist())
    info = json.loads((out / "model" / "torchloom.json").read_text())
    assert info["task"] == "multi_label" and len(info["labels"]) == 520
    assert len(json.loads((out / "model" / "config.json").read_text())["id2label"]) == 520
    report = json.loads((out / "report.json").read_text())
    assert report["metrics"]["task"] == "multi_label" and len(report["metrics"]["per_class"]) == 520
    baseline = json.loads((out / "baseline.json").read_text())
    assert baseline["splits"]["test"]["micro_f1"] > 0.5  # each tag's word gives it away to the one-vs-rest side
    train = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in train if r.get("kind") == "eval"]
    assert val and 0.05 <= val[-1]["threshold"] <= 0.95 and "micro_f1" in val[-1]  # chosen on val, as export does
    texts = [rows[0]["text"], rows[600]["text"]]
    server = Server(str(out / "model"), "--device", "cpu", log_dir=tmp_path)
    try:
        r = server.client.post("/v1/predict", json={"texts": texts})
        assert r.status_code == 200, r.text
        for p in r.json()["predictions"]:
            assert p["labels"] and set(p["labels"]) <= set(names) and len(p["probabilities"]) == 520
    finally:
        assert server.terminate() == 0, server.stderr()[-3000:]
    window = tmp_path / "window.jsonl"  # one tag's texts alone: its share jumps
    window.write_text("".join(json.dumps({"text": r["text"], "tags": r["tags"]}) + "\n" for r in rows
                              if r["tags"][0] == "tag-007"))
    result = monitor_file(str(out / "model"), str(window), str(tmp_path / "report"), labels_column="tags",
                          say=lambda _: None)
    assert len(result["tag_shares"]) == 520 and result["labelled"] > 0
    assert result["tag_shares"]["tag-007"]["window"] > result["tag_shares"]["tag-007"]["reference"]
