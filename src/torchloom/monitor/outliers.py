"""Which texts are odd: a per-text outlier score against the model's reference (its profile's sketches, the
pooled representation projected to 32 dims; monitor/profile.py).

A text's distance is the mean Euclidean distance of its sketch to its K nearest reference sketches; its score is
the share of reference texts whose own distance (to their K nearest others, leaving themselves out) is smaller:
0.5 is an ordinary text, 0.99 one more unusual than 99 % of the reference, 1.0 one beyond every reference text.
So the score reads the same for any model and any data, and a text like the reference scores like the reference
(uniform on [0, 1]). Cost: reference x texts distances of 32 numbers (1,000 reference texts, 1,000 texts: ~30 ms).
"""

from __future__ import annotations

import numpy as np

K = 10  # neighbours: fewer follows single reference texts, more blurs small clusters
CHUNK = 1024  # texts scored at a time (their distances to the whole reference held at once)


class OutlierScorer:
    def __init__(self, reference: np.ndarray) -> None:
        """reference: the profile's sketches (texts x dims)."""
        self.reference = np.asarray(reference, np.float32)
        self.k = max(1, min(K, len(self.reference) - 1))
        self.calibration = np.sort(self._knn(self.reference, leave_out=True))

    def _knn(self, sketches: np.ndarray, leave_out: bool = False) -> np.ndarray:
        out = []
        ref = self.reference
        ref_sq = (ref ** 2).sum(1)
        for start in range(0, len(sketches), CHUNK):
            part = np.asarray(sketches[start:start + CHUNK], np.float32)
            d2 = np.maximum((part ** 2).sum(1)[:, None] + ref_sq[None, :] - 2 * part @ ref.T, 0.0)
            if leave_out:  # a reference text against the others
                rows = np.arange(start, start + len(part))
                d2[np.arange(len(part)), rows] = np.inf
            nearest = np.partition(d2, self.k - 1, axis=1)[:, :self.k]
            out.append(np.sqrt(nearest).mean(1))
        return np.concatenate(out) if out else np.zeros(0, np.float32)

    def scores(self, sketches: np.ndarray) -> np.ndarray:
        """Each text's outlier score in [0, 1] (see the module's docstring)."""
        if len(sketches) == 0:
            return np.zeros(0)
        return np.searchsorted(self.calibration, self._knn(np.asarray(sketches)), side="left") / len(self.calibration)


def score_answers(scorer: OutlierScorer, answers: list[dict]) -> None:
    """Each answer's "outlier" score, from its sketch (a server's --outlier-score)."""
    if answers and all("sketch" in a for a in answers):
        for answer, score in zip(answers, scorer.scores(np.stack([a["sketch"] for a in answers]))):
            answer["outlier"] = round(float(score), 4)


def scorer_for(profile: dict) -> OutlierScorer | None:
    """The profile's scorer, where it has sketches (read_profile's "_sketch"); None otherwise."""
    sketch = profile.get("_sketch")
    if not sketch or sketch.get("reference") is None or len(sketch["reference"]) < 2:
        return None
    return OutlierScorer(sketch["reference"])
