"""How many rows a held-out split needs (prepare.heldout_rows): pure arithmetic, no Spark, so `torchloom plan`
reads it too (plan/stages.py). etl/split.py carves the splits by it."""

from __future__ import annotations

import math

# How many rows a held-out split needs (prepare.heldout_rows auto): accuracy's 95 % interval within +-0.25 points
# whatever the accuracy (the widest, at 0.5: z^2 * 0.25 / w^2), and every class enough for its own recall within
# +-5 points (385 rows), or all of its fraction where it has fewer. More held-out rows only narrow intervals already
# narrower than the differences anyone acts on; they are rows training does not see.
HELDOUT_Z, HELDOUT_WIDTH, CLASS_WIDTH = 1.96, 0.0025, 0.05
HELDOUT_ROWS = math.ceil(HELDOUT_Z ** 2 * 0.25 / HELDOUT_WIDTH ** 2)  # 153,664
CLASS_FLOOR = math.ceil(HELDOUT_Z ** 2 * 0.25 / CLASS_WIDTH ** 2)  # 385
DEFAULT_FRACTION = 0.1  # prepare.val_fraction's and test_fraction's default: the fractions auto caps


def heldout_cap(heldout_rows: int | str, fraction: float) -> int:
    """The most rows of a held-out split carved by `fraction` (0: no cap): heldout_rows auto caps the default
    fraction at HELDOUT_ROWS and keeps a fraction the user chose as given; a number caps any fraction."""
    if heldout_rows == "auto":
        return HELDOUT_ROWS if fraction == DEFAULT_FRACTION else 0
    return int(heldout_rows)


def capped_shares(shares: dict[str, int], cap: int) -> dict[str, int]:
    """Each class's rows of one held-out split, at most about `cap` in all: the fraction's shares scaled down in
    proportion, each class kept to at least the smaller of its share and CLASS_FLOOR (or half an even share of a
    small cap), so a rare class is still measured. The shares unchanged when they fit."""
    total = sum(shares.values())
    if not cap or total <= cap:
        return dict(shares)
    floor = min(CLASS_FLOOR, max(1, math.ceil(cap / (2 * len(shares)))))
    return {label: max(min(n, floor), math.floor(n * cap / total + 0.5)) for label, n in shares.items()}
