"""Score an exported model on a prepared split: metrics plus the misclassified rows."""

from __future__ import annotations

import numpy as np
import torch

from torchloom.config import Config
from torchloom.data.texts import texts_at, to_documents
from torchloom.errors import UserError
from torchloom.evaluate.logits import range_logits
from torchloom.machine import usable_cores
from torchloom.manifest import Manifest
from torchloom.scoring import classification_metrics


def score_split(cfg: Config, model_dir: str, manifest: Manifest, spark=None
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Probabilities, labels and file positions of eval.split's texts, in eval.precision (by default what
    `serve` answers with on this device). With truncation chunks, a text is the mean of its windows' logits
    and its position is its first window's."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(model_dir, local_files_only=True, use_safetensors=True)
    return split_probabilities(cfg, model, manifest, cfg.eval.split, spark)


def scored_by(cfg: Config, manifest: Manifest, split: str) -> str:
    """Who scores `split`: "process" or "spark" (eval.score_with; auto: Spark where the run trains on Spark and the
    split has more than eval.spark_rows rows, where one process would be the slow part)."""
    if cfg.eval.score_with != "auto":
        return cfg.eval.score_with
    from torchloom.config.engines import engine_of

    large = manifest.split(split).rows > cfg.eval.spark_rows
    return "spark" if engine_of(cfg.engine).uses_spark and large else "process"


def split_probabilities(cfg: Config, model, manifest: Manifest, split: str, spark=None
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """score_split for a model already in memory (export chooses the mix's weight on val with it). spark: what
    gives a SparkSession and the manifest its executors read (stages/sessions.py), for a split scored on Spark."""
    if scored_by(cfg, manifest, split) == "spark":
        if spark is None:
            raise UserError("eval.score_with spark: this command has no SparkSession to score with; set"
                            " eval.score_with process")
        from torchloom.evaluate.spark_scoring import split_logits

        logits, labels, index = split_logits(cfg, model, spark.manifest(manifest), split, spark.session(), spark.say)
        return to_documents(manifest, split, logits, labels, index)
    torch.set_num_threads(usable_cores())
    device = torch.device("cuda" if torch.cuda.is_available() and cfg.engine.device != "cpu" else "cpu")
    model = model.to(device).eval()
    logits, labels, index = range_logits(cfg, model, manifest, split, 0, manifest.split(split).rows, device)
    return to_documents(manifest, split, logits, labels, index)


def evaluate_model_dir(cfg: Config, model_dir: str, manifest, spark=None) -> tuple[dict, list[dict]]:
    """The shipped model's metrics on eval.split of the prepared data `manifest` (with the mix, "transformer" holds
    the transformer's alone); spark: as split_probabilities'."""
    from torchloom.evaluate.mix import shipped_probabilities
    from torchloom.model.export import read_export_info

    probs, labels, index = score_split(cfg, model_dir, manifest, spark)
    probs, alone = shipped_probabilities(model_dir, manifest, cfg.eval.split, probs, index)
    info = read_export_info(model_dir)
    if manifest.multi_label:
        from torchloom.evaluate import tags

        metrics, mistakes = tags.evaluate(probs, labels, index, manifest, cfg.eval.split, info.get("thresholds"),
                                          cfg.eval.misclassified_limit)
        if info.get("label_path_delimiter"):
            from torchloom import tag_scoring as ts
            from torchloom.evaluate import levels

            levels.record(metrics, info["label_path_delimiter"], levels.multi_label(
                probs, labels, manifest.labels, info["label_path_delimiter"],
                ts.Thresholds.from_record(info.get("thresholds") or {}, manifest.labels)))
        if alone is not None:  # the transformer alone, at the thresholds chosen for it alone on val
            own = info["combine"].get("transformer_thresholds") or info.get("thresholds")
            transformer, _ = tags.evaluate(alone, labels, index, manifest, cfg.eval.split, own, 0)
            metrics["transformer"] = {k: transformer[k] for k in ("accuracy", "macro_f1", "micro_f1", "per_class")}
            metrics["mix_weight"] = float(info["combine"]["weight"])
        return metrics, mistakes
    metrics = classification_metrics(probs, labels, manifest.labels, calibration_bins=cfg.eval.calibration_bins)
    if alone is not None:
        transformer = classification_metrics(alone, labels, manifest.labels)
        metrics["transformer"] = {k: transformer[k] for k in ("accuracy", "macro_f1")}
        metrics["mix_weight"] = float(info["combine"]["weight"])
    if info.get("label_path_delimiter"):
        from torchloom.evaluate import levels

        levels.record(metrics, info["label_path_delimiter"],
                      levels.single_label(probs, labels, manifest.labels, info["label_path_delimiter"]))
    pred = probs.argmax(axis=1) if len(probs) else np.zeros(0, np.int64)
    wrong = np.nonzero(pred != labels)[0]
    # Most confident mistakes first: those are the ones worth reading.
    wrong = wrong[np.argsort(-probs[wrong, pred[wrong]])][: cfg.eval.misclassified_limit]
    texts = texts_at(manifest, cfg.eval.split, {int(index[i]) for i in wrong})
    misclassified = [
        {"text": texts.get(int(index[i]), ""), "true": manifest.labels[labels[i]],
         "predicted": manifest.labels[pred[i]], "score": round(float(probs[i, pred[i]]), 6)}
        for i in wrong
    ]
    return metrics, misclassified
