"""The shipped model as a mix of the transformer and the classical baseline: the transformer's weight chosen on
the val split at export (0 and 1 included), and the shipped probabilities on any prepared split.

Why: on data unlike what the transformer was pretrained for (many classes from few rows, long texts cut to
max_length), a TF-IDF + logistic regression can beat it; averaging the two models' probabilities is never
worse on val than the better of them (the grid holds both ends), and often better than either. The arithmetic
is scoring.mix and scoring.choose_weight; the baseline's probabilities come from its arrays (lexical.py), the
same code predict and serve run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from torchloom.data.texts import texts_at
from torchloom.lexical import Lexical
from torchloom.manifest import Manifest
from torchloom.model.export import read_export_info
from torchloom.model.predict import shipped_baseline
from torchloom.scoring import choose_weight, mix

COMBINE = ("auto", "off", "on")
# auto ships a mix that gains at least this many val texts over the transformer alone (one text is noise: on TREC
# and SMS a one-text gain on val was a one- and two-text loss on test, docs/benchmarks.md), or any mix where the
# baseline beats the transformer on val
MIN_GAIN_TEXTS = 2


def split_texts(manifest: Manifest, split: str, index: np.ndarray) -> list[str]:
    """The prepared (cleaned) text of each scored text, by its first row's position (to_documents' index)."""
    found = texts_at(manifest, split, {int(i) for i in index})
    return [found[int(i)] for i in index]


def choose_combine(combine: str, scored, manifest: Manifest, baseline_dir: Path) -> dict[str, Any] | None:
    """torchloom.json's "combine" for an export: the transformer's weight and the val accuracy of the transformer,
    the baseline and the chosen mix; None when nothing is to be chosen (off, no baseline arrays, no val rows).
    scored(): the transformer's (probabilities, labels, positions) of the val split's texts (run.split_probabilities).
    auto ships the mix where it gains MIN_GAIN_TEXTS val texts over the transformer alone, or where the baseline
    beats the transformer on val; on ships the best weight whatever."""
    if combine == "off" or not Lexical.exists(baseline_dir) or manifest.split("val").rows == 0:
        return None
    probs, labels, index = scored()
    lexical = Lexical.load(baseline_dir).probabilities(split_texts(manifest, "val", index))
    weight, grid = choose_weight(probs, lexical, labels)
    by_weight = {row["weight"]: row for row in grid}
    weight = shipped_weight(combine, weight, by_weight, len(labels))
    return {"weight": weight, "baseline": "baseline", "chosen_on": "val", "texts": int(len(labels)),
            "val_accuracy": {"transformer": by_weight[1.0]["accuracy"], "baseline": by_weight[0.0]["accuracy"],
                             "shipped": by_weight[weight]["accuracy"]},
            "grid": [{k: round(v, 6) for k, v in row.items()} for row in grid]}


def shipped_weight(combine: str, best: float, by_weight: dict[float, dict[str, float]], texts: int) -> float:
    """The weight export ships: `best` (choose_weight's on val), but for auto the transformer alone where the mix
    is not clearly better there (MIN_GAIN_TEXTS of `texts`: a multi-label mix's micro-F1 counts true tags) and the
    transformer does not trail the baseline."""
    alone, baseline = by_weight[1.0]["accuracy"], by_weight[0.0]["accuracy"]
    gained = round((by_weight[best]["accuracy"] - alone) * texts)
    if combine == "auto" and gained < MIN_GAIN_TEXTS and alone >= baseline:
        return 1.0  # nothing more to serve for a gain that one text of val could make
    return best


def choose_tag_combine(combine: str, probs: np.ndarray, masks: np.ndarray, index: np.ndarray, manifest: Manifest,
                       baseline_dir: Path) -> tuple[dict[str, Any] | None, np.ndarray]:
    """A multi-label model's choose_combine: (torchloom.json's "combine" or None, the shipped val probabilities).
    Each weight of MIX_GRID is scored by val micro-F1 with thresholds chosen for that mix by the rule the shipped
    model's are (tag_scoring.choose_thresholds); auto ships a mix that gains MIN_GAIN_TEXTS true tags' worth of
    micro-F1 over the transformer alone, or any where the baseline beats the transformer on val."""
    if combine == "off" or not Lexical.exists(baseline_dir) or not len(probs):
        return None, probs
    from torchloom import tag_scoring as ts
    from torchloom.scoring import MIX_GRID

    lexical = Lexical.load(baseline_dir).probabilities(split_texts(manifest, "val", index))
    truth = ts.multi_hot(masks, len(manifest.labels))
    at_least_one = not manifest.tags.get("keep_untagged", False)
    grid, alone = [], None
    for w in MIX_GRID:
        p = mix(probs, lexical, w)
        chosen = ts.choose_thresholds(p, truth, at_least_one=at_least_one)
        alone = chosen if w == 1.0 else alone
        m = ts.tag_metrics(ts.predict(p, chosen), truth, manifest.labels)
        grid.append({"weight": w, "micro_f1": m["micro_f1"], "macro_f1": m["macro_f1"]})
    best = max(grid, key=lambda r: (r["micro_f1"], r["weight"]))["weight"]
    by_weight = {row["weight"]: {**row, "accuracy": row["micro_f1"]} for row in grid}
    weight = shipped_weight(combine, best, by_weight, int(truth.sum()))
    record = {"weight": weight, "baseline": "baseline", "chosen_on": "val", "texts": int(len(probs)),
              "metric": "micro_f1",
              "val_micro_f1": {"transformer": by_weight[1.0]["micro_f1"], "baseline": by_weight[0.0]["micro_f1"],
                               "shipped": by_weight[weight]["micro_f1"]},
              "transformer_thresholds": alone.record(manifest.labels),  # its own, for the comparison in evaluate
              "grid": [{k: round(v, 6) for k, v in row.items()} for row in grid]}
    return record, mix(probs, lexical, weight)


def shipped_probabilities(model_dir: str, manifest: Manifest, split: str, probs: np.ndarray, index: np.ndarray
                          ) -> tuple[np.ndarray, np.ndarray | None]:
    """(the shipped model's probabilities, the transformer's alone or None) of a split's texts, from the
    transformer's: mixed with the baseline where the exported model ships the mix."""
    lexical, weight = shipped_baseline(Path(model_dir), read_export_info(model_dir))
    if lexical is None:
        return probs, None
    shipped = mix(probs, lexical.probabilities(split_texts(manifest, split, index)), weight)
    return shipped.astype(np.float32), probs
