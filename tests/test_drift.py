"""The monitors' arithmetic (drift.py): thresholds drawn from the reference keep false alarms at the chosen rate
on windows like it, a real shift is found, and the accuracy estimated from confidence holds the real accuracy."""

from __future__ import annotations

import numpy as np
import pytest

from torchloom.monitor.drift import Kernel, Texts, distances, estimated_accuracy, signal_names, thresholds, verdict

KERNEL = Kernel.draw(np.random.default_rng(0).standard_normal((500, 32)).astype(np.float32))


def sketches(rng, n: int, moved: float = 0.0) -> np.ndarray:
    """Pooled representations, sketched: one Gaussian cloud per class centre; `moved` pushes every text along one
    direction (a new domain the head still maps to the same classes)."""
    centres = np.random.default_rng(99).standard_normal((5, 32))
    rows = centres[rng.integers(0, 5, n)] + rng.standard_normal((n, 32))
    rows[:, 0] += moved
    return rows.astype(np.float32)


def texts(rng, n: int, shift: float = 0.0, classes=(0.3, 0.25, 0.2, 0.15, 0.1), moved: float = 0.0,
          sketched: bool = True) -> Texts:
    """Signals like a classifier's: skewed classes, confidence near 1, log-normal lengths, a few unknown tokens,
    and (sketched) the representation's features."""
    predicted = rng.choice(len(classes), n, p=classes)
    confidence = np.clip(rng.beta(8 - 6 * shift, 1.5, n), 0, 1)
    length = (rng.lognormal(5 + shift, 0.5, n)).astype(int) + 3
    return make(predicted=predicted, confidence=confidence, length=length,
                unknown=np.clip(rng.exponential(0.01 + 0.02 * shift, n), 0, 1),
                truncated=(length > MAX_LENGTH).astype(float),
                features=KERNEL.features(sketches(rng, n, moved + shift)) if sketched else None)


MAX_LENGTH = 400  # about 7 % of the texts above longer than the model reads


def make(features=None, **columns) -> Texts:
    return Texts({k: np.asarray(v) for k, v in columns.items()}, features)


def but(base: Texts, features=None, **changed) -> Texts:
    """`base` with some columns changed (and features, else none)."""
    return make(features, **{**base.values, **changed})


@pytest.mark.parametrize("size", [30, 200])
def test_windows_like_the_reference_raise_the_verdict_at_most_at_the_chosen_rate(size):
    rng = np.random.default_rng(7)
    reference = texts(rng, 1000)
    limits = thresholds(reference, size, 5, false_alarm=0.05)
    alarms = [bool(verdict(distances(texts(rng, size), reference, 5), limits)) for _ in range(400)]
    assert np.mean(alarms) <= 0.05 + 2 * np.sqrt(0.05 * 0.95 / 400)  # the bound, give or take its noise
    # ...and a shift in the inputs is found in nearly every window
    found = [bool(verdict(distances(texts(rng, size, shift=0.5), reference, 5), limits)) for _ in range(50)]
    assert np.mean(found) >= 0.9


def test_each_signal_answers_to_its_own_shift():
    rng = np.random.default_rng(3)
    reference = texts(rng, 1000)
    limits = thresholds(reference, 200, 5)
    base = texts(rng, 200)
    shifted = {
        "classes": but(base, predicted=np.zeros(200, int)),  # one class only
        "length": but(base, length=base.length * 4),  # four times longer
        "unknown": but(base, unknown=base.unknown + 0.2),  # another language
        "confidence": but(base, confidence=np.clip(base.confidence - 0.3, 0, 1)),
        "truncated": but(base, truncated=(rng.random(200) < 0.4).astype(float)),  # 40 % cut, not 7 %
        # the same classes, confidence, lengths and tokens: only the representation moved (a new domain)
        "representation": but(base, KERNEL.features(sketches(rng, 200, moved=1.0))),
    }
    assert verdict(distances(base, reference, 5), limits) == []
    for name, window in shifted.items():
        assert name in verdict(distances(window, reference, 5), limits), name
    assert verdict(distances(shifted["representation"], reference, 5), limits) == ["representation"]
    assert set(limits) == set(signal_names())
    # without sketches (an ONNX runtime, an older profile): the other signals, Bonferroni over them
    bare = but(reference)
    assert set(thresholds(bare, 200, 5)) == set(signal_names()) - {"representation"} == set(bare.signals)
    # a profile from before a signal (no `truncated` column): that signal is not compared, the others are
    older = Texts({k: v for k, v in reference.values.items() if k != "truncated"}, reference.features)
    assert "truncated" not in distances(base, older, 5) and "truncated" not in thresholds(older, 200, 5)
    assert verdict(distances(shifted["length"], older, 5), thresholds(older, 200, 5)) == ["length"]
    assert "representation" not in distances(shifted["representation"], bare, 5)


def test_the_accuracy_estimate_holds_the_real_accuracy_where_confidence_is_calibrated():
    rng = np.random.default_rng(11)
    reference = texts(rng, 1000, sketched=False)
    correct = rng.random(1000) < reference.confidence  # a calibrated model: right as often as it is confident
    held = []
    for shift in (0.0, 0.0, 0.3, 0.6):  # less confident windows: the estimate follows them down
        for _ in range(25):
            window = texts(rng, 300, shift=shift, sketched=False)
            truth = np.mean(rng.random(300) < window.confidence)
            estimate, low, high = estimated_accuracy(window.confidence, reference, correct)
            held.append(low <= truth <= high)
            assert abs(estimate - truth) < 0.12
    assert np.mean(held) >= 0.9
