"""How long texts are cut (text/truncation.py): the same ids in prepare's shards and in every inference path."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from torchloom.config.schema import Config
from torchloom.text.truncation import cut, head_tokens, special_layout, window_starts, windows

pytest.importorskip("pyspark")


def test_cut_keeps_the_head_and_the_tail_with_their_special_tokens():
    ids = ["CLS", *range(1, 31), "SEP"]  # 32 tokens
    assert cut(ids, 40, "head_tail") == ids and cut(ids, 40, "head") == ids  # short enough: whole
    assert head_tokens(16) == 4
    assert cut(ids, 16, "head_tail") == ["CLS", 1, 2, 3, *range(20, 31), "SEP"]
    assert cut(ids, 16, "head") == ["CLS", *range(1, 15), "SEP"]
    with pytest.raises(ValueError, match="unknown truncation strategy"):
        cut(ids, 16, "middle")


def test_windows_cover_the_text_end_to_end_no_more_than_stride_apart_and_at_most_max_chunks():
    assert window_starts(10, 10, 4, 0) == [0]  # fits: one window
    assert window_starts(11, 10, 4, 0) == [0, 1]  # the last window ends at the text's end
    assert window_starts(30, 10, 5, 0) == [0, 5, 10, 15, 20]
    starts = window_starts(29, 10, 5, 0)
    assert starts[0] == 0 and starts[-1] == 19 and max(b - a for a, b in zip(starts, starts[1:])) <= 5
    assert window_starts(1000, 10, 5, 4) == [0, 330, 660, 990]  # capped: spread evenly from start to end
    ids = ["CLS", *range(1, 13), "SEP"]  # 12 text tokens
    assert windows(ids, 14, 3, 0) == [ids]
    assert windows(ids, 8, 4, 0) == [["CLS", 1, 2, 3, 4, 5, 6, "SEP"], ["CLS", 4, 5, 6, 7, 8, 9, "SEP"],
                                     ["CLS", 7, 8, 9, 10, 11, 12, "SEP"]]
    assert windows([*range(1, 13), "EOS"], 7, 6, 0, front=0, back=1) == [[1, 2, 3, 4, 5, 6, "EOS"],
                                                                          [7, 8, 9, 10, 11, 12, "EOS"]]
    assert special_layout([1, 0, 0, 1]) == (1, 1) and special_layout([0, 0, 1]) == (0, 1)


def long_texts(path, count=12):
    """Texts from 8 words to ~1,300 ending in a distinct word, alternating labels a and b."""
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda", "mu"]
    path.write_text("text,label\n" + "".join(
        f"{' '.join(words[(i + j) % len(words)] for j in range(8 + i * i * 10))} end{i},{'ab'[i % 2]}\n"
        for i in range(count)))
    return path


@pytest.mark.parametrize("strategy", ["head", "head_tail"])
def test_prepare_and_the_exported_model_cut_long_texts_alike(spark, tiny_model_dir, tmp_path, strategy):
    from torchloom.etl.prepare import prepare
    from torchloom.model.build import build_classifier
    from torchloom.model.export import export_model
    from torchloom.model.predict import Predictor

    # up to ~1,300 words: longer than the prefix the head shortcut encodes first ((16 + 64) x 6 chars)
    src = long_texts(tmp_path / "long.csv")
    cfg = Config()
    cfg.data.path, cfg.model.path = str(src), tiny_model_dir
    cfg.prepare.max_length, cfg.prepare.truncation = 16, strategy
    cfg.prepare.val_fraction = cfg.prepare.test_fraction = 0.0
    m = prepare(cfg, str(tmp_path / "data"), spark=spark)
    assert m.tokenizer["truncation"] == strategy
    rows = [r for s in m.splits["train"].shards for r in pq.read_table(m.shard_uri(s)).to_pylist()]
    assert sum(len(r["input_ids"]) == 16 for r in rows) >= 8  # most texts were cut

    model = build_classifier(tiny_model_dir, m.labels)
    out = export_model(model, tiny_model_dir, m.labels, str(tmp_path / "model"),
                       extra_info={"max_length": 16, "truncation": strategy})
    predictor = Predictor(out)
    assert [f["input_ids"] for f in predictor.encode([r["text"] for r in rows])] == [r["input_ids"] for r in rows]
    whole = [predictor.tokenizer(r["text"])["input_ids"] for r in rows]
    ends_kept = [w[-2] == r["input_ids"][-2] for w, r in zip(whole, rows) if len(w) > 16]
    assert ends_kept and all(ends_kept) == (strategy == "head_tail")  # the text's last word: kept by head_tail


def pad_windows(rows):
    import torch

    width = max(len(r["input_ids"]) for r in rows)
    ids = torch.tensor([r["input_ids"] + [0] * (width - len(r["input_ids"])) for r in rows])
    return {"input_ids": ids, "attention_mask": (torch.arange(width) < torch.tensor(
        [len(r["input_ids"]) for r in rows])[:, None]).long()}


def test_a_chunked_text_scores_the_same_in_evaluate_predict_serve_and_spark_batch(spark, tiny_model_dir, tmp_path):
    """truncation chunks: prepare writes each text's windows (the ids the exported model's tokenizer cuts
    too); training data, the baseline and evaluation count texts; evaluate (score_split), predict, the
    REST server and Spark batch predict all score a text as the softmax of its windows' mean logits."""
    import json

    import numpy as np
    import pyarrow.dataset as ds
    import torch

    from torchloom.baseline import driver as baseline_driver
    from torchloom.baseline import spark as baseline_spark
    from torchloom.batch.spark import predict_spark
    from torchloom.data.texts import texts_at
    from torchloom.etl.prepare import prepare
    from torchloom.evaluate.run import score_split
    from torchloom.model.build import build_classifier
    from torchloom.model.export import export_model
    from torchloom.model.predict import Predictor

    cfg = Config()
    cfg.data.path, cfg.model.path = str(long_texts(tmp_path / "long.csv")), tiny_model_dir
    cfg.prepare.max_length, cfg.prepare.truncation, cfg.prepare.max_chunks = 16, "chunks", 6
    cfg.prepare.val_fraction = cfg.prepare.test_fraction = 0.0
    cfg.output.dir, cfg.eval.split = str(tmp_path / "run"), "train"
    m = prepare(cfg, str(tmp_path / "run" / "data"), spark=spark)
    train = m.splits["train"]
    assert m.tokenizer["truncation"] == "chunks" and m.tokenizer["stride"] == 10  # 3/4 of 14 text tokens
    assert train.documents == 12 and train.rows > 40 and sum(train.per_class.values()) == train.rows
    rows = [r for s in train.shards for r in pq.read_table(m.shard_uri(s)).to_pylist()]
    by_text: dict[str, list] = {}
    for r in rows:  # a text's windows are consecutive rows, chunk 0 first
        assert r["chunk"] == len(by_text.setdefault(r["text"], [])) and len(r["input_ids"]) <= 16
        by_text[r["text"]].append(r["input_ids"])
    assert max(len(w) for w in by_text.values()) == 6  # max_chunks caps the longest texts
    # the baseline sees each text once, on either path
    assert baseline_spark.read_split(spark, m, "train").count() == 12
    assert len(baseline_driver.read_split(m, "train")[0]) == 12

    torch.manual_seed(0)
    model = build_classifier(tiny_model_dir, m.labels)
    with torch.no_grad():  # a random BERT's windows look alike: centre and scale the head on them
        pooled = model.eval().bert(**pad_windows(rows)).pooler_output
        model.classifier.weight.div_(pooled.std(0).clamp_min(1e-6)).mul_(2)
        model.classifier.bias.copy_(-model.classifier.weight @ pooled.mean(0))
    out = export_model(model, tiny_model_dir, m.labels, str(tmp_path / "run" / "model"), extra_info={
        k: m.tokenizer[k] for k in ("max_length", "truncation", "stride", "max_chunks")})
    predictor = Predictor(out)
    texts = list(by_text)
    assert [[w["input_ids"] for w in t] for t in predictor.encode_windows(texts)] == list(by_text.values())

    probs, labels, index = score_split(cfg, out, m)  # evaluate's path: one row per text
    assert len(probs) == 12 and sorted(labels.tolist()) == [0] * 6 + [1] * 6
    ordered = [texts_at(m, "train", {int(i)})[int(i)] for i in index]
    predicted = np.array([[p["probabilities"][lb] for lb in m.labels] for p in predictor.predict(ordered)])
    np.testing.assert_allclose(predicted, probs, atol=1e-5)
    longest = max(texts, key=lambda t: len(by_text[t]))
    with torch.no_grad():
        window_logits = predictor.model(**pad_windows([{"input_ids": w} for w in by_text[longest]])).logits
    mean = torch.softmax(window_logits.mean(0), -1).numpy()
    assert predicted[ordered.index(longest)] == pytest.approx(mean, abs=1e-4)  # padded differently: not bit-equal
    assert abs(window_logits - window_logits.mean(0)).max() > 0.1  # the windows disagree: the mean is no one's

    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(ordered)))
    predict_spark(spark, out, str(src), str(tmp_path / "spark-out"), device="cpu")
    table = ds.dataset(tmp_path / "spark-out", format="parquet").to_table().sort_by([("id", "ascending")])
    spark_probs = np.array([[dict(p)[lb] for lb in m.labels] for p in table.column("probabilities").to_pylist()])
    np.testing.assert_allclose(spark_probs, probs, atol=1e-5)

    pytest.importorskip("onnxruntime")  # the ONNX runtime scores a chunked text the same way
    from torchloom.model.onnx import GateRows, export_onnx

    # this data has only a train split: the gate scores its windows, a text counted once
    export_onnx(out, GateRows("train", [r["input_ids"] for r in rows], np.array([r["label_id"] for r in rows]),
                              np.cumsum([r["chunk"] == 0 for r in rows]) - 1), "onnx")
    onnx_probs = [[p["probabilities"][lb] for lb in m.labels] for p in Predictor(out, runtime="onnx").predict(ordered)]
    np.testing.assert_allclose(onnx_probs, probs, atol=1e-4)  # the head is scaled up: logit noise shows

    from test_serve import Server, httpx

    if httpx is None:
        pytest.skip("the serve extra is not installed")
    server = Server(out, "--device", "cpu", log_dir=tmp_path)
    try:
        answer = server.client.post("/v1/predict", json={"texts": ordered}).json()["predictions"]
    finally:
        assert server.terminate() == 0, server.stderr()[-3000:]
    served = np.array([[p["probabilities"][lb] for lb in m.labels] for p in answer])
    np.testing.assert_allclose(served, probs, atol=1e-5)


def test_max_length_auto_picks_the_shortest_window_holding_the_90th_percentile(tmp_path, tiny_model_dir):
    import json

    import numpy as np

    from torchloom.config import build
    from torchloom.errors import UserError
    from torchloom.etl.lengths import choose_max_length, model_positions
    from torchloom.etl.prepare import prepare

    assert choose_max_length(np.array([20] * 95 + [900] * 5), 512) == 128  # the long 5% are cut
    assert choose_max_length(np.array([100] * 80 + [200] * 20), 512) == 256
    assert choose_max_length(np.array([777] * 10), 512) == 512 and choose_max_length(np.array([777] * 10), 300) == 256
    assert choose_max_length(np.array([50]), 64) == 64  # a model shorter than every choice: its own limit
    assert model_positions(tiny_model_dir) == 512
    (tmp_path / "roberta").mkdir()
    (tmp_path / "roberta" / "config.json").write_text(json.dumps({"model_type": "roberta",
                                                                  "max_position_embeddings": 514}))
    assert model_positions(str(tmp_path / "roberta")) == 512 and model_positions(str(tmp_path)) == 0

    assert build(None, ["--prepare.max_length", "auto"]).prepare.max_length == "auto"
    (tmp_path / "c.toml").write_text('[prepare]\nmax_length = "auto"\n')
    assert build(str(tmp_path / "c.toml"), []).prepare.max_length == "auto"
    with pytest.raises(UserError, match=r'--prepare.max_length: .long. is not an integer or "auto"'):
        build(None, ["--prepare.max_length", "long"])
    cfg = build(None, ["--prepare.max_length", "1024", "--model.path", tiny_model_dir])
    with pytest.raises(UserError, match="1024 is more than the 512 positions of the model"):
        prepare(cfg, str(tmp_path / "data"))  # before any Spark work
    assert not (tmp_path / "data").exists()
