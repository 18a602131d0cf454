"""The transformer against the classical baseline: the comparison report.md and the run summary show,
and the one line that says so when the transformer did not beat it, with the likely cause."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow.parquet as pq

from torchloom.manifest import Manifest

# Past this share of truncated texts, truncation is the first suspect.
TRUNCATION_SUSPECT = 0.2


def truncated_share(manifest: Manifest, split: str) -> float:
    """Share of the split's texts cut at max_length (their stored token count reached it); with truncation
    chunks, of those with max_chunks windows (which may skip parts of the text)."""
    max_length = int(manifest.tokenizer.get("max_length") or 0)
    chunks = manifest.tokenizer.get("truncation") == "chunks"
    cap = int(manifest.tokenizer.get("max_chunks") or 0)
    if not max_length or (chunks and not cap):
        return 0.0
    total = cut = 0
    for shard in manifest.split(split).shards:
        if chunks:
            chunk = pq.read_table(manifest.shard_uri(shard), columns=["chunk"]).column("chunk").to_numpy()
            total += int(np.count_nonzero(chunk == 0))
            cut += int(np.count_nonzero(chunk == cap - 1))
            continue
        lengths = pq.read_table(manifest.shard_uri(shard), columns=["length"]).column("length").to_numpy()
        total += len(lengths)
        cut += int(np.count_nonzero(lengths >= max_length))
    return cut / total if total else 0.0


def comparison(metrics: dict[str, Any], baseline: dict[str, Any], split: str) -> dict[str, Any] | None:
    """The baseline's scores on `split` beside the transformer's (its own, where the shipped model is the mix:
    metrics["transformer"]), or None when it has none there. With the mix, "shipped" holds the mix's scores."""
    scores = baseline.get("splits", {}).get(split)
    if scores is None:
        return None
    transformer = metrics.get("transformer") or metrics
    out = {
        "name": baseline["name"], "description": baseline["description"], "split": split,
        "accuracy": scores["accuracy"], "macro_f1": scores["macro_f1"], "n": scores["n"],
        "seconds": baseline.get("seconds"),
        "transformer_accuracy": transformer["accuracy"], "transformer_macro_f1": transformer["macro_f1"],
        "accuracy_gain": transformer["accuracy"] - scores["accuracy"],
        "macro_f1_gain": transformer["macro_f1"] - scores["macro_f1"],
    }
    if "micro_f1" in scores:  # a multi-label run: micro-F1 says who is ahead (accuracy is every tag right)
        out.update({"metric": "micro_f1", "micro_f1": scores["micro_f1"],
                    "transformer_micro_f1": transformer["micro_f1"],
                    "micro_f1_gain": transformer["micro_f1"] - scores["micro_f1"]})
    if "micro_f1" in scores and scores.get("per_class") and transformer.get("per_class"):
        out["per_tag"] = per_tag(transformer["per_class"], scores["per_class"])
    if "transformer" in metrics:
        out["shipped"] = {"accuracy": metrics["accuracy"], "macro_f1": metrics["macro_f1"],
                          "weight": metrics.get("mix_weight"),
                          **({"micro_f1": metrics["micro_f1"]} if "micro_f1" in metrics else {})}
    return out


# A tag's F1 must differ by more than this for one side to win it (a few texts of a small tag move F1 by more).
TAG_TIE = 0.01


def per_tag(transformer: dict[str, dict], baseline: dict[str, dict]) -> dict[str, dict]:
    """Each tag with support in the split: both sides' F1 and which wins it (a tie within TAG_TIE)."""
    out = {}
    for tag, mine in transformer.items():
        theirs = baseline.get(tag)
        if theirs is None or not mine.get("support"):
            continue
        gap = float(mine["f1"]) - float(theirs["f1"])
        out[tag] = {"support": int(mine["support"]), "transformer_f1": float(mine["f1"]),
                    "baseline_f1": float(theirs["f1"]),
                    "winner": "tie" if abs(gap) <= TAG_TIE else "transformer" if gap > 0 else "baseline"}
    return out


def tag_wins(cmp: dict[str, Any]) -> dict[str, int]:
    """How many tags each side wins (and ties) in comparison()'s per_tag."""
    won = {"transformer": 0, "baseline": 0, "tie": 0}
    for row in (cmp.get("per_tag") or {}).values():
        won[row["winner"]] += 1
    return won


def not_worth_it(cmp: dict[str, Any]) -> bool:
    """The transformer trails the baseline on the headline metric and on macro-F1, or the shipped model does not
    run it at all (the mix's weight 0): on this data it costs a GPU's training and serving for nothing."""
    key = cmp.get("metric", "accuracy")
    shipped = cmp.get("shipped") or {}
    return (cmp[f"{key}_gain"] <= 0 and cmp["macro_f1_gain"] <= 0) or shipped.get("weight") == 0


def likely_cause(manifest: Manifest, split: str, train: dict[str, Any] | None) -> str:
    """Why a transformer may trail a bag of words, from what the run recorded."""
    share = truncated_share(manifest, split)
    max_length = manifest.tokenizer.get("max_length")
    if share >= TRUNCATION_SUSPECT and manifest.tokenizer.get("truncation") == "chunks":
        cap = manifest.tokenizer.get("max_chunks")
        return (f"truncation: {share:.0%} of the {split} texts fill all {cap} windows of max_length {max_length}"
                " tokens, spread over the text with gaps between; try a larger --prepare.max_chunks")
    if share >= TRUNCATION_SUSPECT:
        cut = manifest.tokenizer.get("truncation", "head")
        reads = "only their start" if cut == "head" else "only their start and end"
        hint = "; or --prepare.truncation " + ("head_tail" if cut == "head" else "chunks")
        return (f"truncation: {share:.0%} of the {split} texts are longer than max_length {max_length} tokens, so the"
                f" model reads {reads}; try a longer --prepare.max_length (up to 512){hint}")
    epochs, train_s = float((train or {}).get("epochs") or 0), float((train or {}).get("train_s") or 0)
    epoch_s = f"~{train_s / epochs:.0f} s an epoch here" if epochs and train_s else ""
    if train and not train.get("stopped_early") and train.get("best_step") == train.get("steps"):
        more = max(2 * round(epochs), 4)
        return (f"too few epochs: validation was still improving at the last step of {epochs:g} epochs; train longer"
                f" with --train.epochs {more} or a time, --train.budget 2h" + (f" ({epoch_s})" if epoch_s else ""))
    tried = f"{epochs:g} epochs" + (", stopped once validation stopped improving" if (train or {}).get(
        "stopped_early") else "") if epochs else "the default training"
    return (f"the baseline suits this data: {tried}, did not close the gap; what may: a larger pretrained model"
            f" (--model.path), more labelled rows, or torchloom tune over the learning rate and batch size (a"
            f" training a trial" + (f", {epoch_s})" if epoch_s else ")"))


def verdict(cmp: dict[str, Any], manifest: Manifest, train: dict[str, Any] | None) -> str | None:
    """One line when the transformer's accuracy (a multi-label run's micro-F1) is not above the baseline's; None
    when it is."""
    key = cmp.get("metric", "accuracy")
    name = "micro-F1" if key == "micro_f1" else key
    if cmp[f"{key}_gain"] > 0:
        return None
    how = "ties with" if cmp[f"{key}_gain"] == 0 else "trails"
    shipped = cmp.get("shipped")
    mixed = (f"; so the model shipped mixes them ({shipped['weight']:.2f} x the transformer), {name}"
             f" {shipped[key]:.4f}" if shipped else "")
    won = tag_wins(cmp)
    tags = (f"; it wins {won['transformer']} of {sum(won.values())} tags' F1, the baseline {won['baseline']}"
            if cmp.get("per_tag") else "")
    worth = ""
    if not_worth_it(cmp):
        served = ("the shipped model is the baseline alone" if (shipped or {}).get("weight") == 0 else
                  f"its macro-F1 trails too ({cmp['macro_f1'] + cmp['macro_f1_gain']:.4f} against"
                  f" {cmp['macro_f1']:.4f})")
        fit = f" (fitted in {cmp['seconds']:.0f} s)" if cmp.get("seconds") else ""
        worth = (f". On this data the transformer is not worth its cost: {served}; the baseline{fit} needs no GPU to"
                 " train or serve (export.combine auto ships it alone where val says so)")
    return (f"the transformer {how} the {cmp['name']} baseline on {cmp['split']} ({name}"
            f" {cmp[key] + cmp[f'{key}_gain']:.4f} against {cmp[key]:.4f}){mixed}{tags}; likely cause:"
            f" {likely_cause(manifest, cmp['split'], train)}{worth}")
