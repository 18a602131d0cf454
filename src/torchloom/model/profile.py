"""A served model's reference profile: what normal looks like, written at export beside the model
(`model/monitor/profile.json`, plain JSON; `from_pretrained` ignores the folder) and read by every monitor.

It holds, for up to PROFILE_TEXTS texts of the validation split (then test) that the exported model scored as a
server would (the same cleaning, truncation and shipped mix: Predictor), each text's signals (drift.SIGNALS:
predicted class, confidence, tokens before truncation, share of unknown tokens) and whether the prediction was
right, from which a monitor draws its thresholds and its accuracy estimate (drift.py).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from torchloom.drift import FALSE_ALARM, Texts
from torchloom.errors import UserError, first_line

PROFILE_DIR = "monitor"
PROFILE_FILE = "profile.json"
FORMAT = "torchloom-monitor/2"  # /1 (one day old) measured lengths and unknown tokens otherwise
PROFILE_TEXTS = 1000  # at most: the thresholds' resampled windows are drawn from these
MIN_PROFILE_TEXTS = 100  # at least: fewer held-out texts say too little of what normal looks like
REEXPORT = "export it again (torchloom export --output.dir RUN) to monitor it"


def text_signals(labels: list[str], answers: list[dict[str, Any]]) -> Texts:
    """The signals of texts from a Predictor's answers for them, given `with_signals` (drift.SIGNALS): the same
    numbers a server reads off the inputs it encoded anyway, so that a profile, a batch monitor and a server's
    window all measure alike (length: tokens before truncation, estimated from characters past the start a
    `head` model encodes; unknown: the share of unknown tokens among those the model reads)."""
    index = {label: i for i, label in enumerate(labels)}
    return Texts(predicted=np.array([index[a["label"]] for a in answers], np.int64),
                 confidence=np.array([a["score"] for a in answers], np.float64),
                 length=np.array([a["tokens"] for a in answers], np.int64),
                 unknown=np.array([a["unknown"] for a in answers], np.float64))


def write_profile(model_dir: str | Path, texts: list[str], labels: list[str], splits: dict[str, int],
                  device: str = "cpu") -> dict:
    """Score `texts` (with their true `labels`) with the exported model and write its profile; returns it."""
    from torchloom.model.predict import Predictor

    model_dir = Path(model_dir)
    earlier = model_dir / PROFILE_DIR
    if earlier.exists() and not (sorted(p.name for p in earlier.iterdir()) == [PROFILE_FILE]
                                 and read_profile(model_dir) is not None):
        raise UserError(f"model dir {model_dir}: {PROFILE_DIR}/ holds files torchloom did not write there; move it"
                        " away to write the model's monitoring profile")
    predictor = Predictor(str(model_dir), device=device)
    answers = predictor.predict(texts, with_signals=True)
    signals = text_signals(predictor.labels, answers)
    correct = [a["label"] == y for a, y in zip(answers, labels)]
    profile = {
        "format": FORMAT, "labels": predictor.labels, "texts": len(texts), "splits": splits,
        "max_length": predictor.max_length, "false_alarm": FALSE_ALARM,
        "accuracy": round(float(np.mean(correct)), 6) if correct else None,
        "reference": {"predicted": signals.predicted.tolist(),
                      "confidence": [round(float(c), 6) for c in signals.confidence],
                      "length": signals.length.tolist(), "unknown": [round(float(u), 6) for u in signals.unknown],
                      "correct": [bool(c) for c in correct]},
    }
    tmp = model_dir / f".{PROFILE_DIR}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
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
        sizes = {len(signals.predicted), len(signals.confidence), len(signals.length), len(signals.unknown),
                 len(reference["correct"])}
        if len(sizes) != 1 or not len(signals) or not isinstance(profile["labels"], list):
            raise ValueError("its arrays are empty or of different lengths")
        if signals.predicted.min() < 0 or signals.predicted.max() >= len(profile["labels"]):
            raise ValueError("a predicted class outside its labels")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise UserError(f"model dir {model_dir}: {PROFILE_DIR}/{PROFILE_FILE} cannot be read ({first_line(e)}); "
                        f"{REEXPORT}") from None
    return profile
