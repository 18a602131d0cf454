"""Optuna pruning from inside a training job: a leaf that imports only the reporter interface and optuna.

The driver (optuna_backend) names PruningReporter in the run's hooks.json; every worker builds one,
and rank 0 reports each validation result to the trial and asks its pruner. The loop stops every
rank at that evaluation when the answer is yes.
"""

from __future__ import annotations

import math
import os

from torchloom.redaction import TUNE_STORAGE_ENV, redact_text
from torchloom.train.reporter import Reporter
from torchloom.tune.storage import make_storage


def hook_storage(url: str) -> str:
    """The storage as hooks.json names it: a URL with a password stays in this process's environment, which
    every engine forwards to its workers (engines/worker.FORWARDED), and the file says where to find it."""
    if redact_text(url) == url:
        return url
    os.environ[TUNE_STORAGE_ENV] = url
    return f"env:{TUNE_STORAGE_ENV}"


def make_pruner(scheduler: str, grace_period: int, reduction_factor: int):
    import optuna

    if scheduler == "asha":
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=grace_period, reduction_factor=reduction_factor)
    if scheduler == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=grace_period, reduction_factor=reduction_factor)
    return optuna.pruners.NopPruner()


class PruningReporter(Reporter):
    """In the workers: rank 0 reports each evaluation to the Optuna trial and asks its pruner."""

    @classmethod
    def hook(cls, **args) -> dict:
        """The hooks.json entry that has every worker build one of these (engines/common.py)."""
        return {"class": f"{cls.__module__}:{cls.__name__}", "args": args}

    may_stop = True
    stop_reason = "pruned"

    def __init__(self, rank: int, storage: str, study_name: str, trial_id: int, metric: str,
                 scheduler: str, grace_period: int, reduction_factor: int):
        self.rank, self.metric = rank, metric
        self.evals = 0
        self.trial = None
        if rank == 0:
            import optuna

            optuna.logging.set_verbosity(optuna.logging.WARNING)
            study = optuna.load_study(study_name=study_name, storage=make_storage(storage),
                                      pruner=make_pruner(scheduler, grace_period, reduction_factor))
            self.trial = optuna.trial.Trial(study, trial_id)

    def report(self, metrics: dict, checkpoint_dir: str | None) -> bool:
        self.evals += 1
        if self.trial is None:
            return False
        value = metrics.get(self.metric)
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            return False
        self.trial.report(float(value), self.evals)
        return self.trial.should_prune()
