"""Drift arithmetic, numpy only: what a window of texts is compared on, its distance to the model's reference
profile on each signal, the thresholds that give a chosen false-alarm rate, and the accuracy expected from the
model's confidence where no labels are there.

Signals (the table SIGNALS, a row each; one value per text, read off the same answer for the reference at export
and for traffic later):
    classes     the predicted class            Jensen-Shannon distance of the class shares
    confidence  the top probability            Jensen-Shannon distance of a 10-bin histogram on [0, 1]
    length      tokens before truncation       two-sample Kolmogorov-Smirnov statistic (of log lengths)
    unknown     the share of unknown tokens    two-sample Kolmogorov-Smirnov statistic
    truncated   1 where the text is longer than the model's max_length (cut, or in several windows), else 0:
                two-sample Kolmogorov-Smirnov statistic (the gap between the two shares)
    representation  the model's pooled representation, sketched (a fixed random projection to a few dozen
                dimensions, monitor/profile.py)  maximum mean discrepancy with a Gaussian kernel, estimated with
                random Fourier features: the distance between the two samples' mean feature vectors (where the
                profile has a sketch: PyTorch runtimes)

Thresholds are chosen, not guessed: windows of the same size are drawn from the reference itself (without
replacement) and compared with the rest of it; a signal's threshold is the (1 - false_alarm / signals) quantile
of those distances, so a window from the validation distribution raises the verdict with probability at most
`false_alarm` (Bonferroni over the signals). A window larger than half the reference is calibrated at half its
size: a larger window varies less, so the threshold errs towards fewer alarms. A Kolmogorov-Smirnov threshold is
at least one text's worth of the window plus the rule of three's 3/n of the reference: a reference that never
varies on a signal (no unknown token in any of its texts) would otherwise call one odd text drift.

Accuracy without labels (confidence-based performance estimation, as NannyML's CBPE): the reference's accuracy
per confidence bin (its texts have labels), averaged over the window's texts. Its interval holds the window's
own sampling and the bins' estimation; it assumes the model stays as calibrated as on the reference, which a
shift in what the labels mean (not only in the inputs) breaks: compare it with real labels when some come.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

FEATURES = 64  # random Fourier features of a sketch: the kernel's estimate is within ~1/sqrt(FEATURES) of it
CONFIDENCE_BINS = 10
DRAWS = 2000  # resampled windows per threshold: a 0.17 % tail (1 % over 6 signals) rests on 3 of them
FALSE_ALARM = 0.01  # the default chance that a window like the reference raises the verdict


def _js(p: np.ndarray, q: np.ndarray) -> float:
    """Jensen-Shannon distance (base 2, 0..1) between two histograms of counts."""
    p = p / max(p.sum(), 1)
    q = q / max(q.sum(), 1)
    m = (p + q) / 2

    def kl(a: np.ndarray) -> float:
        nz = a > 0
        return float(np.sum(a[nz] * np.log2(a[nz] / m[nz])))

    return float(np.sqrt(max(0.0, (kl(p) + kl(q)) / 2)))


def _ks(a: np.ndarray, b: np.ndarray) -> float:
    """Two-sample Kolmogorov-Smirnov statistic: the largest gap between the two empirical distributions."""
    a, b = np.sort(a), np.sort(b)
    grid = np.concatenate([a, b])
    return float(np.max(np.abs(np.searchsorted(a, grid, side="right") / len(a)
                               - np.searchsorted(b, grid, side="right") / len(b))))


@dataclass(frozen=True)
class Signal:
    """One row of the table of signals: what a monitor compares a window of texts with the reference on.

    name: as reports, gauges (the `signal` label) and the page show it; column: its values' key in a profile's
    reference and in Texts; read: a text's value off a Predictor answer (with signals) given the Reading (the
    labels' index, the model's max_length); kind: the distance (and so the threshold rule):
        shares     Jensen-Shannon distance of the class shares (one value per text: a class index)
        histogram  Jensen-Shannon distance of a 10-bin histogram on [0, 1]
        ks, ks_log two-sample Kolmogorov-Smirnov statistic (of the values, of log(1 + value)); its threshold is at
                   least one text's worth of the window plus 3/n of the reference (the rule of three)
        mmd        maximum mean discrepancy of the sketches' random Fourier features (no column: Texts.features)
    caveat: drift on it may break the calibration the accuracy estimate assumes; description: one line for people.
    """

    name: str
    column: str
    kind: str
    description: str
    read: Callable[[dict, Reading], float] | None = None
    integer: bool = False
    caveat: bool = False


@dataclass(frozen=True)
class Reading:
    """What reading a value off an answer may need: the model's labels (their index) and its max_length."""

    index: dict[str, int]
    max_length: int | None = None


# The table: a new signal is a row here (and, if an answer does not carry what it reads yet, that value in the
# Predictor's answers with signals). Everything that compares, calibrates, reports or shows signals reads it.
SIGNALS: list[Signal] = [
    Signal("classes", "predicted", "shares", "the predicted classes' shares (Jensen-Shannon distance)",
           lambda a, r: r.index[a["label"]], integer=True),
    Signal("confidence", "confidence", "histogram",
           "the model's confidence, top probability (Jensen-Shannon distance of a 10-bin histogram)",
           lambda a, r: a["score"], caveat=True),
    Signal("length", "length", "ks_log", "tokens per text before truncation (Kolmogorov-Smirnov statistic)",
           lambda a, r: a["tokens"], integer=True),
    Signal("unknown", "unknown", "ks", "share of tokens the tokenizer does not know (Kolmogorov-Smirnov statistic)",
           lambda a, r: a["unknown"], caveat=True),
    Signal("truncated", "truncated", "ks",
           "share of texts longer than the model reads, cut at its max_length (Kolmogorov-Smirnov statistic)",
           lambda a, r: float(r.max_length is not None and a["tokens"] > r.max_length)),
    Signal("representation", "features", "mmd",
           "the model's pooled representation, sketched (maximum mean discrepancy, Gaussian kernel)", caveat=True),
]


def signal_names() -> tuple[str, ...]:
    return tuple(s.name for s in SIGNALS)


def read_rows() -> list[Signal]:
    """The rows whose value is read off each answer (all but the representation, which comes as a sketch)."""
    return [s for s in SIGNALS if s.read is not None]


def describe(name: str) -> str:
    return next(s.description for s in SIGNALS if s.name == name)


@dataclass
class Texts:
    """The signals of some texts, one value per text each (a window, or the reference): `values` by each row's
    column; `features` the sketches' random Fourier features (texts x FEATURES, Kernel.features), or None."""

    values: dict[str, np.ndarray]
    features: np.ndarray | None = None

    def __len__(self) -> int:
        return len(next(iter(self.values.values()))) if self.values else 0

    def __getattr__(self, column: str) -> np.ndarray:  # texts.predicted, texts.confidence, ...
        values = self.__dict__.get("values", {})
        if column in values:
            return values[column]
        raise AttributeError(column)

    def take(self, index: np.ndarray) -> Texts:
        return Texts({k: v[index] for k, v in self.values.items()},
                     self.features[index] if self.features is not None else None)

    @property
    def signals(self) -> tuple[str, ...]:
        """The signals these texts carry: every row whose column they hold (the representation where sketched)."""
        return tuple(s.name for s in SIGNALS if (self.features is not None if s.kind == "mmd"
                                                  else s.column in self.values))

    @classmethod
    def of(cls, data: dict) -> Texts:
        """From a profile's reference (its columns; a column an older profile lacks: that signal is not compared)."""
        return cls({s.column: np.asarray(data[s.column], np.int64 if s.integer else np.float64)
                    for s in SIGNALS if s.kind != "mmd" and s.column in data})

    @classmethod
    def read(cls, answers: list[dict], reading: Reading, features: np.ndarray | None = None) -> Texts:
        """From a Predictor's answers with signals: each row's value read off each answer."""
        return cls({s.column: np.array([s.read(a, reading) for a in answers], np.int64 if s.integer else np.float64)
                    for s in SIGNALS if s.read is not None}, features)

    def columns(self) -> dict[str, list]:
        """The values as a profile stores them (floats to 6 digits)."""
        return {k: (v.tolist() if v.dtype.kind == "i" else [round(float(x), 6) for x in v])
                for k, v in self.values.items()}


def confidence_bin(confidence: np.ndarray) -> np.ndarray:
    return np.minimum((np.asarray(confidence) * CONFIDENCE_BINS).astype(np.int64), CONFIDENCE_BINS - 1)


@dataclass
class Kernel:
    """A Gaussian kernel on sketches, as random Fourier features: features(x) . features(y) ~ exp(-|x-y|^2 /
    (2 bandwidth^2)), so the distance between two samples' mean features estimates their maximum mean discrepancy
    (Rahimi and Recht's features; Gretton et al.'s statistic) in time linear in the texts."""

    weights: np.ndarray  # sketch dims x FEATURES, drawn N(0, 1 / bandwidth^2)
    phase: np.ndarray  # FEATURES, drawn U(0, 2 pi)

    @classmethod
    def draw(cls, sketches: np.ndarray, seed: int = 0) -> Kernel:
        """A kernel whose bandwidth is the median distance between the reference's sketches (the usual choice)."""
        rng = np.random.default_rng(seed)
        some = sketches[rng.choice(len(sketches), min(len(sketches), 300), replace=False)]
        gaps = np.sqrt(((some[:, None, :] - some[None, :, :]) ** 2).sum(-1))
        bandwidth = float(np.median(gaps[np.triu_indices(len(some), 1)])) or 1.0
        weights = rng.standard_normal((sketches.shape[1], FEATURES)) / bandwidth
        return cls(weights.astype(np.float32), rng.uniform(0, 2 * np.pi, FEATURES).astype(np.float32))

    def features(self, sketches: np.ndarray) -> np.ndarray:
        return np.sqrt(2.0 / FEATURES) * np.cos(np.asarray(sketches, np.float32) @ self.weights + self.phase)


def distances(window: Texts, reference: Texts, num_classes: int) -> dict[str, float]:
    """The window's distance to the reference on each signal both carry (Texts.signals)."""
    both = set(window.signals) & set(reference.signals)
    found = {}
    for s in SIGNALS:
        if s.name not in both:
            continue
        if s.kind == "mmd":
            found[s.name] = float(np.linalg.norm(window.features.mean(0) - reference.features.mean(0)))
            continue
        a, b = window.values[s.column], reference.values[s.column]
        if s.kind == "shares":
            found[s.name] = _js(np.bincount(a, minlength=num_classes).astype(float),
                                np.bincount(b, minlength=num_classes).astype(float))
        elif s.kind == "histogram":
            found[s.name] = _js(np.bincount(confidence_bin(a), minlength=CONFIDENCE_BINS).astype(float),
                                np.bincount(confidence_bin(b), minlength=CONFIDENCE_BINS).astype(float))
        else:
            found[s.name] = _ks(np.log1p(a), np.log1p(b)) if s.kind == "ks_log" else _ks(a, b)
    return found


def thresholds(reference: Texts, size: int, num_classes: int, false_alarm: float = FALSE_ALARM,
               draws: int = DRAWS, seed: int = 0) -> dict[str, float]:
    """Each signal's threshold for windows of `size` texts (module docstring). All draws at once, as matrices
    (draws x reference texts): ~50 ms for 2000 draws of 1000 texts, where one draw at a time took 0.7 s."""
    n = len(reference)
    m = max(1, min(int(size), n // 2))
    rng = np.random.default_rng(seed)
    inside = np.zeros((draws, n), bool)
    for d in range(draws):
        inside[d, rng.choice(n, m, replace=False)] = True
    seen = {}
    for s in SIGNALS:
        if s.name not in reference.signals:
            continue
        if s.kind == "mmd":
            total = reference.features.sum(0)
            within = inside.astype(np.float32) @ reference.features
            seen[s.name] = np.linalg.norm(within / m - (total - within) / (n - m), axis=1)
            continue
        values = reference.values[s.column]
        if s.kind == "shares":
            seen[s.name] = _js_rows(inside, values, num_classes)
        elif s.kind == "histogram":
            seen[s.name] = _js_rows(inside, confidence_bin(values), CONFIDENCE_BINS)
        else:
            seen[s.name] = _ks_rows(inside, np.log1p(values) if s.kind == "ks_log" else values)
    q = 1.0 - false_alarm / len(seen)
    limits = {name: float(np.quantile(values, q, method="higher")) for name, values in seen.items()}
    # A signal the reference never varies on (no unknown token in 400 texts) would flag one odd text: a window
    # has to differ by more than one text's worth (the rule of three: the reference's rate may be up to 3/n).
    for s in SIGNALS:
        if s.kind in ("ks", "ks_log") and s.name in limits:
            limits[s.name] = max(limits[s.name], 1.0 / m + 3.0 / n)
    return limits


def _js_rows(inside: np.ndarray, bins: np.ndarray, k: int) -> np.ndarray:
    """_js of each row's texts (inside) against the rest, on the histogram of `bins` (one bin per text)."""
    onehot = np.zeros((len(bins), k))
    onehot[np.arange(len(bins)), bins] = 1.0
    window = inside.astype(np.float64) @ onehot
    rest = onehot.sum(0) - window
    p = window / np.maximum(window.sum(1, keepdims=True), 1)
    q = rest / np.maximum(rest.sum(1, keepdims=True), 1)
    mid = (p + q) / 2
    with np.errstate(divide="ignore", invalid="ignore"):
        kl_p = np.where(p > 0, p * np.log2(p / mid), 0.0).sum(1)
        kl_q = np.where(q > 0, q * np.log2(q / mid), 0.0).sum(1)
    return np.sqrt(np.maximum(0.0, (kl_p + kl_q) / 2))


def _ks_rows(inside: np.ndarray, values: np.ndarray) -> np.ndarray:
    """_ks of each row's texts (inside) against the rest: both empirical distributions at every distinct value."""
    order = np.argsort(values, kind="stable")
    ranked = inside[:, order]
    last_of_tie = np.r_[np.diff(values[order]) != 0, True]  # a distribution steps after the last of equal values
    a = np.cumsum(ranked, axis=1, dtype=np.int32)[:, last_of_tie]
    b = np.cumsum(~ranked, axis=1, dtype=np.int32)[:, last_of_tie]
    m = inside.sum(1, keepdims=True)
    return np.max(np.abs(a / m - b / (inside.shape[1] - m)), axis=1)


def verdict(found: dict[str, float], limits: dict[str, float]) -> list[str]:
    """The signals whose distance is past their threshold (drift where any is)."""
    return [s.name for s in SIGNALS if s.name in found and s.name in limits and found[s.name] > limits[s.name]]


def estimated_accuracy(window_confidence: np.ndarray, reference: Texts, correct: np.ndarray
                       ) -> tuple[float, float, float]:
    """(estimate, low, high) of the window's accuracy from its confidences (module docstring); a 95 % interval."""
    ref_bins = confidence_bin(reference.confidence)
    count = np.bincount(ref_bins, minlength=CONFIDENCE_BINS).astype(float)
    hits = np.bincount(ref_bins, weights=np.asarray(correct, float), minlength=CONFIDENCE_BINS)
    # a bin the reference barely fills leans on the bin's own confidence (its middle) rather than on a few texts
    middle = (np.arange(CONFIDENCE_BINS) + 0.5) / CONFIDENCE_BINS
    accuracy = (hits + 2 * middle) / (count + 2)
    bins = confidence_bin(window_confidence)
    p = accuracy[bins]
    n = len(p)
    share = np.bincount(bins, minlength=CONFIDENCE_BINS) / n
    variance = np.sum(p * (1 - p)) / n ** 2 + np.sum(share ** 2 * accuracy * (1 - accuracy) / (count + 2))
    half = 1.96 * float(np.sqrt(variance))
    estimate = float(p.mean())
    return estimate, max(0.0, estimate - half), min(1.0, estimate + half)


CAVEAT = ("the texts drifted in what the model sees: the estimate assumes the model stays as calibrated as on the"
          " reference, which such a shift can break (measured: TREC questions thinned to every other word, estimate"
          " 0.894, real 0.605); check it with labels")


def caveat(drifted: list[str]) -> str | None:
    """What to say beside an accuracy estimate when the window drifted where calibration may not hold."""
    return CAVEAT if set(drifted) & {s.name for s in SIGNALS if s.caveat} else None
