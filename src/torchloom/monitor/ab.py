"""Which of two models is better, from the labels that come back (issue 58's verdict): numpy and the standard
library only, like monitor/drift.py.

Two ways two models meet the same labels:
    paired     both answered the same texts (a shadow beside the model that answered): McNemar's exact test on
               the texts they disagree about (b: A right and B wrong, c: A wrong and B right; under "equal" each
               such text is a fair coin's toss)
    unpaired   each answered its own texts (an A/B split): the two-proportion z-test on their accuracies

Labels arrive one by one and a dashboard reads the verdict at any time, so testing again and again at one level
would call two equal models different far more often than the level says. The verdict is looked at only on
the first n_min, 2 n_min, 4 n_min, ... labels (in the order they came), the k-th look at level alpha / 2^(k+1):
over all looks that sums to less than alpha (Bonferroni), however long labels keep coming. A look once passed is
kept: the verdict never flips back. Before the first look: "not yet known", with the labels still needed to see
the chosen effect (min_effect, in accuracy points) with 80 % power at the next look's level.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

ALPHA = 0.05  # the chance that two equal models are ever called different
N_MIN = 200  # labels before the first look
MIN_EFFECT = 0.02  # the accuracy difference worth finding
POWER = 0.8


@dataclass
class Outcomes:
    """Per label, in arrival order: whether A was right and whether B was right (None: that model did not answer
    this text)."""

    a: list[bool | None] = field(default_factory=list)
    b: list[bool | None] = field(default_factory=list)

    def add(self, a_right: bool | None, b_right: bool | None) -> None:
        self.a.append(a_right)
        self.b.append(b_right)


@dataclass
class Tally:
    """One model's labelled answers: how many, how many right."""

    labels: int = 0
    right: int = 0

    def interval(self) -> dict[str, float] | None:
        """Accuracy with its 95 % Wilson interval (None before the first label)."""
        if not self.labels:
            return None
        n, p, z = self.labels, self.right / self.labels, 1.959964
        centre = (p + z * z / (2 * n)) / (1 + z * z / n)
        half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
        return {"value": p, "low": max(0.0, centre - half), "high": min(1.0, centre + half), "labels": n}


@dataclass
class Verdict:
    state: str  # "a_better", "b_better", "not_yet_known"
    test: str  # "paired" (McNemar) or "unpaired" (two proportions)
    labels: int  # labels counted: pairs, or the smaller model's labels
    p_value: float | None
    level: float | None  # the level of the look that decided (or of the next look)
    accuracy_a: float | None
    accuracy_b: float | None
    needed: int  # more labels for the chosen effect at the next look (0 once decided)
    looks: int  # looks passed

    def line(self, names: tuple[str, str] = ("A", "B")) -> str:
        acc = (f"accuracy {names[0]} {_pct(self.accuracy_a)}, {names[1]} {_pct(self.accuracy_b)} on {self.labels}"
              f" {'paired ' if self.test == 'paired' else ''}labels")
        if self.state == "not_yet_known" and not self.needed:
            return f"no difference found ({acc}; p = {self.p_value:.2g}, level {self.level:.2g})"
        if self.state == "not_yet_known":
            return f"not yet known ({acc}; about {self.needed} more labels to see a difference of the chosen size)"
        better = names[0] if self.state == "a_better" else names[1]
        return f"{better} better ({acc}; p = {self.p_value:.2g} at level {self.level:.2g})"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _normal_sf(z: float) -> float:
    return 0.5 * math.erfc(z / math.sqrt(2))


def _z(p: float) -> float:
    """The standard normal quantile of 1 - p (p small), by bisection on erfc: no scipy."""
    lo, hi = 0.0, 40.0
    for _ in range(100):
        mid = (lo + hi) / 2
        if _normal_sf(mid) > p:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def mcnemar(b: int, c: int) -> float:
    """Two-sided exact p-value of b against c discordant pairs (each a fair coin under 'equal')."""
    n = b + c
    if n == 0:
        return 1.0
    k = min(b, c)
    log_half = n * math.log(0.5)
    tail = sum(math.exp(math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + log_half)
               for i in range(k + 1))
    return min(1.0, 2 * tail)


def two_proportions(right_a: int, n_a: int, right_b: int, n_b: int) -> float:
    """Two-sided p-value of the pooled two-proportion z-test."""
    if not n_a or not n_b:
        return 1.0
    pooled = (right_a + right_b) / (n_a + n_b)
    se = math.sqrt(pooled * (1 - pooled) * (1 / n_a + 1 / n_b))
    if se == 0:
        return 1.0
    return min(1.0, 2 * _normal_sf(abs(right_a / n_a - right_b / n_b) / se))


def look_level(k: int, alpha: float = ALPHA) -> float:
    return alpha / 2 ** (k + 1)


def once(outcomes: Outcomes, alpha: float = ALPHA) -> Verdict:
    """The verdict on a fixed set of labels looked at once (a labelled file both models scored): McNemar's test
    at level alpha on all the pairs; no sequential looks, as no more labels will come."""
    pairs = [(x, y) for x, y in zip(outcomes.a, outcomes.b) if x is not None and y is not None]
    b = sum(1 for x, y in pairs if x and not y)
    c = sum(1 for x, y in pairs if y and not x)
    p = mcnemar(b, c)
    state = ("a_better" if b > c else "b_better") if p < alpha else "not_yet_known"
    return Verdict(state, "paired", len(pairs), p, alpha, _mean([x for x, _ in pairs]), _mean([y for _, y in pairs]),
                   0, 1)


def compare(outcomes: Outcomes, alpha: float = ALPHA, n_min: int = N_MIN, min_effect: float = MIN_EFFECT
            ) -> Verdict:
    """The verdict on two models from their outcomes (module docstring): paired where every label holds both
    models' answers (a shadow's) or at least n_min of them do, else unpaired."""
    pairs = [(x, y) for x, y in zip(outcomes.a, outcomes.b) if x is not None and y is not None]
    alone = sum(1 for x, y in zip(outcomes.a, outcomes.b) if (x is None) != (y is None))
    if len(pairs) >= n_min or (pairs and not alone):  # a shadow's labels, or enough of them among a split's
        return _paired(pairs, alpha, n_min, min_effect)
    return _unpaired(outcomes, alpha, n_min, min_effect)


def _paired(pairs: list[tuple[bool, bool]], alpha: float, n_min: int, min_effect: float) -> Verdict:
    n, k, look = len(pairs), 0, n_min
    while look <= n:
        b = sum(1 for x, y in pairs[:look] if x and not y)
        c = sum(1 for x, y in pairs[:look] if y and not x)
        p = mcnemar(b, c)
        if p < look_level(k, alpha):
            return Verdict("a_better" if b > c else "b_better", "paired", look, p, look_level(k, alpha),
                           _mean([x for x, _ in pairs[:look]]), _mean([y for _, y in pairs[:look]]), 0, k + 1)
        k, look = k + 1, look * 2
    level = look_level(k, alpha)
    discordant = max(min_effect, sum(1 for x, y in pairs if x != y) / n if n else 2 * min_effect)
    need = ((_z(level / 2) * math.sqrt(discordant) + _z(1 - POWER) * math.sqrt(max(discordant - min_effect ** 2, 0)))
            / min_effect) ** 2
    return Verdict("not_yet_known", "paired", n, None, level, _mean([x for x, _ in pairs]),
                   _mean([y for _, y in pairs]), max(int(math.ceil(need)), look) - n, k)


def _unpaired_counts(outcomes: Outcomes) -> tuple[list[bool], list[bool]]:
    return [x for x in outcomes.a if x is not None], [y for y in outcomes.b if y is not None]


def _unpaired(outcomes: Outcomes, alpha: float, n_min: int, min_effect: float) -> Verdict:
    a, b = _unpaired_counts(outcomes)
    n, k, look = min(len(a), len(b)), 0, n_min
    while look <= n:
        ra, rb = sum(a[:look]), sum(b[:look])
        p = two_proportions(ra, look, rb, look)
        if p < look_level(k, alpha):
            return Verdict("a_better" if ra > rb else "b_better", "unpaired", look, p, look_level(k, alpha),
                           ra / look, rb / look, 0, k + 1)
        k, look = k + 1, look * 2
    level = look_level(k, alpha)
    pa, pb = _mean(a), _mean(b)
    p1 = pa if pa is not None else 0.8
    p2 = min(1.0, p1 + min_effect)
    mid = (p1 + p2) / 2
    need = ((_z(level / 2) * math.sqrt(2 * mid * (1 - mid)) + _z(1 - POWER) * math.sqrt(p1 * (1 - p1) + p2 * (1 - p2)))
            / min_effect) ** 2
    return Verdict("not_yet_known", "unpaired", n, None, level, pa, pb, max(int(math.ceil(need)), look) - n, k)


def _mean(xs: list[bool]) -> float | None:
    return sum(xs) / len(xs) if xs else None
