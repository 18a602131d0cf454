"""A served model's reference profile: what normal looks like, written at export beside the model
(`model/monitor/profile.json`, plain JSON; `from_pretrained` ignores the folder) and read by every monitor.

It holds, for up to PROFILE_TEXTS texts of the validation split (then test) that the exported model scored as a
server would (the same cleaning, truncation and shipped mix: Predictor), each text's signals (drift.SIGNALS:
predicted class, confidence, tokens before truncation, share of unknown tokens) and whether the prediction was
right, from which a monitor draws its thresholds and its accuracy estimate (monitor/drift.py). A multi-label model's
(task multi_label): its top tag is the predicted class and its probability the confidence, right when the text holds
that tag (the accuracy a monitor estimates is the top tag's precision), and each text's tags are kept beside them.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from torchloom.errors import UserError, first_line
from torchloom.monitor.drift import FALSE_ALARM, Kernel, Reading, Texts

PROFILE_DIR = "monitor"
PROFILE_FILE = "profile.json"
SKETCH_FILE = "sketch.safetensors"  # the projection, the reference texts' sketches and the kernel's features
SKETCH_DIMS = 32
FORMAT = "torchloom-monitor/2"  # /1 (one day old) measured lengths and unknown tokens otherwise
PROFILE_TEXTS = 1000  # at most: the thresholds' resampled windows are drawn from these
MIN_PROFILE_TEXTS = 100  # at least: fewer held-out texts say too little of what normal looks like
REEXPORT = "export it again (torchloom export --output.dir RUN) to monitor it"


def text_signals(labels: list[str], answers: list[dict[str, Any]], kernel: Kernel | None = None,
                 max_length: int | None = None) -> Texts:
    """The signals of texts from a Predictor's answers for them, given `with_signals` (drift.SIGNALS: each row's
    value read off each answer; `max_length`, the model's, for what depends on it): the same
    numbers a server reads off the inputs it encoded anyway, so that a profile, a batch monitor and a server's
    window all measure alike (length: tokens before truncation, estimated from characters past the start a
    `head` model encodes; unknown: the share of unknown tokens among those the model reads; with a kernel and
    sketches in the answers, the representation's features)."""
    features = None
    if kernel is not None and answers and all("sketch" in a for a in answers):
        features = kernel.features(np.stack([a["sketch"] for a in answers]))
    return Texts.read(answers, Reading({label: i for i, label in enumerate(labels)}, max_length), features)


def right(predicted: str, truth: str) -> bool:
    """Whether a prediction's label is right: the true label, or (a tagger's top tag) one of the text's tags."""
    from torchloom.text.tags import is_set, of_label

    return predicted in of_label(truth) if is_set(truth) else predicted == truth


def projection(hidden: int, seed: int = 0) -> np.ndarray:
    """The fixed random projection of a pooled representation to SKETCH_DIMS dimensions (Johnson-Lindenstrauss:
    distances kept to within a few tens of percent, which a two-sample test needs, at a few % of the size)."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((hidden, SKETCH_DIMS)) / np.sqrt(SKETCH_DIMS)).astype(np.float32)


def sketching(predictor) -> np.ndarray | None:
    """Give a PyTorch predictor the projection (None for an ONNX one: its graph gives logits only)."""
    if predictor.model is None:
        return None
    predictor.sketch = projection(int(predictor.model.config.hidden_size))
    return predictor.sketch


def write_profile(model_dir: str | Path, texts: list[str], labels: list[str], splits: dict[str, int],
                  device: str = "cpu") -> dict:
    """Score `texts` (with their true `labels`) with the exported model and write its profile; returns it."""
    from safetensors.numpy import save_file

    from torchloom.model.predict import Predictor

    model_dir = Path(model_dir)
    earlier = model_dir / PROFILE_DIR
    if earlier.exists() and not ({p.name for p in earlier.iterdir()} <= {PROFILE_FILE, SKETCH_FILE}
                                 and _readable(model_dir)):
        raise UserError(f"model dir {model_dir}: {PROFILE_DIR}/ holds files torchloom did not write there; move it"
                        " away to write the model's monitoring profile")
    predictor = Predictor(str(model_dir), device=device)
    sketching(predictor)
    answers = predictor.predict(texts, with_signals=True)
    signals = text_signals(predictor.labels, answers, max_length=predictor.max_length)
    sketches = np.stack([a["sketch"] for a in answers]) if answers and all("sketch" in a for a in answers) else None
    correct = [right(a["label"], y) for a, y in zip(answers, labels)]
    profile = {
        "format": FORMAT, "labels": predictor.labels, "texts": len(texts), "splits": splits,
        "max_length": predictor.max_length, "false_alarm": FALSE_ALARM,
        "accuracy": round(float(np.mean(correct)), 6) if correct else None,
        "reference": {**signals.columns(), "correct": [bool(c) for c in correct]},
    }
    if predictor.multi_label:  # a tagger: its top tag is `predicted`; each text's tags over their thresholds too
        index = {label: i for i, label in enumerate(predictor.labels)}
        profile["task"] = "multi_label"
        profile["reference"]["tags"] = [[index[t] for t in a["labels"]] for a in answers]
    tmp = model_dir / f".{PROFILE_DIR}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    if sketches is not None:
        kernel = Kernel.draw(sketches)
        save_file({"projection": predictor.sketch, "reference": sketches.astype(np.float32),
                   "weights": kernel.weights, "phase": kernel.phase}, str(tmp / SKETCH_FILE))
        profile["sketch"] = {"file": SKETCH_FILE, "dims": SKETCH_DIMS, "features": len(kernel.phase),
                             "pooling": "mean of the last hidden states over the text's tokens"}
    (tmp / PROFILE_FILE).write_text(json.dumps(profile, separators=(",", ":")) + "\n", encoding="utf-8")
    shutil.rmtree(earlier, ignore_errors=True)  # an earlier profile alone (checked above)
    os.replace(tmp, earlier)
    return profile


def read_profile(model_dir: str | Path) -> dict | None:
    """The model's profile, None for a model exported before profiles; one line for a damaged one."""
    path = Path(model_dir) / PROFILE_DIR / PROFILE_FILE
    if not path.is_file():
        return None
    try:
        profile = json.loads(path.read_text(encoding="utf-8"))
        if profile.get("format") != FORMAT:
            raise ValueError(f"format {profile.get('format')!r}, not {FORMAT}")
        reference = profile["reference"]
        signals = Texts.of(reference)
        missing = {"predicted", "confidence", "length", "unknown"} - set(signals.values)  # the first four rows'
        if missing:
            raise KeyError(", ".join(sorted(missing)))
        sizes = {*(len(v) for v in signals.values.values()), len(reference["correct"])}
        if len(sizes) != 1 or not len(signals) or not isinstance(profile["labels"], list):
            raise ValueError("its arrays are empty or of different lengths")
        if signals.predicted.min() < 0 or signals.predicted.max() >= len(profile["labels"]):
            raise ValueError("a predicted class outside its labels")
        if "sketch" in profile:
            profile["_sketch"] = _read_sketch(path.parent / SKETCH_FILE, len(signals))
    except _Damaged as e:
        raise UserError(f"model dir {model_dir}: {PROFILE_DIR}/ cannot be read ({e}); {REEXPORT}") from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise UserError(f"model dir {model_dir}: {PROFILE_DIR}/ cannot be read ({PROFILE_FILE}: {first_line(e)});"
                        f" {REEXPORT}") from None
    return profile


class _Damaged(Exception):
    """The sketch file cannot be used (its message says why in a few words)."""


def _read_sketch(path: Path, texts: int) -> dict[str, Any]:
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    try:
        arrays = load_file(str(path))
        kernel = Kernel(arrays["weights"], arrays["phase"])
        reference, proj = arrays["reference"], arrays["projection"]
    except FileNotFoundError:
        raise _Damaged(f"{SKETCH_FILE} is missing") from None
    except (SafetensorError, OSError, KeyError):
        raise _Damaged(f"{SKETCH_FILE} is damaged") from None
    if reference.shape != (texts, proj.shape[1]) or kernel.weights.shape != (proj.shape[1], len(kernel.phase)):
        raise _Damaged(f"{SKETCH_FILE} holds arrays of shapes that do not fit together")
    return {"projection": proj, "kernel": kernel, "features": kernel.features(reference), "reference": reference}


def _readable(model_dir: Path) -> bool:
    try:
        return read_profile(model_dir) is not None
    except UserError:
        return False


def reference_texts(profile: dict, sketched: bool = True) -> Texts:
    """The profile's reference texts, with the representation's features where it has a sketch and `sketched`
    (the texts compared with it carry sketches too)."""
    texts = Texts.of(profile["reference"])
    if sketched and "_sketch" in profile:
        texts.features = profile["_sketch"]["features"]
    return texts


def kernel_for(profile: dict, predictor) -> Kernel | None:
    """Give `predictor` the profile's projection and return its kernel, where both can sketch (a PyTorch runtime,
    the model's hidden size); None otherwise: the representation is then not compared."""
    sketch = profile.get("_sketch")
    if (sketch is None or predictor.model is None
            or int(predictor.model.config.hidden_size) != sketch["projection"].shape[0]
            or (predictor.lexical is not None and predictor.weight == 0.0)):  # the baseline alone: no forward runs
        return None
    predictor.sketch = sketch["projection"]
    return sketch["kernel"]
