"""How long texts are cut (truncation.py): the same ids in prepare's shards and in every inference path."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from torchloom.config.schema import Config
from torchloom.truncation import cut, head_tokens

pytest.importorskip("pyspark")


def test_cut_keeps_the_head_and_the_tail_with_their_special_tokens():
    ids = ["CLS", *range(1, 31), "SEP"]  # 32 tokens
    assert cut(ids, 40, "head_tail") == ids and cut(ids, 40, "head") == ids  # short enough: whole
    assert head_tokens(16) == 4
    assert cut(ids, 16, "head_tail") == ["CLS", 1, 2, 3, *range(20, 31), "SEP"]
    assert cut(ids, 16, "head") == ["CLS", *range(1, 15), "SEP"]
    with pytest.raises(ValueError, match="unknown truncation strategy"):
        cut(ids, 16, "middle")


@pytest.mark.parametrize("strategy", ["head", "head_tail"])
def test_prepare_and_the_exported_model_cut_long_texts_alike(spark, tiny_model_dir, tmp_path, strategy):
    from torchloom.etl.prepare import prepare
    from torchloom.model.build import build_classifier
    from torchloom.model.export import export_model
    from torchloom.model.predict import Predictor

    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda", "mu"]
    src = tmp_path / "long.csv"
    # from 8 words to ~1,300 (longer than the prefix the head shortcut encodes first: (16 + 64) x 6 chars)
    src.write_text("text,label\n" + "".join(
        f"{' '.join(words[(i + j) % len(words)] for j in range(8 + i * i * 10))} end{i},{'ab'[i % 2]}\n"
        for i in range(12)))
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
