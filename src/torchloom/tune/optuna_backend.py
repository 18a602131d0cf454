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

import contextlib
import socket

from torchloom.config import Config
from torchloom.config.schema import TuneConfig
from torchloom.runs.rundir import StudyDir
from torchloom.tune import trial as trial_mod
from torchloom.tune.common import mode_of, say, study_name
from torchloom.tune.pruning import PruningReporter, hook_storage, make_pruner
from torchloom.tune.space import Param
from torchloom.tune.storage import make_storage, open_error, refusal


def storage_url(cfg: Config, sd: StudyDir) -> str:
    return cfg.tune.storage or f"sqlite:///{sd.optuna_db}"


def open_study(url: str, name: str, direction: str, tune_cfg: TuneConfig, sd: StudyDir):
    """Create or load the study. Processes starting together would race to create the database's
    tables (a UNIQUE failure on alembic_version): those sharing the study dir take turns on a lock file;
    others, on a remote database, retry. A server that says no (credentials, database) is one line at once."""
    import fcntl
    import time

    import optuna
    import sqlalchemy.exc

    for attempt in range(5):
        try:
            with open(sd.lock("storage"), "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                return optuna.create_study(
                    study_name=name, storage=make_storage(url, tune_cfg.heartbeat_s), load_if_exists=True,
                    direction=direction,
                    sampler=sampler(tune_cfg), pruner=make_pruner(tune_cfg.scheduler, tune_cfg.grace_period,
                                                                  tune_cfg.reduction_factor))
        except (sqlalchemy.exc.IntegrityError, sqlalchemy.exc.OperationalError,
                optuna.exceptions.StorageInternalError) as e:
            if attempt == 4 or refusal(e.__cause__ or e):
                raise open_error(url, e.__cause__ or e) from None
            time.sleep(1 + attempt)
        except (ImportError, sqlalchemy.exc.ArgumentError, ValueError) as e:
            raise open_error(url, e) from None


def sampler(tune_cfg: TuneConfig):
    """TPE whose random draws are seeded by tune.seed and the trial's number, not by the process: two processes
    of one study (on two hosts) would otherwise draw the same first configurations; one process draws what it
    drew before, whoever else runs the study."""
    import optuna

    class TrialSeededTPE(optuna.samplers.TPESampler):
        def before_trial(self, study, trial) -> None:
            seed = (tune_cfg.seed * 1_000_003 + trial.number) % 2**32
            for rng in (getattr(self, "_rng", None), getattr(getattr(self, "_random_sampler", None), "_rng", None)):
                if rng is not None and hasattr(rng, "rng"):
                    rng.rng.seed(seed)
            super().before_trial(study, trial)

    return TrialSeededTPE(seed=tune_cfg.seed, n_startup_trials=min(10, max(2, tune_cfg.trials // 2)))


class Surplus(Exception):
    """A trial asked for once the study already held (or was running) tune.trials: recorded as failed, never run."""


def counted(trials) -> list:
    """The trials that count towards tune.trials: all but the failed (a surplus one among them)."""
    import optuna

    return [t for t in trials if t.state != optuna.trial.TrialState.FAIL]


def is_surplus(study, trial, wanted: int) -> bool:
    """Did other processes claim the study's last trials first? Trial numbers are handed out by the database in
    order, so the trials numbered below this one that count (running, waiting or finished) are the claims ahead
    of it: with `wanted` of them, this trial is one too many."""
    ahead = [t for t in study.get_trials(deepcopy=False) if t.number < trial.number]
    return len(counted(ahead)) >= wanted


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
        if is_surplus(study, trial, tune_cfg.trials):
            trial.set_user_attr("surplus", True)
            raise Surplus(f"trial {trial.number}: the study holds its {tune_cfg.trials} trials")
        values = {p.key: p.suggest(trial) for p in params}
        trial_name = f"trial-{trial.number:03d}"
        trial.set_user_attr("host", socket.gethostname())
        trial.set_user_attr("run_dir", str(sd.trial(trial_name).root))
        hooks = {"reporters": [PruningReporter.hook(**hooks_base, trial_id=trial._trial_id)]}
        result = trial_mod.run_trial(cfg, sd, trial_name, values, parent_run_id, hooks=hooks)
        td = sd.trial(trial_name)
        trial.set_user_attr("steps", result.steps)
        if result.stop_reason == "pruned":
            raise optuna.TrialPruned()
        value = trial_mod.best_value(td, tune_cfg.metric, mode_of(cfg))
        if value is None:
            raise RuntimeError(f"trial {trial_name} reported no validation {tune_cfg.metric}")
        return value

    def enough(st: optuna.Study) -> bool:
        trials = [t for t in st.get_trials(deepcopy=False) if not t.user_attrs.get("surplus")]
        # Failed trials do not count, but a study whose trials keep failing must end too.
        return len(counted(trials)) >= tune_cfg.trials or len(trials) >= 2 * tune_cfg.trials

    if enough(study) and not study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        say(f"the study already holds {len(study.trials)} trials (tune.trials {tune_cfg.trials})")
        return
    fill(study, objective, enough, tune_cfg)


def fill(study, objective, enough, tune_cfg: TuneConfig) -> None:
    """Run trials until the study holds tune.trials, then wait for those other processes still run: one whose
    host died (silent for 4 heartbeats) is failed and run again here with the same parameters, so the processes
    still alive finish the study whoever was lost; the report then sees every trial finished."""
    import time

    import optuna

    from torchloom.engines.common import TrainingFailed

    started, said = time.monotonic(), False

    def left() -> float | None:
        return tune_cfg.time_budget_s - (time.monotonic() - started) if tune_cfg.time_budget_s else None

    def stop_when_full(st: optuna.Study, trial) -> None:
        if enough(st) or trial.user_attrs.get("surplus"):  # the rest is other processes' to run
            st.stop()

    while left() is None or left() > 0:
        states = [t.state for t in study.get_trials(deepcopy=False)]
        # a trial queued again (its host was lost: it counts already), or room left (a failed trial): run it here.
        # A trial that fails in training is recorded as failed and the study goes on; a user error (bad data, bad
        # config) would fail every trial the same way, so it ends the study.
        if optuna.trial.TrialState.WAITING in states or not enough(study):
            with quiet_surplus():
                study.optimize(objective, timeout=left(), callbacks=[stop_when_full],
                               catch=(TrainingFailed, RuntimeError, Surplus), gc_after_trial=True)
            continue
        running = states.count(optuna.trial.TrialState.RUNNING)
        if not running:
            return
        if not said:
            say(f"waiting for {running} trial{'s' if running > 1 else ''} running elsewhere; one whose process stops"
                f" answering for {4 * tune_cfg.heartbeat_s:.0f} s is run again here")
            said = True
        optuna.storages.fail_stale_trials(study)
        time.sleep(min(tune_cfg.heartbeat_s, 10.0))


@contextlib.contextmanager
def quiet_surplus():
    """Without Optuna's warning for a surplus trial (it is recorded as failed, with user attribute surplus)."""
    import logging

    def keep(record: logging.LogRecord) -> bool:
        return "Surplus" not in record.getMessage() and "holds its" not in record.getMessage()

    logger = logging.getLogger("optuna")
    logger.addFilter(keep)
    handlers = list(logger.handlers)
    for h in handlers:
        h.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)
        for h in handlers:
            h.removeFilter(keep)


def trials_elsewhere(cfg: Config, params: list[Param], here: set[str]) -> list[dict]:
    """The study's trials that other hosts ran (a study in a shared database, each host with its own study
    directory), as results rows: read from the database, their run directory named as host:path. [] for a
    study in its own SQLite file, or where the database cannot be read now (said in one line)."""
    if not cfg.tune.storage:
        return []
    import optuna

    try:
        study = optuna.load_study(study_name=study_name(cfg), storage=make_storage(cfg.tune.storage))
        trials = study.get_trials(deepcopy=False)
    except Exception as e:  # noqa: BLE001 - the report of this host's own trials goes on
        say(f"warning: the other hosts' trials are not in this report ({open_error(cfg.tune.storage, e)})")
        return []
    pick = max if mode_of(cfg) == "max" else min
    rows = []
    for t in trials:
        name = f"trial-{t.number:03d}"
        if name in here or t.user_attrs.get("surplus") or "host" not in t.user_attrs:
            continue
        values = [v for v in t.intermediate_values.values() if v == v]
        value = t.value if t.value is not None else (pick(values) if values else None)
        state = {"COMPLETE": "completed", "PRUNED": "stopped early", "FAIL": "failed",
                 "RUNNING": "running"}.get(t.state.name, t.state.name.lower())
        rows.append({"trial": name, **{p.key: t.params.get(p.key) for p in params}, cfg.tune.metric: value,
                     "evals": len(t.intermediate_values), "steps": t.user_attrs.get("steps", 0),
                     "stopped_early": t.state == optuna.trial.TrialState.PRUNED,
                     "status": f"{state} on {t.user_attrs['host']}",
                     "started": t.datetime_start.timestamp() if t.datetime_start else 0.0,
                     "run_dir": f"{t.user_attrs['host']}:{t.user_attrs.get('run_dir', '')}", "elsewhere": True})
    return rows
