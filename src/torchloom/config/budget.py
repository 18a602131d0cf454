"""How long to train when the user did not say: `train.epochs auto` and `train.early_stopping_patience auto`,
within `train.budget`.

The rule (docs/benchmarks.md, "The model we ship: transformer, baseline and the mix", six corpora): a classifier
needs about STEPS_PER_CLASS optimizer steps of the global batch per class to learn, whatever the corpus's size, so

    epochs = steps_per_class x classes / steps_per_epoch, rounded, at least MIN_EPOCHS

five topics from 1,700 news articles take 2 epochs at batch 16 (the demo, as before); twenty newsgroups from
3,200 posts 5; a large corpus never fewer than 2 (a second epoch helped on every set measured). The budget caps
it: `auto` at AUTO_MAX_EPOCHS (no run trains more than 2.5 times the old fixed 2 epochs), a duration (seconds,
or "30m", "2h") at MAX_EPOCHS with training stopped at the first evaluation past the time, `off` at the old fixed
2 epochs without early stopping. With more than MIN_EPOCHS, training stops once validation has not improved for
AUTO_PATIENCE evaluation(s), and export takes the best checkpoint on validation (train.select best).

Nothing heavy is imported here.
"""

from __future__ import annotations

import math
import re
from dataclasses import replace

from torchloom.errors import UserError

STEPS_PER_CLASS = 45
MIN_EPOCHS = 2  # the old fixed default: what `train.budget off` keeps
AUTO_MAX_EPOCHS = 5
MAX_EPOCHS = 10
AUTO_PATIENCE = 2
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*$")


def budget_seconds(budget: str) -> float | None:
    """train.budget as seconds; None for auto and off. A value that is neither is one line."""
    if budget in ("auto", "off"):
        return None
    m = _DURATION.match(str(budget))
    if not m or float(m.group(1)) <= 0:
        raise UserError(f"config train.budget: {budget!r} is not auto, off or a duration; use e.g. 1800, 30m or 2h")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]


def choose_epochs(budget: str, classes: int, train_rows: int, batch_size: int) -> tuple[int, str]:
    """(epochs, why in a few words) for train.epochs auto."""
    if budget == "off":
        return MIN_EPOCHS, f"budget off: the fixed {MIN_EPOCHS}"
    cap = AUTO_MAX_EPOCHS if budget == "auto" else MAX_EPOCHS
    per_epoch = max(1, math.ceil(train_rows / batch_size))
    wanted = STEPS_PER_CLASS * classes / per_epoch
    epochs = min(cap, max(MIN_EPOCHS, math.floor(wanted + 0.5)))
    return epochs, (f"{classes} classes x {STEPS_PER_CLASS} steps over {per_epoch} steps an epoch"
                    f" = {wanted:.1f}, kept within {MIN_EPOCHS}..{cap} (budget {budget})")


def resolve(cfg, classes: int, train_rows: int):
    """cfg with train.epochs and train.early_stopping_patience made numbers for this data, and one line saying
    what was chosen and why (None when the user set both)."""
    t = cfg.train
    budget_seconds(t.budget)  # a bad value is refused even where nothing is auto
    said = []
    epochs, patience, chosen = t.epochs, t.early_stopping_patience, t.epochs == "auto"
    if chosen:
        epochs, why = choose_epochs(t.budget, classes, train_rows, t.batch_size)
        said.append(f"epochs auto: {epochs} ({why})")
    if patience == "auto":
        patience = AUTO_PATIENCE if chosen and t.budget != "off" and epochs > MIN_EPOCHS and not t.max_steps else 0
        if patience:
            said.append(f"stops once validation {t.metric} has not improved for {patience} evaluation(s),"
                        f" and exports the best checkpoint on it")
    if t.budget not in ("auto", "off"):
        said.append(f"at most {t.budget} of training (stopped at the first evaluation past it)")
    return replace(cfg, train=replace(t, epochs=epochs, early_stopping_patience=patience)), "; ".join(said) or None
