"""The shipped mix of the transformer and the classical baseline: the baseline's arrays score texts as
scikit-learn does (lexical.py), and the weight chosen on validation never makes the shipped model worse there
than either model alone (scoring.choose_weight). The scoring paths' agreement is tests/test_cli.py's
test_the_shipped_mix_scores_the_same_on_every_path."""

from __future__ import annotations

import random

import numpy as np
import pytest

from torchloom.baseline import driver as baseline_driver
from torchloom.lexical import Lexical
from torchloom.scoring import choose_weight, mix

WORDS = ["alpha", "beta", "gamma", "delta", "épsilon", "zeta", "Über", "theta", "iota", "kappa", "42", "x_y",
         "naïve", "Ωmega"]


def texts(rng: random.Random, n: int) -> list[str]:
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 25))) for _ in range(n)] + ["", "zz", "ALPHA"]


@pytest.mark.parametrize("classes", [2, 4])
def test_the_baseline_s_arrays_score_as_scikit_learn_and_survive_a_round_trip(classes, tmp_path):
    rng = random.Random(classes)
    train = texts(rng, 300)
    labels = np.array([rng.randrange(classes) for _ in train])
    vec = baseline_driver.vectorizer()
    model = baseline_driver.classifier(10.0).fit(vec.fit_transform(train), labels)
    names = [f"class {i}" for i in range(classes)]
    lexical = baseline_driver.as_lexical(vec, model, names)
    held_out = texts(rng, 80)
    expected = model.predict_proba(vec.transform(held_out))
    np.testing.assert_allclose(lexical.probabilities(held_out), expected, rtol=0, atol=1e-9)
    loaded = Lexical.load(lexical.save(tmp_path / "baseline"))  # JSON and safetensors, no pickle
    np.testing.assert_allclose(loaded.probabilities(held_out), expected, rtol=0, atol=1e-9)
    assert sorted(p.name for p in (tmp_path / "baseline").iterdir()) == ["terms.json", "weights.safetensors"]


def test_the_one_vs_rest_baseline_s_arrays_score_each_tag_as_scikit_learn(tmp_path):
    from sklearn.linear_model import LogisticRegression

    rng = random.Random(7)
    train = texts(rng, 300)
    hot = np.array([[("alpha" in t) ^ (i % 7 == 0), "beta" in t, False, True] for i, t in enumerate(train)])
    vec = baseline_driver.vectorizer()
    x = vec.fit_transform(train)
    coef, intercept = baseline_driver.tag_fitter(x, hot)(10.0)  # a tag no text holds, and one every text holds
    lexical = Lexical([f"tag {j}" for j in range(4)], list(range(4)), baseline_driver._terms(vec), vec.idf_, coef,
                      intercept, task="multi_label")
    held_out = texts(rng, 80)
    got = Lexical.load(lexical.save(tmp_path / "baseline")).probabilities(held_out)
    for j in (0, 1):  # each tag's own regression, as scikit-learn fits and scores it
        alone = LogisticRegression(C=10.0, solver="newton-cg", tol=1e-6, max_iter=1000).fit(x, hot[:, j])
        np.testing.assert_allclose(got[:, j], alone.predict_proba(vec.transform(held_out))[:, 1], rtol=0, atol=1e-6)
    assert (got[:, 2] < 1e-9).all() and (got[:, 3] > 1 - 1e-9).all()
    assert not np.allclose(got.sum(axis=1), 1.0)  # each tag on its own: no softmax


def test_a_class_the_baseline_never_saw_gets_no_probability():
    lexical = Lexical(["a", "b", "c"], [0, 2], ["word"], np.ones(1), np.array([[2.0]]), np.zeros(1))
    probs = lexical.probabilities(["word word", ""])
    assert probs[:, 1].tolist() == [0.0, 0.0] and np.allclose(probs.sum(axis=1), 1.0)
    assert probs[0, 2] > probs[0, 0] and probs[1, 0] == pytest.approx(0.5)


def noisy(labels: np.ndarray, accuracy: float, rng: np.random.Generator, k: int) -> np.ndarray:
    """Probabilities whose argmax is right for about `accuracy` of the texts."""
    right = rng.random(len(labels)) < accuracy
    guess = np.where(right, labels, (labels + rng.integers(1, k, len(labels))) % k)
    probs = rng.dirichlet(np.ones(k), len(labels)) * 0.5
    probs[np.arange(len(labels)), guess] += 0.5
    return probs


def test_the_weight_chosen_on_val_is_never_worse_than_either_model_there():
    rng = np.random.default_rng(0)
    k, labels = 5, np.random.default_rng(1).integers(0, 5, 400)
    weak, strong = noisy(labels, 0.55, rng, k), noisy(labels, 0.85, rng, k)
    # the baseline wins on val: a mix that leans on it (weight below 1), at least as good as the transformer
    weight, grid = choose_weight(weak, strong, labels)
    by_weight = {row["weight"]: row["accuracy"] for row in grid}
    assert weight < 1.0 and by_weight[weight] >= max(by_weight[1.0], by_weight[0.0])
    assert by_weight[weight] == np.mean(mix(weak, strong, weight).argmax(1) == labels)
    # the transformer dominates: it ships alone (a tie goes to the higher weight once the loss is equal too)
    perfect = np.eye(k)[labels]
    weight, _ = choose_weight(perfect, weak, labels)
    assert weight == 1.0


def test_auto_ships_the_mix_only_for_a_clear_gain_on_val_or_where_the_baseline_wins_there():
    from torchloom.evaluate.mix import shipped_weight

    def grid(transformer: int, baseline: int, best: int, texts: int = 500) -> dict:
        return {1.0: {"accuracy": transformer / texts}, 0.0: {"accuracy": baseline / texts},
                0.4: {"accuracy": best / texts}}

    assert shipped_weight("auto", 0.4, grid(450, 440, 451), 500) == 1.0  # one text: noise, the transformer alone
    assert shipped_weight("auto", 0.4, grid(450, 440, 452), 500) == 0.4  # two texts: the mix
    assert shipped_weight("auto", 0.4, grid(450, 451, 451), 500) == 0.4  # the baseline wins on val: never below it
    assert shipped_weight("on", 0.4, grid(450, 440, 451), 500) == 0.4  # on: the best weight whatever
