"""train.packing: packed batches give the padded batches' logits, gradients and trained weights (a tiny BERT, fp32,
dropout 0), the loader's rows do not change, and what packing cannot run is refused in one line."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from torchloom.config import build
from torchloom.data.eval_rows import eval_batches
from torchloom.data.loader import ShardedLoader
from torchloom.data.packing import first_fit, pack_batch
from torchloom.data.synthetic import write_synthetic_dataset
from torchloom.errors import UserError
from torchloom.manifest import read as read_manifest
from torchloom.model.build import build_classifier
from torchloom.model.forward import prepared_logits
from torchloom.model.packing import check_packing, packed_logits
from torchloom.model.tiny import write_tiny_model

LABELS = ["a", "b", "c"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("models") / "tiny0", dropout=0.0)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("data") / "data"
    write_synthetic_dataset(d, rows={"train": 61, "val": 21, "test": 9}, rows_per_group=10, rows_per_shard=40,
                            min_len=3, max_len=30)
    return d


def padded(lengths: list[int], seed: int = 0) -> dict[str, torch.Tensor]:
    """A right-padded batch as data.shards.collate gives it: [CLS] first, random tokens after."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(1000, 2000, (n,), generator=g)
        ids[i, 0] = 101
        mask[i, :n] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.arange(len(lengths)) % len(LABELS),
            "index": torch.arange(len(lengths))}


MIXED = [5, 17, 3, 9, 12, 2, 17, 6, 1, 8, 4, 4]


def test_packing_lays_every_sequence_whole_in_fewer_rows():
    batch = padded(MIXED)
    packed = pack_batch(batch)
    width = batch["input_ids"].shape[1]
    assert packed["input_ids"].shape[1] == width and packed["input_ids"].shape[0] < len(MIXED)
    assert int(packed["attention_mask"].sum()) == sum(MIXED)  # real tokens: all there, nothing else marked
    flat_ids, flat_pos = packed["input_ids"].reshape(-1), packed["position_ids"].reshape(-1)
    for i, n in enumerate(MIXED):
        at = int(packed["cls_index"][i])
        assert at // width == (at + n - 1) // width  # never cut across rows
        assert torch.equal(flat_ids[at:at + n], batch["input_ids"][i, :n])
        assert torch.equal(flat_pos[at:at + n], torch.arange(n))
    assert torch.equal(packed["labels"], batch["labels"]) and torch.equal(packed["index"], batch["index"])
    assert torch.equal(packed["lengths"], torch.tensor(MIXED))
    row, offset = first_fit(np.array([3, 3, 3]), 4)  # nothing fits beside another: one row each
    assert row.tolist() == [0, 1, 2] and offset.tolist() == [0, 0, 0]


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_logits_and_gradients_equal_the_padded_ones(tiny, attention):
    model = build_classifier(tiny, LABELS)
    model.config._attn_implementation = attention
    model.eval()  # dropout 0 anyway; eval so the two forwards are the same function
    batch = padded(MIXED, seed=1)
    ref = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    F.cross_entropy(ref, batch["labels"], reduction="sum").backward()
    ref_grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    out = packed_logits(model, model, pack_batch(batch), torch.device("cpu"))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    F.cross_entropy(out, batch["labels"], reduction="sum").backward()
    grads = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
    assert grads.keys() == ref_grads.keys() and len(grads) > 10
    for k in grads:
        torch.testing.assert_close(grads[k], ref_grads[k], atol=1e-5, rtol=1e-4, msg=k)


def test_the_loader_packs_the_same_rows_and_validation_the_same_logits(tiny, data_dir):
    manifest = read_manifest(data_dir)
    kw = {"rank": 1, "world_size": 2, "batch_size": 4, "seed": 3, "global_batch": 16, "shuffle_buffer": 32}
    plain = list(ShardedLoader(manifest, "train", **kw))
    packed = list(ShardedLoader(manifest, "train", packing=True, **kw))
    assert len(plain) == len(packed)  # the same micro-batches per rank: DDP's invariant
    for a, b in zip(plain, packed):
        assert torch.equal(a["index"], b["index"]) and torch.equal(a["labels"], b["labels"])
        assert int(a["attention_mask"].sum()) == int(b["attention_mask"].sum())
        assert b["input_ids"].numel() <= a["input_ids"].numel()
    assert sum(b["input_ids"].numel() for b in packed) < 0.9 * sum(a["input_ids"].numel() for a in plain)
    model = build_classifier(tiny, manifest.labels)
    cpu = torch.device("cpu")
    ref = prepared_logits(model, eval_batches(manifest, "val", 0, 1, 8), cpu, "fp32", manifest.num_labels)
    out = prepared_logits(model, map(pack_batch, eval_batches(manifest, "val", 0, 1, 8)), cpu, "fp32",
                          manifest.num_labels)
    torch.testing.assert_close(torch.from_numpy(out[0]), torch.from_numpy(ref[0]), atol=1e-5, rtol=1e-5)
    assert np.array_equal(out[2], ref[2])


def test_training_with_packing_reaches_the_padded_weights_under_ddp_and_fsdp(tmp_path, tiny, data_dir):
    # Two workers, 4 steps, fp32: packing changes the tensors' shape only, so the weights are the padded run's,
    # through DDP's wrapper and through FSDP's sharded forward alike.
    from torchloom.console import speed_line
    from torchloom.engines import local
    from torchloom.train import checkpoint

    runs = {"padded": ["--train.packing", "false"], "packed": ["--train.packing", "true"],
            "packed-fsdp": ["--train.packing", "true", "--train.strategy", "fsdp"]}
    results = {}
    for name, flags in runs.items():
        rd = tmp_path / name
        shutil.copytree(data_dir, rd / "data")
        cfg = build(None, ["--output.dir", str(rd), "--model.path", tiny, "--train.precision", "fp32",
                           "--train.batch_size", "8", "--train.lr", "1e-3", "--engine.workers", "2",
                           "--train.budget", "off", "--train.max_steps", "4", "--train.eval_every", "2",
                           "--train.length_bucketing", "false", *flags])  # batches of mixed lengths: most pack
        results[name] = local.train(cfg, rd, quiet=True)
    weights = {n: checkpoint.load_weights(Path(tmp_path) / n / "checkpoints" / "step-4") for n in runs}
    for name in ("packed", "packed-fsdp"):
        assert weights[name].keys() == weights["padded"].keys()
        for k in weights["padded"]:
            torch.testing.assert_close(weights[name][k], weights["padded"][k], atol=1e-5, rtol=1e-4, msg=f"{name} {k}")
        assert results[name].last_eval["accuracy"] == results["padded"].last_eval["accuracy"]
        assert results[name].packed and results[name].padding < results["padded"].padding
        assert "packed" in speed_line(results[name])
    assert not results["padded"].packed and "packed" not in speed_line(results["padded"])


def test_what_packing_cannot_run_is_refused_in_one_line(tiny):
    from transformers import DistilBertConfig, DistilBertForSequenceClassification

    other = DistilBertForSequenceClassification(DistilBertConfig(vocab_size=100, dim=32, n_layers=1, n_heads=2,
                                                                 hidden_dim=64, num_labels=2))
    with pytest.raises(UserError, match="train.packing: model DistilBertForSequenceClassification .* not supported"):
        check_packing(other)
    model = build_classifier(tiny, LABELS)
    check_packing(model)
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(UserError, match="attention kernel 'flex_attention'"):
        check_packing(model)
    with pytest.raises(UserError, match="train.packing: runs with train.strategy ddp or fsdp"):
        build(None, ["--train.packing", "true", "--train.strategy", "pipeline", "--engine.workers", "2"])


def test_evaluate_scores_packed_batches_with_the_same_probabilities(tiny, data_dir):
    from torchloom.evaluate.run import split_probabilities

    manifest = read_manifest(data_dir)
    model = build_classifier(tiny, manifest.labels)
    probs = {flag: split_probabilities(build(None, ["--train.packing", flag, "--eval.precision", "fp32",
                                                    "--engine.device", "cpu"]), model, manifest, "val")
             for flag in ("false", "true")}
    torch.testing.assert_close(torch.from_numpy(probs["true"][0]), torch.from_numpy(probs["false"][0]), atol=1e-5,
                               rtol=1e-5)
    assert np.array_equal(probs["true"][1], probs["false"][1])


def test_length_bucketing_auto_buckets_where_the_median_text_is_shorter_than_max_length(data_dir):
    import dataclasses

    from torchloom.data.buckets import use_length_buckets

    manifest = read_manifest(data_dir)  # written without prepare: no sample of lengths, so no buckets
    assert not use_length_buckets("auto", manifest) and use_length_buckets(True, manifest)

    def measured(p50: int):
        return dataclasses.replace(manifest, tokenizer={**manifest.tokenizer, "max_length": 128,
                                                        "lengths": {"p50": p50, "p90": 2 * p50}})

    assert use_length_buckets("auto", measured(13))  # short questions (TREC: p50 13)
    assert not use_length_buckets("auto", measured(421))  # news articles cut at max_length (the demo)
    assert not use_length_buckets(False, measured(13))
    assert build(None, []).train.length_bucketing == "auto"
