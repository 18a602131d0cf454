"""What one training run returns (rank 0's is the job's): a typed record, written as JSON by the workers."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass
class TrainResult:
    steps: int  # optimizer steps done, resumed ones included
    total_steps: int
    epochs: float  # epochs done, fractional
    samples_seen: int
    train_s: float  # this launch's time in fit()
    first_step_s: float  # from the engine's launch (or fit's start) to the end of the first step
    samples_per_s: float
    stopped_early: bool
    stop_reason: str  # early_stopping, or who asked (e.g. pruned); "" when all steps ran
    best_metric: float | None
    best_step: int
    best_checkpoint: str | None
    last_checkpoint: str
    last_eval: dict = field(default_factory=dict)  # loss, accuracy, macro_f1 of the last validation
    resumed_from: str | None = None
    world_size: int = 1
    device: str = "cpu"
    resumed_at_step: int | None = None  # the step this launch resumed from
    resumed_world_size: int | None = None  # the workers of the run that wrote that checkpoint, when not these
    precision: str = ""  # what train.precision became on the workers' device (auto resolved)
    precision_reason: str = ""  # why: "auto: this CPU has no native bf16", or "as configured"
    startup: dict = field(default_factory=dict)  # seconds of each phase before the first step (see loop.py)
    uploads: dict = field(default_factory=dict)  # a run on a store: checkpoints uploaded, blocked_s, upload_s
    wall_s: float = 0.0  # the driver's wall time for the whole launch; 0 until the driver sets it
    # each preemption of this launch: step (the last one done), notice (who got it, on which host),
    # checkpoint_s (notice to checkpoint written; -1: none fitted in the grace period), resumed_from_step,
    # workers (of the attempt that went on; 0: none did)
    preemptions: list = field(default_factory=list)
    tokens_per_s: float = 0.0  # real tokens (not padding) a second over all ranks (train/clock.py)
    padding: float = 0.0  # the share of the tokens computed that were padding
    mfu: float | None = None  # model FLOPs utilisation where the GPU's dense peak is known; None elsewhere
    time_split: dict = field(default_factory=dict)  # each phase's share of train_s (train/clock.PHASES)
    compiled_graphs: int | None = None  # train.compile: graphs compiled on rank 0 (a new shape adds one); None: off
    packed: bool = False  # train.packing: each micro-batch's sequences packed into fewer rows (less padding)
    global_batch: int = 0  # rows per optimizer step over all ranks (train.batch_size auto resolved); 0: unknown

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> TrainResult:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})
