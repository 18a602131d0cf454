"""One trial of a study: an ordinary run directory under <study>/trials/<name>, trained by the train stage."""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

from torchloom import tracking
from torchloom.config import Config
from torchloom.errors import first_line
from torchloom.jsonio import read_json, write_json
from torchloom.runs.rundir import RunDir, StudyDir
from torchloom.stages.train import train_stage
from torchloom.train import checkpoint
from torchloom.train.result import TrainResult
from torchloom.tune import space as space_mod
from torchloom.tune.common import mode_of, say, with_output
from torchloom.tune.space import short


def start_trial(cfg: Config, sd: StudyDir, name: str, values: dict[str, Any], parent_run_id: str | None):
    """The trial's run dir and config (resuming its own checkpoints after an interruption) and its
    MLflow run, nested under the study's."""
    td = sd.trial(name)
    td.root.mkdir(parents=True, exist_ok=True)
    if not td.data.exists():
        td.data.symlink_to(os.path.relpath(sd.data, td.root))
    trial_cfg = space_mod.apply(cfg, values, where=f"trial {name}")
    # The checkpoint a trial exports is the best by the metric the study optimises.
    trial_cfg = dataclasses.replace(trial_cfg, train=dataclasses.replace(trial_cfg.train, metric=cfg.tune.metric))
    has_checkpoint = checkpoint.latest(td.checkpoints) is not None
    trial_cfg = with_output(trial_cfg, td.root, resume="latest" if has_checkpoint else "")
    tracker = tracking.NullTracker()
    if parent_run_id and cfg.tracking.enabled:
        tracker = tracking.start(trial_cfg, "trial", run_name=name, parent_run_id=parent_run_id,
                                 extra_tags={"trial": name})
    info = {"trial": name, "params": values, "started": time.time(), "mlflow_run_id": tracker.run_id,
            "resumed": has_checkpoint}
    write_json(td.trial_info, info)
    td.trial_result.unlink(missing_ok=True)
    return trial_cfg, tracker


def finish_trial(td: RunDir, status: str, result: dict | None = None) -> None:
    write_json(td.trial_result, {"status": status, "ended": time.time(), **(result or {})})


def eval_history(td: RunDir) -> list[dict]:
    return td.metric_records("eval")


def best_value(td: RunDir, metric: str, mode: str) -> float | None:
    values = [r[metric] for r in eval_history(td) if space_mod.is_finite_number(r.get(metric))]
    if not values:
        return None
    return max(values) if mode == "max" else min(values)


def run_trial(cfg: Config, sd: StudyDir, name: str, values: dict, parent_run_id: str | None,
              hooks: dict | None = None, quiet: bool = True) -> TrainResult:
    """Train one trial to its end (or until a scheduler stops it); returns its train result."""
    trial_cfg, tracker = start_trial(cfg, sd, name, values, parent_run_id)
    td = sd.trial(name)
    shown = ", ".join(f"{k.split('.')[-1]}={short(v)}" for k, v in values.items())
    say(f"trial {name} started: {shown}")
    with tracker:
        try:
            result = train_stage(trial_cfg, quiet=quiet, tracker=tracker, hooks=hooks)
        except KeyboardInterrupt:
            finish_trial(td, "interrupted")
            raise
        except BaseException as e:
            finish_trial(td, "failed", {"error": first_line(e)})
            raise
    status = "stopped early" if result.stop_reason == "pruned" else "completed"
    finish_trial(td, status, {"stop_reason": result.stop_reason, "steps": result.steps})
    value = best_value(td, cfg.tune.metric, mode_of(cfg))
    say(f"trial {name} {status} after {result.steps} steps: best {cfg.tune.metric}"
        f" {'-' if value is None else f'{value:.4f}'}")
    return result


def read_trial(td: RunDir) -> tuple[dict, dict]:
    """(trial.json, trial_result.json) of a trial; the second is {} while it runs or if it never ended."""
    info = read_json(td.trial_info)
    return info, (read_json(td.trial_result) if td.trial_result.is_file() else {})
