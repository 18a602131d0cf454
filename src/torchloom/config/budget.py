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

`train.batch_size auto` keeps that rule's steps with room to spare: the global batch starts at BATCH (16, the batch
it was measured at) and doubles while MIN_EPOCHS epochs still give BATCH_MARGIN times STEPS_PER_CLASS steps a class,
up to AUTO_BATCH_TOKENS a step. The demo (1,780 training rows, 5 classes) stays at 16; a million rows of 128 tokens
train at 256, where 16 would take 125,000 optimizer steps and leave every GPU but a sliver idle. The margin rests
on measurements (docs/benchmarks.md, "The global batch"): SMS spam at 64 (1.3 times the steps needed) lost 0.6
points against 16 on all of three seeds, and at 32 (2.5 times) 0.4 on average; TREC at 32 (1 time) gained 0.4. So
every corpus measured keeps 16, and the batch grows only where steps are plentiful (a large corpus). The choice
depends on the data alone (never on the workers or the device), so one config gives the same batches on every
engine and machine.

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
BATCH = 16  # the global batch train.batch_size auto starts from (and stays at on small data)
AUTO_BATCH_TOKENS = 32_768  # the most tokens a global batch of train.batch_size auto holds: 256 rows of 128
BATCH_MARGIN = 4  # train.batch_size auto grows only while 2 epochs give this many times the steps a class needs
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


def choose_batch(classes: int, train_rows: int, max_length: int, multiple: int = 1) -> tuple[int, str]:
    """(global batch, why in a few words) for train.batch_size auto; `multiple`: what the batch must divide into
    (workers x grad_accum), the batch rounded up to it."""
    needed = BATCH_MARGIN * STEPS_PER_CLASS * classes
    most = max(BATCH, AUTO_BATCH_TOKENS // max(1, max_length))
    batch = BATCH
    while batch * 2 <= most and MIN_EPOCHS * math.ceil(train_rows / (batch * 2)) >= needed:
        batch *= 2
    batch = math.ceil(batch / multiple) * multiple
    why = (f"the most that still gives {BATCH_MARGIN} x {classes} classes x {STEPS_PER_CLASS} steps in {MIN_EPOCHS}"
           f" epochs of {train_rows} rows, at most {most} rows of {max_length} tokens")
    return batch, why if batch > BATCH else f"{why}: small data keeps {BATCH}"


def known_batch(train_cfg) -> int:
    """train.batch_size, or what auto starts from before the data is known (every batch auto chooses is a multiple
    of it, rounded up to the workers)."""
    return BATCH if train_cfg.batch_size == "auto" else train_cfg.batch_size


def resolve(cfg, classes: int, train_rows: int, max_length: int = 128, multiple: int = 1,
            resumed_batch: int | None = None):
    """cfg with train.batch_size, train.epochs and train.early_stopping_patience made numbers for this data, and
    one line saying what was chosen and why (None when the user set them all). resumed_batch: the global batch of
    the run being resumed, which batch_size auto keeps (its loader state holds it)."""
    t = cfg.train
    budget_seconds(t.budget)  # a bad value is refused even where nothing is auto
    said = []
    if t.batch_size == "auto":
        batch, why = ((resumed_batch, "the resumed run's") if resumed_batch else
            choose_batch(classes, train_rows, max_length, multiple))
        t = replace(t, batch_size=batch)
        if batch != BATCH or resumed_batch:  # 16 is what every small run had, and the start line shows it
            said.append(f"batch_size auto: {batch} ({why})")
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
