"""The stages around training, estimated from what they measured: prepare and the Spark baseline scale with the
rows from two measured sizes each; evaluate is the model's forward pass over the held-out splits, which prepare
caps (etl/split.py), so its cost stops growing with the rows.

A stage's time at N rows on C cores: fixed + per_row * N * (measured cores / C), the line through its two
measurements (docs/benchmarks.md, the sections named below), assuming a Spark cluster's tasks share the rows as
the measuring machine's cores did. Within the measured sizes on as many cores it is measured (interpolated);
anywhere else it is extrapolated, and said so. Memory is what the measurements showed of each process: the
driver's flat, Spark's bounded by its own configuration.
"""

from __future__ import annotations

from dataclasses import dataclass

from torchloom.etl.heldout import DEFAULT_FRACTION, HELDOUT_ROWS
from torchloom.plan.estimate import Job, device_rate, training_flops_per_sequence


@dataclass(frozen=True)
class Measured:
    """A stage timed at two sizes on one machine."""

    stage: str
    small: tuple[int, float]  # (rows, seconds)
    large: tuple[int, float]
    cores: int
    where: str  # the machine, the date and the docs/benchmarks.md section
    memory: str  # what its processes held, as measured

    @property
    def per_row_s(self) -> float:
        (n0, s0), (n1, s1) = self.small, self.large
        return (s1 - s0) / (n1 - n0)

    @property
    def fixed_s(self) -> float:
        return max(0.0, self.small[1] - self.per_row_s * self.small[0])


PREPARE = Measured(
    "prepare", (1_000_000, 193.0), (10_000_000, 1409.0), 2,
    "2 cores x86_64, 2026-11-23, 'Scale' (benchmarks/scale.py)",
    "driver 186-191 MB at 1 M to 10 M rows (flat); Spark 3.8-6.7 GB (its heap, bounded by spark.driver.memory"
    " in local mode, by the executors' memory on a cluster)")
BASELINE = Measured(
    "baseline", (1_000_000, 214.0), (3_000_000, 359.0), 2,
    "Intel Xeon 2 cores, 2026-12-03, 'The baseline at scale' (benchmarks/baseline_scale.py)",
    "driver and Spark 5.4-7.1 GB together at 1 M to 3 M rows (Spark's heap, bounded by its configuration); the"
    " driver holds at most 50,000 + 50,000 texts' vectors for the grid and the 300,000-term vocabulary")


@dataclass
class StageEstimate:
    stage: str
    seconds: float
    how: str  # measured, extrapolated or estimated (arithmetic), and from what
    memory: str


def scaled(m: Measured, rows: int, cores: int) -> StageEstimate:
    seconds = m.fixed_s + m.per_row_s * rows * m.cores / cores
    inside = m.small[0] <= rows <= m.large[0] and cores == m.cores
    how = (f"{'measured (between its two sizes)' if inside else 'extrapolated'} from {m.small[0]:,} and"
           f" {m.large[0]:,} rows on {m.where}" + ("" if cores == m.cores else f", scaled to {cores} cores"))
    return StageEstimate(m.stage, seconds, how, m.memory)


def heldout_rows(rows: int) -> int:
    """The rows of one held-out split under prepare's defaults (10 %, capped at HELDOUT_ROWS)."""
    return min(round(rows * DEFAULT_FRACTION), HELDOUT_ROWS)


def evaluate(rows: int, forward_s_per_row: float) -> StageEstimate:
    """Export scores val (the mix's weight) and evaluate scores test: two held-out splits, one process."""
    scored = 2 * heldout_rows(rows)
    return StageEstimate("evaluate", scored * forward_s_per_row,
                         f"estimated: {scored:,} held-out rows (val for the mix, test; each capped at"
                         f" {HELDOUT_ROWS:,}) at the forward pass's FLOPs on one device",
                         "one process: the model and the scored split's probabilities (rows x classes x 4 bytes)")


def stages(job: Job, cores: int) -> list[StageEstimate]:
    """prepare, the baseline and evaluate for job's rows (the data's rows) on `cores` Spark cores."""
    forward_s_per_row = training_flops_per_sequence(job) / 3 / device_rate(job)  # forward: a third of fwd + bwd
    return [scaled(PREPARE, job.rows, cores), scaled(BASELINE, job.rows, cores), evaluate(job.rows, forward_s_per_row)]
