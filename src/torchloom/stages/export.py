"""The export stage: the chosen checkpoint as a model directory (Hugging Face format, ONNX beside it with
export.format), shipped alone or mixed with the baseline (export.combine)."""

from __future__ import annotations

import time
from pathlib import Path

from torchloom.config import Config
from torchloom.console import combine_line, say
from torchloom.jsonio import read_json
from torchloom.runs.ledger import LocalTree, deletable
from torchloom.runs.run import Run
from torchloom.runs.runfiles import RunFiles
from torchloom.stages import recorded


def _replaceable(run: Run) -> dict | None:
    """The export replaces model/ whole: only when all of it is torchloom's (a base model kept there is refused),
    and as it is now (export_model checks again right before the swap). {path in model/: stat}."""
    files = run.files
    vouched = set(deletable(files.place.tree(), "output.dir", run.cfg.inputs(), under="model"))
    return None if files.on_store else {  # a store run's model/ is this host's copy (the cache's)
        rel: st for rel, st in LocalTree(run.rd.model).inventory().items() if f"model/{rel}" in vouched}


@recorded
def export_stage(run: Run) -> dict:
    from torchloom import __version__
    from torchloom import manifest as manifest_mod
    from torchloom.embedded import model_path
    from torchloom.model.build import build_classifier
    from torchloom.model.export import export_model
    from torchloom.train import checkpoint

    cfg, rd, files, tracker = run.cfg, run.rd, run.files, run.tracker
    started = time.perf_counter()
    files.ensure(rd.data)
    replaceable = _replaceable(run)
    files.checkpoints.pull()
    ckpt = checkpoint.select(rd.checkpoints, cfg.train.select)
    m = manifest_mod.read(rd.data)
    src = model_path(cfg.model.path)
    model = build_classifier(src, m.labels, multi_label=m.multi_label)
    model.load_state_dict(checkpoint.load_weights(ckpt))
    meta = checkpoint.read_meta(ckpt)
    combine, tagged = _mix_and_thresholds(run, model, m)
    shipped = combine is not None and combine["weight"] < 1.0
    out = export_model(model, src, m.labels, str(rd.model), extra_info={
        "torchloom_version": __version__, "checkpoint": rd.home(ckpt), "step": meta.get("step"),
        "validation": meta.get("eval", {}), "data_fingerprint": m.fingerprint,
        "max_length": m.tokenizer.get("max_length"), "truncation": m.tokenizer.get("truncation", "head"),
        **{k: m.tokenizer[k] for k in ("stride", "max_chunks") if k in m.tokenizer},
        **({"combine": combine} if combine else {}),
        **({"task": "multi_label", "thresholds": tagged[0]} if tagged else {}),
        **{k: v for k, v in m.inputs.items() if k == "label_path_delimiter"},  # hierarchical: text/hierarchy.py
    }, extra_dirs={"baseline": rd.baseline_model} if shipped else None, replaceable=replaceable)
    say(f"export: {ckpt.name} -> {rd.home(out)}")
    if combine:
        say(f"export: {combine_line(combine)}")
    if tagged:
        say(f"export: {tagged[1]}")
    onnx_info = None
    if cfg.export.format != "hf":
        from torchloom.data.texts import gate_rows
        from torchloom.model.onnx import export_onnx

        onnx_info = export_onnx(out, gate_rows(m, cfg.export.gate_rows), cfg.export.format,
                                say=lambda msg: say(f"export: {msg}"))
    try:
        profile = _profile(out, m, cfg)
    except Exception as e:  # the model is exported whatever: a monitor of it is what is missing, said in one line
        from torchloom.errors import first_line

        say(f"export: warning: no monitoring profile ({first_line(e)}); `torchloom monitor` needs one: export again")
        profile = None
    files.push(rd.model)
    registered = None
    if cfg.export.register:  # logs the model to the run, then registers it: one line if the registry says no
        registered = _register(run, out, m, meta)
    elif tracker is not None and tracker.enabled and cfg.tracking.log_model:
        tracker.log_model(out)
    return {"seconds": round(time.perf_counter() - started, 2), "checkpoint": str(ckpt), "model_dir": out,
            "onnx": onnx_info, "profile": profile, "registered": registered}


def _register(run: Run, out: str, m, meta: dict) -> dict:
    """The exported model as a new version of export.register in MLflow's registry (registry.py), tagged with where
    it came from: the run, the data (its fingerprint, and a table's version) and the validation metrics."""
    from torchloom import registry
    from torchloom.tracking import NullTracker

    cfg = run.cfg
    val = shipped_validation(out, meta)
    tags = {"torchloom.output_dir": run.rd.where, "torchloom.data_fingerprint": m.fingerprint,
            **{f"torchloom.data_{k}": v for k, v in m.inputs.items() if k in ("path", "format", "version")},
            **{f"val_{k}": v for k, v in val.items()}}
    tracker = run.tracker or NullTracker()
    tracker.log_metrics({f"val_{k}": v for k, v in val.items()})  # the export's run shows what it shipped
    done = registry.register(tracker, out, cfg.export.register, cfg.export.alias, tags)
    say(f"export: registered as version {done['version']} of {done['name']}"
        + (f", alias {done['alias']}" if done["alias"] else "") + f": serve it with torchloom serve {done['uri']}")
    return done


def shipped_validation(model_dir: str, meta: dict) -> dict[str, float]:
    """The validation metrics of the model as shipped: the checkpoint's (the transformer's), with accuracy the mix's
    where the export ships a mix with the baseline (torchloom.json "combine"), the transformer's then beside it."""
    val = {k: v for k, v in (meta.get("eval") or {}).items() if isinstance(v, int | float)}
    info = read_json(Path(model_dir) / "torchloom.json") or {}
    mixed = (info.get("combine") or {}).get("val_accuracy") or {}
    if info.get("combine", {}).get("weight", 1.0) < 1.0 and isinstance(mixed.get("shipped"), int | float):
        val["accuracy_transformer"] = mixed.get("transformer", val.get("accuracy"))
        val["accuracy"] = mixed["shipped"]
    return val


def _profile(model_dir: str, m, cfg: Config) -> dict | None:
    """The served model's reference profile (monitor/profile.py) from val's texts, then test's: what a monitor
    compares traffic with. None (said) where the run has no such texts."""
    from torchloom.data.texts import labelled_texts
    from torchloom.monitor.profile import MIN_PROFILE_TEXTS, PROFILE_TEXTS, write_profile

    texts: list[str] = []
    labels: list[str] = []
    splits = {}
    for split in ("val", "test"):
        more, their = labelled_texts(m, split, PROFILE_TEXTS - len(texts))
        texts, labels, splits[split] = texts + more, labels + their, len(more)
    if len(texts) < MIN_PROFILE_TEXTS:
        say(f"export: no monitoring profile: {len(texts)} val and test texts, and a monitor needs at least"
            f" {MIN_PROFILE_TEXTS} to know what normal looks like (more data, or larger data.val_fraction and"
            " data.test_fraction)")
        return None
    from torchloom.model.device import resolve_device

    started = time.perf_counter()
    write_profile(model_dir, texts, labels, splits, device=resolve_device("cpu" if cfg.engine.device == "cpu"
                                                                          else "auto"))
    say(f"export: monitoring profile of {len(texts)} texts (val {splits['val']}, test {splits['test']}) in"
        f" {time.perf_counter() - started:.1f} s: what `torchloom monitor` and the server compare traffic with")
    return {"texts": len(texts), "splits": splits}


def _mix_and_thresholds(run: Run, model, m) -> tuple[dict | None, tuple[dict, str] | None]:
    """The mix with the baseline (None: the transformer alone) and, for tags, the thresholds with their line; val
    scored by Spark tasks where it is large (eval.score_with)."""
    from torchloom.stages.sessions import ScoringSpark

    with ScoringSpark(run, "export") as spark:
        if m.multi_label:
            return _tagging(run.cfg, run.files, model, m, spark)
        return choose_combine(run.cfg, run.files, model, m, spark), None


def _tagging(cfg: Config, files: RunFiles, model, m, spark=None) -> tuple[dict | None, tuple[dict, str]]:
    """A multi-label model's mix with the baseline (export.combine, chosen by val micro-F1: evaluate/mix.py) and its
    thresholds, chosen on the val split for what it ships (evaluate/tags.py), with the line saying so."""
    import numpy as np

    from torchloom.evaluate import tags
    from torchloom.evaluate.mix import choose_tag_combine
    from torchloom.evaluate.run import split_probabilities

    probs, masks, index = (split_probabilities(cfg, model, m, "val", spark) if m.split("val").rows else
                           (np.zeros((0, 1)),) * 3)
    combine = None
    if cfg.export.combine != "off" and _baseline_fitted(files, m):
        combine, probs = choose_tag_combine(cfg.export.combine, probs, masks, index, m, files.rd.baseline_model)
    return combine, tags.choose(probs, masks, m, cfg.export.top_k)


def _baseline_fitted(files: RunFiles, m) -> bool:
    """Whether the run's baseline (and its arrays, where its path gives them) was fitted on these prepared rows."""
    rd = files.rd
    files.ensure(rd.baseline, rd.baseline_model)
    try:
        return read_json(rd.baseline).get("fingerprint") == m.fingerprint
    except (OSError, ValueError):
        return False


def choose_combine(cfg: Config, files: RunFiles, model, m, spark=None) -> dict | None:
    """export.combine: the transformer's weight in the shipped mix with the baseline, chosen on val (evaluate/mix.py);
    None without a baseline fitted on these prepared rows by the driver. spark: as split_probabilities'."""
    if cfg.export.combine == "off" or not _baseline_fitted(files, m):  # no baseline, or one of other rows: alone
        return None
    from torchloom.evaluate.mix import choose_combine as choose
    from torchloom.evaluate.run import split_probabilities

    return choose(cfg.export.combine, lambda: split_probabilities(cfg, model, m, "val", spark), m,
                  files.rd.baseline_model)
