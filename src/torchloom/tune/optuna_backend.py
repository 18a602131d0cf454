"""The Optuna backend: TPE sampling, successive-halving (ASHA) or Hyperband pruning, trials on the
local or spark engine, one at a time per process.

The study lives in `tune.storage` (default sqlite:///<study dir>/optuna.db). Any number of
`torchloom tune` processes given the same storage and study name (on one machine or many, with a
database server such as postgresql://) add trials to one study until it holds `tune.trials`.

Pruning happens inside the training job: rank 0 reports each validation result to the trial
(PruningReporter, reached through hooks.json) and asks the pruner; the loop stops every rank at
that evaluation when the answer is yes. Steps reported to Optuna are evaluation counts, like Ray
Tune's training iterations, so `tune.grace_period` means the same on both backends.
"""

from __future__ import annotations

import math
from pathlib import Path

from torchloom.config import Config
from torchloom.train.reporter import Reporter
from torchloom.tune import study as study_mod
from torchloom.tune.space import Param


def storage_url(cfg: Config, sd: Path) -> str:
    return cfg.tune.storage or f"sqlite:///{sd / 'optuna.db'}"


def make_storage(url: str):
    import optuna

    # A process that dies mid-trial stops its heartbeat: after the grace period the trial is marked
    # failed and queued again with the same parameters, so an interrupted study resumes.
    heartbeat = {"heartbeat_interval": 30, "grace_period": 120,
                 "failed_trial_callback": optuna.storages.RetryFailedTrialCallback(max_retry=1)}
    if url.startswith("sqlite"):
        # Several processes share the file: wait for the lock rather than fail on "database is locked".
        return optuna.storages.RDBStorage(url, engine_kwargs={"connect_args": {"timeout": 120}}, **heartbeat)
    return optuna.storages.RDBStorage(url, **heartbeat)


def make_pruner(scheduler: str, grace_period: int, reduction_factor: int):
    import optuna

    if scheduler == "asha":
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=grace_period, reduction_factor=reduction_factor)
    if scheduler == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=grace_period, reduction_factor=reduction_factor)
    return optuna.pruners.NopPruner()


class PruningReporter(Reporter):
    """In the workers: rank 0 reports each evaluation to the Optuna trial and asks its pruner."""

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


def open_study(url: str, name: str, direction: str, tc, sd: Path):
    """Create or load the study. Processes starting together would race to create the database's
    tables (a UNIQUE failure on alembic_version): those sharing the study dir take turns on a lock file;
    others, on a remote database, retry."""
    import fcntl
    import time

    import optuna
    import sqlalchemy.exc

    for attempt in range(5):
        try:
            with open(sd / ".storage.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                return optuna.create_study(
                    study_name=name, storage=make_storage(url), load_if_exists=True, direction=direction,
                    sampler=optuna.samplers.TPESampler(seed=tc.seed,
                                                       n_startup_trials=min(10, max(2, tc.trials // 2))),
                    pruner=make_pruner(tc.scheduler, tc.grace_period, tc.reduction_factor),
                )
        except (sqlalchemy.exc.IntegrityError, sqlalchemy.exc.OperationalError):
            if attempt == 4:
                raise
            time.sleep(1 + attempt)


def run(cfg: Config, sd: Path, params: list[Param], parent_run_id: str | None) -> None:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    tc = cfg.tune
    url = storage_url(cfg, sd)
    name = study_mod.study_name(cfg)
    direction = "maximize" if study_mod.mode_of(cfg) == "max" else "minimize"
    study = open_study(url, name, direction, tc, sd)
    hooks_base = {"storage": url, "study_name": name, "metric": tc.metric, "scheduler": tc.scheduler,
                  "grace_period": tc.grace_period, "reduction_factor": tc.reduction_factor}

    def objective(trial: optuna.Trial) -> float:
        values = {p.key: p.suggest(trial) for p in params}
        trial_name = f"trial-{trial.number:03d}"
        hooks = {"optuna": {**hooks_base, "trial_id": trial._trial_id}}
        result = study_mod.run_trial(cfg, sd, trial_name, values, parent_run_id, hooks=hooks)
        td = study_mod.trial_dir(sd, trial_name)
        trial.set_user_attr("run_dir", str(td))
        trial.set_user_attr("steps", result["steps"])
        if result.get("stop_reason") == "pruned":
            raise optuna.TrialPruned()
        value = study_mod.best_value(td, tc.metric, study_mod.mode_of(cfg))
        if value is None:
            raise RuntimeError(f"trial {trial_name} reported no validation {tc.metric}")
        return value

    def enough(st: optuna.Study) -> bool:
        trials = st.get_trials(deepcopy=False)
        counted = [t for t in trials if t.state != optuna.trial.TrialState.FAIL]
        # Failed trials do not count, but a study whose trials keep failing must end too.
        return len(counted) >= tc.trials or len(trials) >= 2 * tc.trials

    if enough(study):
        study_mod.say(f"the study already holds {len(study.trials)} trials (tune.trials {tc.trials})")
        return

    def stop_when_full(st: optuna.Study, _trial) -> None:
        if enough(st):
            st.stop()

    # A trial that fails in training is recorded as failed and the study goes on; a user error (bad
    # data, bad config) would fail every trial the same way, so it ends the study.
    from torchloom.engines.common import TrainingFailed

    study.optimize(objective, timeout=tc.time_budget_s or None, callbacks=[stop_when_full],
                   catch=(TrainingFailed, RuntimeError), gc_after_trial=True)
