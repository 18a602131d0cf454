"""The training engines, one row each: what every part of torchloom that treats engines differently asks of them.

Adding an engine is a row here (`engine.name`'s choices are its names) and its launcher module under engines/ (a
`train(cfg, files, quiet=..., ...)` that starts the ranks and returns rank 0's result); nothing else branches on an
engine's name (tests/test_layers.py holds that). The table is plain data and the standard library, so the config
(below every engine) may read it; the launchers and hooks are named here and imported by the stages that call them
(stages/train.py).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Engine:
    name: str
    launcher: str  # the module under torchloom.engines whose train() launches the ranks
    # The command's SparkSession belongs to the training: kept from prepare on and handed to the launcher
    # (TorchDistributor runs the ranks as Spark tasks); every other engine has it stopped before training.
    uses_spark: bool = False
    # Counted before anything is written: the launcher's own check of its cluster (Spark's barrier slots), a
    # function of (cfg, spark) that returns the session to go on with.
    check_cluster: str | None = None
    # The ranks always run on this machine and see its GPUs (the local engine); `own_instance`: they do when
    # torchloom starts the engine's cluster here (Ray without engine.ray_address).
    ranks_here: bool = False
    own_instance: bool = False
    # This machine is the ranks': the driver decides train.precision's `auto` and says so; elsewhere each rank
    # decides on its own device.
    precision_here: bool = False
    # After training, what holds the ranks' imports is stopped (the local engine's fork server), a function.
    after_training: str | None = None
    shrinks: bool = False  # engine.min_workers: it goes on with fewer ranks by itself after a loss
    optuna_trials: bool = True  # tune.backend optuna can run its trials on it
    k8s_job: bool = False  # `torchloom k8s train` runs it in an Indexed Job's pods (torchrun)


ENGINES = {e.name: e for e in (
    Engine("local", launcher="local", ranks_here=True, precision_here=True, after_training="stop_fork_server",
           k8s_job=True),
    Engine("spark", launcher="spark", uses_spark=True, check_cluster="check_slots"),
    Engine("ray", launcher="ray", own_instance=True, shrinks=True, optuna_trials=False),
)}


def engine_of(engine_cfg) -> Engine:
    """The row of an EngineConfig's name (config/schema.py checks the name against ENGINES)."""
    return ENGINES[engine_cfg.name]


def ranks_on_this_machine(engine_cfg) -> bool:
    """The training ranks run on this machine and see its GPUs: an engine whose ranks always run here, or one on an
    instance torchloom starts here (no engine.ray_address)."""
    e = engine_of(engine_cfg)
    return e.ranks_here or (e.own_instance and not engine_cfg.ray_address.strip())
