"""The Ray Tune backend: an Optuna (TPE) search with an ASHA scheduler, each trial a distributed
Ray Train run (Train inside Tune: a function trainable that builds a TorchTrainer and fits it).

Every rank reports each validation result through ray.train.report; the TuneReportCallback hands
rank 0's to the trial, so ASHA can stop a bad trial at any evaluation (`tune.grace_period` of them
first). An interrupted study resumes (Tuner.restore): unfinished trials restart from their own
latest checkpoint. Resources: each trial takes a sliver of a CPU for itself and its workers
`engine.cpus_per_worker` each (on a local instance: the cores shared by `tune.max_concurrent` trials).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from torchloom.config import Config, from_dict, to_dict
from torchloom.engines.common import replace_engine
from torchloom.errors import first_line
from torchloom.machine import usable_cores
from torchloom.runs.rundir import RunDir, StudyDir
from torchloom.tune import trial as trial_mod
from torchloom.tune.common import mode_of, say
from torchloom.tune.space import Param

TRIAL_CPU = 0.01  # the trial's own process mostly waits for its TorchTrainer


def concurrency(cfg: Config) -> int:
    if cfg.tune.max_concurrent:
        return cfg.tune.max_concurrent
    import ray

    resources = ray.cluster_resources()
    fit = int(resources.get("CPU", usable_cores())) // cfg.engine.workers
    gpus = int(resources.get("GPU", 0))
    if cfg.engine.device == "cuda" or (cfg.engine.device == "auto" and gpus >= cfg.engine.workers):
        fit = gpus // cfg.engine.workers  # each worker of each trial takes a whole GPU
    return max(1, min(cfg.tune.trials, fit))


def trial_engine(cfg: Config, concurrent: int, started_local: bool) -> Config:
    """The engine settings of each trial: Ray, with CPUs shared out so `concurrent` trials fit."""
    cpus = cfg.engine.cpus_per_worker
    if not cpus:
        if started_local:
            total = usable_cores()  # what engines/ray.py gives the local instance it starts
            cpus = round((0.98 * total - concurrent * TRIAL_CPU) / (concurrent * cfg.engine.workers), 3)
        else:
            cpus = 1.0
    threads = cfg.engine.threads_per_worker or max(1, int(cpus + 0.01))
    return replace_engine(cfg, name="ray", cpus_per_worker=cpus, threads_per_worker=threads)


def _trainable(config: dict, cfg_dict: dict, study_dir: str, parent_run_id: str | None) -> None:
    """One trial, in a Ray Tune trial process: train on Ray Train workers; Tune sees every eval. The study's
    config comes through Ray's object store (tune.with_parameters), not the param space, which Tune writes
    to the study's experiment state on disk (with any secret in the config)."""
    from ray import tune

    from torchloom.model.env import use_model_env

    use_model_env()
    ctx = tune.get_context()
    cfg = from_dict(cfg_dict)
    sd = StudyDir(study_dir)
    name = f"trial-{ctx.get_trial_id()}"
    trial_mod.run_trial(cfg, sd, name, dict(config), parent_run_id)


class _Progress:
    """One line per trial event on the driver's terminal, instead of Tune's wide tables."""

    def __init__(self, metric: str):
        from ray.tune import Callback

        class Cb(Callback):
            def on_trial_result(self, iteration, trials, trial, result, **info):
                value = result.get(metric)
                shown = f"{value:.4f}" if isinstance(value, (int, float)) else "-"
                say(f"trial-{trial.trial_id} eval {result.get('training_iteration')} at step"
                              f" {result.get('step', '?')}: {metric} {shown}")

            def on_trial_error(self, iteration, trials, trial, **info):
                say(f"trial-{trial.trial_id} failed; see {trial.local_path or 'its logs'}")

        self.callback = Cb()


def run(cfg: Config, sd: StudyDir, params: list[Param], parent_run_id: str | None) -> None:
    import logging

    from ray import tune

    from torchloom.engines.ray import init_ray

    tune_cfg = cfg.tune
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")  # our one line per event instead of Tune's tables
    os.environ.setdefault("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", "1")  # torchloom writes its own results
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    started_local = init_ray(cfg.engine.ray_address)
    try:
        logging.getLogger("ray.tune").setLevel(logging.WARNING)
        concurrent = concurrency(cfg)
        trial_cfg = trial_engine(cfg, concurrent, started_local)
        fixed = tune.with_parameters(_trainable, cfg_dict=to_dict(trial_cfg), study_dir=str(sd.root),
                                     parent_run_id=parent_run_id)
        trainable = tune.with_resources(fixed, {"CPU": TRIAL_CPU})
        param_space = {p.key: p.ray_domain() for p in params}
        tuner = _tuner(cfg, sd, trainable, param_space, concurrent)
        say(f"{concurrent} trial(s) at a time, {trial_cfg.engine.workers} Ray Train workers each with"
            f" {trial_cfg.engine.cpus_per_worker:g} CPUs")
        started = time.monotonic()
        grid = tuner.fit()
    finally:
        if started_local:
            import ray

            ray.shutdown()
    statuses = trial_statuses(grid)
    unfinished = [tid for tid, status in statuses.items() if status not in ("TERMINATED", "ERROR")]
    out_of_time = bool(tune_cfg.time_budget_s) and time.monotonic() - started >= tune_cfg.time_budget_s
    if unfinished or (len(statuses) < tune_cfg.trials and not out_of_time):
        # Tune caught Ctrl+C (or lost its driver) and saved its state: nothing is settled, so the same
        # command resumes the study where it stopped.
        done = len(statuses) - len(unfinished)
        say(f"interrupted after {done} of {tune_cfg.trials} trials; run the same command again to resume"
            " the study")
        raise KeyboardInterrupt
    settle(cfg, sd, grid)


def _tuner(cfg: Config, sd: StudyDir, trainable, param_space: dict, concurrent: int):
    """The study's Tuner: the one saved in `sd` when an earlier run of the study stopped, else a new one."""
    from ray import tune
    from ray.tune.search import ConcurrencyLimiter
    from ray.tune.search.optuna import OptunaSearch

    tune_cfg = cfg.tune
    metric, mode = tune_cfg.metric, mode_of(cfg)
    path = sd.ray_tune
    if tune.Tuner.can_restore(str(path)):
        say(f"resuming the Ray Tune study in {path}")
        return tune.Tuner.restore(str(path), trainable=trainable, resume_unfinished=True,
                                  resume_errored=True, param_space=param_space)
    searcher = ConcurrencyLimiter(OptunaSearch(seed=tune_cfg.seed), max_concurrent=concurrent)
    return tune.Tuner(
        trainable,
        param_space=param_space,
        tune_config=tune.TuneConfig(
            metric=metric, mode=mode, num_samples=tune_cfg.trials, search_alg=searcher,
            scheduler=_scheduler(tune_cfg), time_budget_s=tune_cfg.time_budget_s or None,
        ),
        run_config=tune.RunConfig(
            name="tune", storage_path=str(sd.ray_storage), verbose=0, callbacks=[_Progress(metric).callback],
            failure_config=tune.FailureConfig(max_failures=0),
        ),
    )


def _scheduler(tune_cfg):
    """The trial scheduler `tune.scheduler` names: asha, hyperband, or none (FIFO: every trial runs out)."""
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler, HyperBandScheduler

    if tune_cfg.scheduler == "asha":
        return ASHAScheduler(time_attr="training_iteration", grace_period=tune_cfg.grace_period,
                             reduction_factor=tune_cfg.reduction_factor, max_t=10_000)
    if tune_cfg.scheduler == "hyperband":
        return HyperBandScheduler(time_attr="training_iteration", max_t=max(tune_cfg.grace_period * 27, 81),
                                  reduction_factor=tune_cfg.reduction_factor)
    return FIFOScheduler()


def trial_statuses(grid) -> dict[str, str]:
    """Tune's status of each trial (TERMINATED, ERROR, RUNNING, PENDING, PAUSED)."""
    try:
        return {t.trial_id: t.status for t in grid._experiment_analysis.trials}
    except AttributeError:  # another Ray version: every trial the grid holds ended
        return {trial_name_of(r) or str(i): ("ERROR" if r.error else "TERMINATED") for i, r in enumerate(grid)}


def trial_name_of(result) -> str | None:
    tid = (result.metrics or {}).get("trial_id")
    if not tid and result.path:
        parts = Path(result.path).name.split("_")  # _trainable_<id>_<n>_...
        tid = parts[2] if len(parts) > 2 else None
    return f"trial-{tid}" if tid else None


def ran_to_the_end(td: RunDir) -> bool:
    from torchloom.jsonio import read_json

    if not td.progress.is_file():
        return False
    total = read_json(td.progress).get("total_steps") or 0
    steps = max((r.get("step", 0) for r in trial_mod.eval_history(td)), default=0)
    return 0 < total <= steps


def settle(cfg: Config, sd: StudyDir, grid) -> None:
    """Record how each trial ended, as Tune saw it. A trial ASHA stopped never wrote its own end, or
    wrote "failed" when its Ray Train run was torn down under it: both are "stopped early", and
    their MLflow runs end as KILLED."""

    from torchloom import tracking

    for result in grid:
        name = trial_name_of(result)
        td = sd.trial(name) if name else None
        if td is None or not td.trial_info.is_file():
            continue
        info, own = trial_mod.read_trial(td)
        if own.get("status") in ("completed", "interrupted"):
            continue  # an interrupted trial Tune did not resume keeps saying so
        if result.error is not None:
            if own.get("status") == "failed":
                continue
            status, mlflow_status = "failed", "FAILED"
            extra = {"error": first_line(result.error)}
        elif ran_to_the_end(td):
            # The scheduler's stop reached a trial that had already trained every step.
            status, mlflow_status, extra = "completed", "FINISHED", {"stop_reason": ""}
        else:
            status, mlflow_status, extra = "stopped early", "KILLED", {"stop_reason": "scheduler"}
        trial_mod.finish_trial(td, status, extra)
        run_id = info.get("mlflow_run_id")
        if run_id and cfg.tracking.enabled:
            try:
                from mlflow import MlflowClient

                client = MlflowClient(tracking_uri=tracking.resolve_uri(cfg.tracking.uri))
                # Tune ended the trial's process, maybe before its forwarder sent the last evaluations.
                tracking.forward_missing(client, run_id, td.metrics)
                client.set_terminated(run_id, mlflow_status)
            except Exception:  # the study's result does not depend on it
                pass
