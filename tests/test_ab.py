"""Which of two models is better (ab.py): two equal models are called different at most at the chosen rate
however long labels stream in, a planted difference is found, and no verdict comes from too few labels. Seeded
rounds, no sleeps; pure arithmetic (~6 s)."""

from __future__ import annotations

import numpy as np
import pytest

from torchloom.monitor.ab import Outcomes, compare, mcnemar, two_proportions


def stream(rng, n: int, acc_a: float, acc_b: float, paired: bool, agreement: float = 0.7) -> Outcomes:
    """n labelled texts: paired (both models answered each; they are right or wrong together on a share
    `agreement` of texts, as two models of one family are), or unpaired (each text went to one model)."""
    out = Outcomes()
    for _ in range(n):
        if paired:
            if rng.random() < agreement:
                both = rng.random() < (acc_a + acc_b) / 2
                a_right = b_right = both
                # keep each model's own accuracy: the independent part makes up the difference
                if acc_a != acc_b and rng.random() < abs(acc_a - acc_b) / (1 - agreement + 1e-9) / 2:
                    a_right, b_right = (True, False) if acc_a > acc_b else (False, True)
            else:
                a_right, b_right = rng.random() < acc_a, rng.random() < acc_b
            out.add(bool(a_right), bool(b_right))
        elif rng.random() < 0.5:
            out.add(bool(rng.random() < acc_a), None)
        else:
            out.add(None, bool(rng.random() < acc_b))
    return out


@pytest.mark.parametrize("paired", [True, False])
def test_two_equal_models_are_called_different_at_most_at_the_chosen_rate(paired):
    rng = np.random.default_rng(5)
    rounds, alpha = 200, 0.05
    called = [compare(stream(rng, 3200, 0.8, 0.8, paired), alpha=alpha).state != "not_yet_known"
              for _ in range(rounds)]
    # every look counted: a verdict at any point of the stream is kept, so the end's state says whether one came
    assert np.mean(called) <= alpha + 2 * np.sqrt(alpha * (1 - alpha) / rounds), np.mean(called)


@pytest.mark.parametrize("paired", [True, False])
def test_a_planted_difference_is_found_and_never_from_too_few_labels(paired):
    rng = np.random.default_rng(9)
    found = []
    for _ in range(40):
        outcomes = stream(rng, 3200, 0.78, 0.86, paired)
        early = compare(Outcomes(outcomes.a[:150], outcomes.b[:150]))  # before the first look (200)
        assert early.state == "not_yet_known" and early.needed > 0 and early.p_value is None
        verdict = compare(outcomes)
        found.append(verdict.state)
        assert verdict.state != "a_better", verdict  # never the worse one
    assert found.count("b_better") / len(found) >= 0.9, found
    line = compare(stream(rng, 3200, 0.78, 0.86, paired)).line(("v1", "v2"))
    assert line.startswith("v2 better (accuracy v1 0.7") and "p = " in line


def test_the_exact_tests():
    assert mcnemar(0, 10) == pytest.approx(2 * 0.5 ** 10)
    assert mcnemar(5, 5) == 1.0 and mcnemar(0, 0) == 1.0
    assert mcnemar(3, 17) == pytest.approx(mcnemar(17, 3))
    assert two_proportions(80, 100, 80, 100) == pytest.approx(1.0)
    assert two_proportions(800, 1000, 860, 1000) < 1e-3 < two_proportions(80, 100, 86, 100)
