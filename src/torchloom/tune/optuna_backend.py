"""The Optuna backend: TPE sampling, successive-halving (ASHA) or Hyperband pruning, trials on the
local or spark engine, one at a time per process.

The study lives in `tune.storage` (default sqlite:///<study dir>/optuna.db). Any number of
`torchloom tune` processes given the same storage and study name (on one machine or many, with a
database server such as postgresql://) add trials to one study until it holds `tune.trials`.

Pruning happens inside the training job: rank 0 reports each validation result to the trial
(tune/pruning.py, reached through hooks.json) and asks the pruner; the loop stops every rank at
that evaluation when the answer is yes. Steps reported to Optuna are evaluation counts, like Ray
Tune's training iterations, so `tune.grace_period` means the same on both backends.
"""

from __future__ import annotations

from torchloom.config import Config
from torchloom.config.schema import TuneConfig
from torchloom.errors import UserError, first_line
from torchloom.redaction import redact_text
from torchloom.runs.rundir import StudyDir
from torchloom.tune import trial as trial_mod
from torchloom.tune.common import mode_of, say, study_name
from torchloom.tune.pruning import PruningReporter, hook_storage, make_pruner, make_storage
from torchloom.tune.space import Param


def storage_url(cfg: Config, sd: StudyDir) -> str:
    return cfg.tune.storage or f"sqlite:///{sd.optuna_db}"


def open_study(url: str, name: str, direction: str, tune_cfg: TuneConfig, sd: StudyDir):
    """Create or load the study. Processes starting together would race to create the database's
    tables (a UNIQUE failure on alembic_version): those sharing the study dir take turns on a lock file;
    others, on a remote database, retry."""
    import fcntl
    import time

    import optuna
    import sqlalchemy.exc

    for attempt in range(5):
        try:
            with open(sd.lock("storage"), "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                return optuna.create_study(
                    study_name=name, storage=make_storage(url), load_if_exists=True, direction=direction,
                    sampler=optuna.samplers.TPESampler(seed=tune_cfg.seed,
                                                       n_startup_trials=min(10, max(2, tune_cfg.trials // 2))),
                    pruner=make_pruner(tune_cfg.scheduler, tune_cfg.grace_period, tune_cfg.reduction_factor),
                )
        except (sqlalchemy.exc.IntegrityError, sqlalchemy.exc.OperationalError) as e:
            if attempt == 4:
                raise _storage_error(url, e) from None
            time.sleep(1 + attempt)
        except (ImportError, sqlalchemy.exc.ArgumentError, ValueError) as e:
            raise _storage_error(url, e) from None


def _storage_error(url: str, e: BaseException) -> UserError:
    """The study database cannot be opened: one line, its URL without the password."""
    if isinstance(e, ImportError):
        cause: BaseException | None = e  # Optuna wraps the driver's ModuleNotFoundError in its own ImportError
        while cause is not None and not getattr(cause, "name", None):
            cause = cause.__cause__ or cause.__context__
        name = getattr(cause, "name", None) or "the database's Python driver"
        return UserError(f"tune.storage {redact_text(url)}: its database driver is not installed ({name});"
                         f" pip install {name}, or leave tune.storage empty for the study's own SQLite file")
    return UserError(f"tune.storage {redact_text(url)}: cannot open the study database ({first_line(e)[:160]});"
                     " check that it runs and the URL, or leave tune.storage empty for a SQLite file")


def run(cfg: Config, sd: StudyDir, params: list[Param], parent_run_id: str | None) -> None:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    tune_cfg = cfg.tune
    url = storage_url(cfg, sd)
    name = study_name(cfg)
    direction = "maximize" if mode_of(cfg) == "max" else "minimize"
    study = open_study(url, name, direction, tune_cfg, sd)
    hooks_base = {"storage": hook_storage(url), "study_name": name, "metric": tune_cfg.metric,
                  "scheduler": tune_cfg.scheduler, "grace_period": tune_cfg.grace_period,
                  "reduction_factor": tune_cfg.reduction_factor}

    def objective(trial: optuna.Trial) -> float:
        values = {p.key: p.suggest(trial) for p in params}
        trial_name = f"trial-{trial.number:03d}"
        hooks = {"reporters": [PruningReporter.hook(**hooks_base, trial_id=trial._trial_id)]}
        result = trial_mod.run_trial(cfg, sd, trial_name, values, parent_run_id, hooks=hooks)
        td = sd.trial(trial_name)
        trial.set_user_attr("run_dir", str(td.root))
        trial.set_user_attr("steps", result.steps)
        if result.stop_reason == "pruned":
            raise optuna.TrialPruned()
        value = trial_mod.best_value(td, tune_cfg.metric, mode_of(cfg))
        if value is None:
            raise RuntimeError(f"trial {trial_name} reported no validation {tune_cfg.metric}")
        return value

    def enough(st: optuna.Study) -> bool:
        trials = st.get_trials(deepcopy=False)
        counted = [t for t in trials if t.state != optuna.trial.TrialState.FAIL]
        # Failed trials do not count, but a study whose trials keep failing must end too.
        return len(counted) >= tune_cfg.trials or len(trials) >= 2 * tune_cfg.trials

    if enough(study):
        say(f"the study already holds {len(study.trials)} trials (tune.trials {tune_cfg.trials})")
        return

    def stop_when_full(st: optuna.Study, _trial) -> None:
        if enough(st):
            st.stop()

    # A trial that fails in training is recorded as failed and the study goes on; a user error (bad
    # data, bad config) would fail every trial the same way, so it ends the study.
    from torchloom.engines.common import TrainingFailed

    study.optimize(objective, timeout=tune_cfg.time_budget_s or None, callbacks=[stop_when_full],
                   catch=(TrainingFailed, RuntimeError), gc_after_trial=True)
