"""Multi-label groundwork (issue 62): a row's tags read as users write them (text/tags.py), a tag set as one int64,
bad tag columns as one line; thresholds chosen on validation by the documented rule and a tagger's metrics
(tag_scoring.py), the metrics checked against scikit-learn's on random tag sets. Pure functions: about 2 s."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import numpy as np
import pytest

from torchloom import tag_scoring as ts
from torchloom.errors import UserError
from torchloom.text import tags


def test_tags_are_read_from_lists_json_lists_and_delimited_strings_cleaned_and_once():
    assert tags.parse(["sport", " Money ", "sport", "", None]) == ["sport", "Money"]
    assert tags.parse('["sport", "money"]') == ["sport", "money"]
    assert tags.parse("sport | money|", delimiter="|") == ["sport", "money"]
    assert tags.parse("sport|money") == ["sport|money"]  # no delimiter given: one tag
    assert tags.parse("[]") == [] and tags.parse([]) == [] and tags.parse(None) is None
    assert tags.parse([3, 7]) == ["3", "7"]  # ids as tags: their names
    with pytest.raises(ValueError, match="not float"):
        tags.parse([0.5])
    with pytest.raises(ValueError, match="not list"):
        tags.parse([["nested"]])
    assert tags.canonical(["b", "a", "b"]) == ("a", "b")


def test_a_tag_set_is_its_tags_ids_in_any_vocabulary_and_older_masks_still_read():
    """Issue 78, item 4: a row's tags are the list of their ids (shards: list<int32>; memory: [rows, width] padded
    with -1), so 5,000 tags work as 5 do; shards prepared before, with one int64 mask a row, read the same."""
    import pyarrow as pa
    import torch

    from torchloom.train.state import logits_and_targets

    k = 5000
    labels = [f"t{i:04d}" for i in range(k)]
    rows = [[3, 4999], [], [7], [0, 1, 2, 4998]]
    column = pa.chunked_array([pa.array(rows[:2], pa.list_(pa.int32())), pa.array(rows[2:], pa.list_(pa.int32()))])
    ids = ts.label_array(column)
    assert ids.shape == (4, 4) and ids[0].tolist() == [3, 4999, -1, -1] and (ids[1] == -1).all()
    assert [tags.decode(r, labels) for r in ids] == [[labels[i] for i in r] for r in rows]
    hot = ts.multi_hot(ids, k)
    assert hot.shape == (4, k) and [np.flatnonzero(h).tolist() for h in hot] == rows
    assert [tags.ids_of(r) for r in ts.to_ids(hot)] == rows
    wide = ts.concat_labels([ids[:1, :2], np.zeros(0, np.int64), ids[2:]])  # widths 2 and 4: padded to 4
    assert wide.shape == (3, 4) and wide[0].tolist() == [3, 4999, -1, -1]
    # the loss's targets: a filler row (-100, 1-D as collate makes one) left out, an untagged row all zeros
    logits = torch.zeros(4, k)
    kept, targets = logits_and_targets(logits, torch.from_numpy(ids))
    assert targets.shape == (4, k) and torch.equal(targets.bool(), torch.from_numpy(hot))
    assert logits_and_targets(torch.zeros(1, k), torch.tensor([-100]))[1].shape == (0, k)
    # older shards: one int64 mask a row (bit i: label i), and a filler's -100
    old = np.array([(1 << 1) | (1 << 62), 0, -100])  # t0001 and t0062; none; a filler
    assert tags.decode(old[0], labels) == ["t0001", "t0062"] and tags.decode(-100, labels) == []
    assert ts.label_array(pa.array(old)).tolist() == old.tolist()
    assert [np.flatnonzero(h).tolist() for h in ts.multi_hot(old[:2], 63)] == [[1, 62], []]
    assert logits_and_targets(torch.zeros(3, 63), torch.from_numpy(old))[1].sum(dim=1).tolist() == [2.0, 0.0]
    tags.check_count(labels, "data.label_column label")
    with pytest.raises(UserError, match=r"^data.label_column label: 100001 distinct tags; .* at most 100000: keep"):
        tags.check_count([f"x{i}" for i in range(tags.MAX_TAGS + 1)], "data.label_column label")


def test_prepare_reads_labels_as_tag_sets_by_task_and_delimiter():
    assert tags.mode_for("auto", "") == "auto" and tags.mode_for("auto", "|") == "multi"
    assert tags.mode_for("multi_label", "") == "multi" and tags.mode_for("single_label", "") == "single"
    with pytest.raises(UserError, match=r"^data.task 'tags': not a task; use one of auto, single_label, multi_label$"):
        tags.mode_for("tags", "")
    s = tags.SET
    assert tags.label_value('["b", "a", "b"]', "auto") == f"{s}a{s}b" == tags.label_value(["a", "b"], "auto")
    assert tags.label_value(" sport ", "auto") == "sport"  # not a list: one label, cleaned
    assert tags.label_value("[]", "auto") == s and tags.label_value(None, "auto") is None
    assert tags.label_value("b|a", "multi", "|") == f"{s}a{s}b" and tags.label_value("a", "multi") == f"{s}a"
    assert tags.label_value('["a"]', "single") == '["a"]'
    assert tags.of_label(f"{s}a{s}b") == ["a", "b"] and tags.of_label(s) == [] and tags.of_label("x") == ["x"]
    assert tags.shown(f"{s}a{s}b") == '["a", "b"]'
    assert tags.label_value("tab\x1fin a tag", "multi") == f"{s}tab in a tag"  # the separator never in a tag

    where = "news.csv"
    assert tags.decide(["a", "b", None], "auto", "", where) == "single_label"
    assert tags.decide([f"{s}a{s}b", f"{s}c", s], "auto", "", where) == "multi_label"
    assert tags.decide([f"{s}a", f"{s}c"], "multi_label", "", where) == "multi_label"  # one tag a row, said so
    bad = [(([f"{s}a{s}b", "c"], "auto", ""), "data.label_column of news.csv: some labels are lists of tags"
                                               ' (["a", "b"]) and others single labels (\'c\')'),
           (([f"{s}a,b", f"{s}c"], "multi_label", "|"), "data.label_delimiter '|': occurs in none of news.csv's"
                                                         ' labels (e.g. ["a,b"])')]
    for (labels, task, delimiter), message in bad:
        with pytest.raises(UserError) as e:
            tags.decide(labels, task, delimiter, where)
        assert str(e.value).startswith(message) and "\n" not in str(e.value)


def random_tags(rng, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Truth tag sets (some texts untagged) and noisy probabilities that rank them above the rest."""
    truth = rng.random((n, k)) < np.linspace(0.05, 0.5, k)[None, :]
    probs = np.clip(np.where(truth, 0.65, 0.3) + rng.normal(0, 0.2, (n, k)), 0, 1).astype(np.float32)
    return probs, truth


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_metrics_are_scikit_learns(seed):
    metrics = pytest.importorskip("sklearn.metrics")
    rng = np.random.default_rng(seed)
    probs, truth = random_tags(rng, 300, 7)
    truth[:, 6] = False  # a label the split lacks: out of the macro average
    pred = ts.predict(probs, ts.Thresholds(0.5))
    got = ts.tag_metrics(pred, truth, [f"t{i}" for i in range(7)])
    present = list(range(6))
    for average in ("micro", "macro"):
        labels = present if average == "macro" else None
        assert got[f"{average}_f1"] == pytest.approx(metrics.f1_score(truth, pred, average=average, labels=labels,
                                                                      zero_division=0))
        assert got[f"{average}_precision"] == pytest.approx(metrics.precision_score(
            truth, pred, average=average, labels=labels, zero_division=0))
        assert got[f"{average}_recall"] == pytest.approx(metrics.recall_score(truth, pred, average=average,
                                                                              labels=labels, zero_division=0))
    assert got["weighted_f1"] == pytest.approx(metrics.f1_score(truth, pred, average="weighted", zero_division=0))
    assert got["samples_f1"] == pytest.approx(metrics.f1_score(truth, pred, average="samples", zero_division=1.0))
    assert got["hamming_loss"] == pytest.approx(metrics.hamming_loss(truth, pred))
    assert got["subset_accuracy"] == pytest.approx(metrics.accuracy_score(truth, pred))
    assert got["per_label"]["t6"]["support"] == 0 and got["per_label"]["t0"]["support"] == truth[:, 0].sum()
    assert got["cardinality_true"] == pytest.approx(truth.sum(1).mean())


def test_thresholds_global_by_default_per_label_only_with_support_and_a_gain():
    rng = np.random.default_rng(5)
    n = 400
    truth = np.zeros((n, 3), bool)
    truth[:, 0] = rng.random(n) < 0.4  # common: probabilities shifted low, so a lower threshold of its own pays
    truth[:, 1] = rng.random(n) < 0.3
    truth[:20, 2] = True  # rare: 20 positives, under MIN_SUPPORT
    probs = np.where(truth, 0.6, 0.2) + rng.normal(0, 0.08, (n, 3))
    probs[:, 0] -= 0.3
    probs[:20, 2] -= 0.35
    chosen = ts.choose_thresholds(np.clip(probs, 0, 1), truth)
    assert 0 in chosen.per_label and chosen.per_label[0] < chosen.default  # its own, well supported
    assert 2 not in chosen.per_label  # too little support: the global threshold
    assert set(chosen.per_label) <= {0, 1}
    assert chosen.default in ts.GRID
    f1_own = ts.tag_metrics(ts.predict(probs, chosen), truth, ["a", "b", "c"])["micro_f1"]
    f1_half = ts.tag_metrics(ts.predict(probs, ts.Thresholds(0.5)), truth, ["a", "b", "c"])["micro_f1"]
    assert f1_own > f1_half
    none = ts.choose_thresholds(np.clip(probs, 0, 1), truth, min_support=10_000)
    assert none.per_label == {}
    record = chosen.record(["a", "b", "c"])
    assert ts.Thresholds.from_record(record, ["a", "b", "c"]) == chosen


def test_top_k_and_at_least_one():
    probs = np.array([[0.1, 0.2, 0.3], [0.9, 0.8, 0.1]], np.float32)
    assert ts.predict(probs, ts.Thresholds(0.5)).tolist() == [[False, False, False], [True, True, False]]
    assert ts.predict(probs, ts.Thresholds(0.5, at_least_one=True))[0].tolist() == [False, False, True]
    assert ts.predict(probs, ts.Thresholds(top_k=1)).tolist() == [[False, False, True], [True, False, False]]
    co = ts.cooccurrence(np.array([[1, 1, 0], [1, 0, 0]], bool))
    assert co.tolist() == [[2, 1, 0], [1, 1, 0], [0, 0, 0]]


def test_the_multi_label_modules_stand_on_the_floor():
    """tag_scoring: numpy and the standard library; text/tags: the standard library and the floor (errors, text);
    text/hierarchy: the standard library alone."""
    from torchloom.text import hierarchy

    for module, allowed in ((ts, {"numpy"}), (tags, {"torchloom"}), (hierarchy, set())):
        tree = ast.parse(Path(module.__file__).read_text(encoding="utf-8"))
        imported = {a.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
        imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                     if isinstance(node, ast.ImportFrom) and node.module}
        assert imported - set(sys.stdlib_module_names) == allowed, (module.__name__, imported)


def test_hierarchical_labels_normalise_derive_parents_and_score_every_level():
    from torchloom.etl.clean import tag_label
    from torchloom.evaluate import levels
    from torchloom.text import hierarchy

    assert tag_label(" Tops / Knits/ ", "single", "", False, "/") == ("Tops/Knits", None)
    assert tag_label("/", "single", "", False, "/") == (None, None)  # no part left: a null label
    label, reason = tag_label('["a / b", "c"]', "auto", "", False, "/")
    assert reason is None and tags.of_label(label) == ["a/b", "c"]
    assert hierarchy.ancestors("a/b/c", "/") == ["a", "a/b"] and hierarchy.at_depth("a", 2, "/") == "a"
    probs = {"a/x": 0.5, "a/y": 0.2, "ab/z": 0.3}  # "ab" is no child of "a"
    assert hierarchy.path(probs, "a/x", "/") == [{"label": "a", "score": pytest.approx(0.7)},
                                                   {"label": "a/x", "score": 0.5}]
    assert hierarchy.describe({"labels": ["a/x", "ab/z", "a/y"], "probabilities": probs}, "/")["parents"] == ["a", "ab"]
    names = ["a/x", "a/y", "b/z"]
    p = np.array([[0.6, 0.3, 0.1], [0.2, 0.7, 0.1], [0.5, 0.1, 0.4], [0.1, 0.1, 0.8]])
    truth = np.array([0, 0, 2, 2])  # leaves right 2 of 4; the parent right 3 of 4 (a/y is still under a)
    top, leaf = levels.single_label(p, truth, names, "/")
    assert (top["labels"], top["accuracy"], leaf["accuracy"]) == (2, 0.75, 0.5)
    masks = np.array([0b001, 0b100, 0b011])
    top, leaf = levels.multi_label(p[:3], masks, names, "/", ts.Thresholds(0.45))
    assert top["labels"] == 2 and top["micro_f1"] == pytest.approx(4 / 6) and leaf["labels"] == 3


@pytest.mark.parametrize("tags_by, levels_by", [("/", "/"), ("/", "//"), ("::", ":")])
def test_a_tag_delimiter_that_holds_the_path_delimiter_or_is_held_by_it_is_refused(tags_by, levels_by):
    from torchloom.config import build

    with pytest.raises(UserError, match="one holds the other, so a path's levels would be read as separate tags"):
        build(None, ["--data.label_delimiter", tags_by, "--data.label_path_delimiter", levels_by])
    build(None, ["--data.label_delimiter", "|", "--data.label_path_delimiter", "/"])  # apart: fine


def test_the_tag_losses_bce_as_torch_s_and_focal_and_asymmetric_weigh_easy_negatives_down():
    """Issue 78, item 1: train.tag_loss. bce is torch's binary cross-entropy (with each tag's positive weight);
    focal and asymmetric cost an easy negative far less than bce and a hard positive about as much; asymmetric
    drops a negative under its margin (no loss, no gradient) and leaves a positive's term plain cross-entropy."""
    import torch
    import torch.nn.functional as F

    from torchloom.train.state import tag_loss

    x = torch.tensor([[-4.0, 2.0, 0.0], [3.0, -1.0, -6.0], [0.5, 0.5, 0.5]], requires_grad=True)
    masks = torch.tensor([0b010, 0b001, -1])  # row 2: a filler row, left out
    hot = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    weight = torch.tensor([2.0, 0.5, 1.0])
    for w in (None, weight):
        want = F.binary_cross_entropy_with_logits(x[:2], hot, pos_weight=w, reduction="none").mean(dim=1).sum()
        assert torch.allclose(tag_loss(x, masks, w, "bce"), want)
    easy_negative = (torch.tensor([[-4.0]]), torch.tensor([0]))
    hard_positive = (torch.tensor([[-2.0]]), torch.tensor([1]))
    bce = {name: float(tag_loss(*case, None, "bce")) for name, case in (("neg", easy_negative), ("pos", hard_positive))}
    for kind in ("focal", "asymmetric"):
        assert float(tag_loss(*easy_negative, None, kind)) < bce["neg"] / 50
        assert bce["pos"] * 0.5 < float(tag_loss(*hard_positive, None, kind)) <= bce["pos"] + 1e-6
    assert float(tag_loss(*hard_positive, None, "asymmetric")) == pytest.approx(bce["pos"])
    under_margin = torch.tensor([[-4.0]], requires_grad=True)  # sigmoid 0.018 < 0.05
    loss = tag_loss(under_margin, torch.tensor([0]), None, "asymmetric")
    loss.backward()
    assert float(loss) == 0.0 and float(under_margin.grad) == 0.0
    for kind in ("focal", "asymmetric"):  # a positive's weight scales its term
        one, two = (float(tag_loss(*hard_positive, w, kind)) for w in (torch.tensor([1.0]), torch.tensor([2.0])))
        assert two == pytest.approx(2 * one)
    tag_loss(x, masks, weight, "asymmetric").backward()
    assert torch.isfinite(x.grad).all() and not x.grad[2].any()
