"""`torchloom tune`: a study of training trials over `tune.space`, with early stopping of bad trials.

The study directory (output.dir) holds:
  data/               the prepared data, once for all trials (each trial's data/ links to it)
  trials/<name>/      one ordinary run directory per trial: config, metrics.jsonl, checkpoints, logs
  results.csv/.png    one row per trial: parameters, metric, steps, stopped early or not; the plot
  best_config.toml    the best trial's config, ready for `torchloom run --config`
  model/, report.md   the best trial's model exported (ready for `torchloom serve`) and its test report
  study.json          what ran and which trial won
Running the same command again resumes an interrupted study (--overwrite starts afresh).
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import hashlib
import io
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

from torchloom import config as config_mod
from torchloom import pipeline, tracking
from torchloom.config import Config, to_dict
from torchloom.errors import UserError, missing_extra
from torchloom.manifest import read as read_manifest
from torchloom.tune import space as space_mod
from torchloom.tune.space import Param, short

STUDY_FILE = "study.json"


def say(msg: str) -> None:
    print(f"torchloom: tune: {msg}", file=sys.stderr, flush=True)


def mode_of(cfg: Config) -> str:
    if cfg.tune.mode != "auto":
        return cfg.tune.mode
    return "min" if cfg.tune.metric == "loss" else "max"


def study_name(cfg: Config) -> str:
    return cfg.tune.study_name or Path(cfg.output.dir).resolve().name


def choose_backend(cfg: Config) -> str:
    if cfg.tune.backend == "optuna" or cfg.tune.backend == "auto":
        try:
            import optuna  # noqa: F401
        except ImportError:
            if cfg.tune.backend == "optuna":
                raise missing_extra("optuna", "tune") from None
            optuna = None
    if cfg.tune.backend == "auto":
        try:
            import ray.tune  # noqa: F401

            return "ray"
        except ImportError:
            if optuna is None:
                raise UserError("torchloom tune needs Ray Tune or Optuna; pip install 'torchloom[ray]' or"
                                " 'torchloom[tune]'") from None
            return "optuna"
    if cfg.tune.backend == "ray":
        try:
            import optuna  # noqa: F401
            import ray.tune  # noqa: F401
        except ImportError:
            raise missing_extra("ray[tune] and optuna", "ray") from None
    if cfg.engine.name == "ray" and cfg.tune.backend == "optuna":
        raise UserError("tune.backend optuna runs trials on engine.name local or spark; with Ray use"
                        " tune.backend ray")
    return cfg.tune.backend


# -- the study directory ------------------------------------------------------------------------
def open_study_dir(cfg: Config, backend: str) -> tuple[Path, bool]:
    """(study dir, resuming?) after checking what is there.

    Several `torchloom tune` processes may open one study at the same moment: the marker is created
    exclusively (the first one wins, the others join its study), and a directory counts as someone
    else's only if one listing of it shows files but neither the marker nor the prepared data.
    """
    sd = pipeline.run_dir(cfg)
    marker = sd / STUDY_FILE
    if sd.exists() and cfg.output.overwrite:
        shutil.rmtree(sd)
    resuming = True
    if not marker.is_file():
        names = {p.name for p in sd.iterdir() if not p.name.startswith(".")} if sd.exists() else set()
        if names and STUDY_FILE not in names and "data" not in names:
            raise UserError(f"output.dir {sd}: exists and is not a tune study;"
                            " pass another --output.dir or --overwrite")
        sd.mkdir(parents=True, exist_ok=True)
        tmp = sd / f".{STUDY_FILE}.{os.getpid()}.{threading.get_ident()}.tmp"
        write_json(tmp, {"backend": backend, "study_name": study_name(cfg), "created": time.time(),
                         "metric": cfg.tune.metric, "mode": mode_of(cfg)})
        try:
            os.link(tmp, marker)  # fails if another process made the marker first
            resuming = False
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    old = json.loads(marker.read_text())
    if old.get("backend") != backend:
        raise UserError(f"output.dir {sd}: holds a {old.get('backend')} study; use tune.backend"
                        f" {old.get('backend')} to resume it, or --overwrite to start afresh")
    return sd, resuming


def write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)


def prepare_key(cfg: Config) -> str:
    d = to_dict(cfg)
    key = {"data": d["data"], "prepare": {k: v for k, v in d["prepare"].items() if k not in ("spark_master",
                                                                                         "spark_conf")},
           "model": d["model"]["path"]}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def prepare_once(cfg: Config, sd: Path, tracker) -> None:
    """Prepare the data for all trials; concurrent `torchloom tune` processes on one study wait for it."""
    import fcntl

    with open(sd / ".prepare.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        key_file = sd / "data" / "prepare_key.txt"
        if (sd / "data" / "manifest.json").is_file():
            if key_file.is_file() and key_file.read_text() != prepare_key(cfg):
                raise UserError(f"output.dir {sd}: the study's data was prepared with other data, prepare or"
                                " model settings; use another --output.dir or --overwrite")
            say(f"reusing the prepared data in {sd / 'data'}")
            return
        study_cfg = config_mod.build(base=_with_output(cfg, sd))
        pipeline.prepare_stage(study_cfg, tracker=tracker)
        key_file.write_text(prepare_key(cfg))


def _with_output(cfg: Config, out: Path, **train_changes) -> Config:
    new = dataclasses.replace(cfg, output=dataclasses.replace(cfg.output, dir=str(out), overwrite=False))
    if train_changes:
        new = dataclasses.replace(new, train=dataclasses.replace(new.train, **train_changes))
    return new


# -- one trial ---------------------------------------------------------------------------------
def trial_dir(sd: Path, name: str) -> Path:
    return sd / "trials" / name


def start_trial(cfg: Config, sd: Path, name: str, values: dict[str, Any], parent_run_id: str | None):
    """The trial's run dir and config (resuming its own checkpoints after an interruption) and its
    MLflow run, nested under the study's."""
    td = trial_dir(sd, name)
    td.mkdir(parents=True, exist_ok=True)
    link = td / "data"
    if not link.exists():
        link.symlink_to(os.path.relpath(sd / "data", td))
    trial_cfg = space_mod.apply(cfg, values, where=f"trial {name}")
    # The checkpoint a trial exports is the best by the metric the study optimises.
    trial_cfg = dataclasses.replace(trial_cfg, train=dataclasses.replace(trial_cfg.train, metric=cfg.tune.metric))
    has_checkpoint = any((td / "checkpoints").glob("step-*/meta.json")) if (td / "checkpoints").is_dir() else False
    trial_cfg = _with_output(trial_cfg, td, resume="latest" if has_checkpoint else "")
    tracker = tracking.NullTracker()
    if parent_run_id and cfg.tracking.enabled:
        tracker = tracking.start(trial_cfg, "trial", run_name=name, parent_run_id=parent_run_id,
                                 extra_tags={"trial": name})
    info = {"trial": name, "params": values, "started": time.time(), "mlflow_run_id": tracker.run_id,
            "resumed": has_checkpoint}
    write_json(td / "trial.json", info)
    (td / "trial_result.json").unlink(missing_ok=True)
    return trial_cfg, tracker


def finish_trial(td: Path, status: str, result: dict | None = None) -> None:
    write_json(td / "trial_result.json", {"status": status, "ended": time.time(), **(result or {})})


def eval_history(td: Path) -> list[dict]:
    path = td / "metrics.jsonl"
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if rec.get("kind") == "eval":
                out.append(rec)
    return out


def best_value(td: Path, metric: str, mode: str) -> float | None:
    values = [r[metric] for r in eval_history(td) if space_mod.is_finite_number(r.get(metric))]
    if not values:
        return None
    return max(values) if mode == "max" else min(values)


def run_trial(cfg: Config, sd: Path, name: str, values: dict, parent_run_id: str | None,
              hooks: dict | None = None, quiet: bool = True) -> dict:
    """Train one trial to its end (or until a scheduler stops it); returns its train result."""
    trial_cfg, tracker = start_trial(cfg, sd, name, values, parent_run_id)
    td = trial_dir(sd, name)
    shown = ", ".join(f"{k.split('.')[-1]}={short(v)}" for k, v in values.items())
    say(f"trial {name} started: {shown}")
    with tracker:
        try:
            result = pipeline.train_stage(trial_cfg, quiet=quiet, tracker=tracker, hooks=hooks)
        except KeyboardInterrupt:
            finish_trial(td, "interrupted")
            raise
        except BaseException as e:
            finish_trial(td, "failed", {"error": str(e).splitlines()[0] if str(e) else type(e).__name__})
            raise
    status = "stopped early" if result.get("stop_reason") == "pruned" else "completed"
    finish_trial(td, status, {"stop_reason": result.get("stop_reason", ""), "steps": result["steps"]})
    value = best_value(td, cfg.tune.metric, mode_of(cfg))
    say(f"trial {name} {status} after {result['steps']} steps: best {cfg.tune.metric}"
        f" {'-' if value is None else f'{value:.4f}'}")
    return result


# -- results -----------------------------------------------------------------------------------
def collect(cfg: Config, sd: Path, params: list[Param]) -> list[dict]:
    rows = []
    mode = mode_of(cfg)
    root = sd / "trials"
    for td in sorted(root.iterdir() if root.is_dir() else [], key=lambda p: p.name):
        if not (td / "trial.json").is_file():
            continue
        info = json.loads((td / "trial.json").read_text())
        res = json.loads((td / "trial_result.json").read_text()) if (td / "trial_result.json").is_file() else {}
        history = eval_history(td)
        steps = max([r.get("step", 0) for r in history], default=0)
        status = res.get("status", "interrupted")
        rows.append({
            "trial": info["trial"],
            **{p.key: info["params"].get(p.key) for p in params},
            cfg.tune.metric: best_value(td, cfg.tune.metric, mode),
            "evals": len(history),
            "steps": res.get("steps", steps),
            "stopped_early": status == "stopped early",
            "status": status,
            "started": info.get("started", 0.0),
            "run_dir": str(td),
        })
    rows.sort(key=lambda r: r["started"])
    return rows


def pick_best(rows: list[dict], metric: str, mode: str) -> dict | None:
    scored = [r for r in rows if space_mod.is_finite_number(r[metric])]
    if not scored:
        return None
    return (max if mode == "max" else min)(scored, key=lambda r: r[metric])


def write_csv(rows: list[dict], params: list[Param], metric: str, path: Path) -> None:
    columns = ["trial", *[p.key for p in params], metric, "evals", "steps", "stopped_early", "status", "run_dir"]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=columns, extrasaction="ignore")
    w.writeheader()
    for r in rows:
        w.writerow(r)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(buf.getvalue())
    os.replace(tmp, path)


def table(rows: list[dict], params: list[Param], metric: str, best: dict | None) -> str:
    head = ["trial", *[p.key.split(".")[-1] for p in params], metric, "steps", "status"]
    body = []
    for r in rows:
        value = r[metric]
        body.append([("* " if r is best else "  ") + r["trial"], *[short(r[p.key]) for p in params],
                     "-" if value is None else f"{value:.4f}", str(r["steps"]), r["status"]])
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]
    widths[0] = max(widths[0], len(head[0]) + 2)
    lines = ["  ".join(h.ljust(w) for h, w in zip(["  " + head[0], *head[1:]], widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(b, widths)) for b in body]
    return "\n".join(lines)


def plot(rows: list[dict], params: list[Param], metric: str, mode: str, path: Path) -> None:
    """The metric by trial (in start order), and against each parameter; stopped trials hollow."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 1 + len(params)
    fig, axes = plt.subplots(1, panels, figsize=(4.2 * panels, 3.6), squeeze=False)
    axes = axes[0]
    scored = [(i, r) for i, r in enumerate(rows, 1) if space_mod.is_finite_number(r[metric])]

    def draw(ax, xs, rs):
        full = [(x, r[metric]) for x, r in zip(xs, rs) if not r["stopped_early"]]
        stopped = [(x, r[metric]) for x, r in zip(xs, rs) if r["stopped_early"]]
        if full:
            ax.scatter(*zip(*full), color="tab:blue", label="ran to the end", zorder=3)
        if stopped:
            ax.scatter(*zip(*stopped), facecolors="none", edgecolors="tab:red", label="stopped early", zorder=3)

    draw(axes[0], [i for i, _ in scored], [r for _, r in scored])
    if scored:
        running = []
        for _, r in scored:
            prev = running[-1] if running else r[metric]
            running.append(max(prev, r[metric]) if mode == "max" else min(prev, r[metric]))
        axes[0].step([i for i, _ in scored], running, where="post", color="grey", lw=1, label="best so far")
    axes[0].set_xlabel("trial (start order)")
    from matplotlib.ticker import MaxNLocator

    axes[0].xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0].set_ylabel(f"validation {metric}")
    axes[0].legend(fontsize=7)
    for ax, p in zip(axes[1:], params):
        pts = [(r[p.key], r) for _, r in scored if r.get(p.key) is not None]
        if p.kind == "choice":
            labels = [str(c) for c in p.args]
            draw(ax, [labels.index(str(v)) for v, _ in pts], [r for _, r in pts])
            ax.set_xticks(range(len(labels)), labels)
        else:
            draw(ax, [v for v, _ in pts], [r for _, r in pts])
            if p.log:
                ax.set_xscale("log")
        ax.set_xlabel(p.key)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle(f"{len(rows)} trials, validation {metric} ({mode})", fontsize=10)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


def export_best(cfg: Config, sd: Path, best: dict, tracker) -> dict:
    """The best trial's selected checkpoint to <study>/model, scored on the test split."""
    td = Path(best["run_dir"])
    trial_cfg = config_mod.load_saved(td / "config.toml")
    with contextlib.redirect_stdout(sys.stderr):
        pipeline.export_stage(trial_cfg)
    staging = sd / ".model.tmp"
    if staging.exists():
        shutil.rmtree(staging)
    shutil.copytree(td / "model", staging)
    if (sd / "model").exists():
        shutil.rmtree(sd / "model")
    os.replace(staging, sd / "model")
    shutil.copyfile(td / "metrics.jsonl", sd / "metrics.jsonl")
    best_cfg = _with_output(trial_cfg, sd / "best", resume="")
    config_mod.save(best_cfg, sd / "best_config.toml")
    study_cfg = _with_output(trial_cfg, sd)
    result: dict = {}
    if read_manifest(sd / "data").split(cfg.eval.split).rows:
        result = pipeline.evaluate_stage(study_cfg, extra={"tune": {"best_trial": best["trial"]}}, tracker=tracker)
    if tracker.enabled and cfg.tracking.log_model:
        tracker.log_model(sd / "model")
    return result


def absolute_paths(cfg: Config) -> Config:
    def absolute(path: str) -> str:
        if not path or "://" in path or Path(path).is_absolute():
            return path
        return str(Path(path).resolve())

    return dataclasses.replace(
        cfg, data=dataclasses.replace(cfg.data, path=absolute(cfg.data.path)),
        model=dataclasses.replace(cfg.model, path=absolute(cfg.model.path)),
        output=dataclasses.replace(cfg.output, dir=str(pipeline.run_dir(cfg))),
    )


def run(cfg: Config) -> dict:
    """Check the space, prepare once, run the trials on the chosen backend, then report and export."""
    params = space_mod.parse(cfg)  # a bad space fails here, before anything starts
    backend = choose_backend(cfg)
    mode = mode_of(cfg)
    sd, resuming = open_study_dir(cfg, backend)
    say(f"{'resuming' if resuming else 'starting'} study {study_name(cfg)!r} in {sd}: {cfg.tune.trials} trials,"
        f" {backend} backend, {cfg.engine.workers} workers per trial on the "
        f"{'ray' if backend == 'ray' else cfg.engine.name} engine, {mode}imise validation {cfg.tune.metric}")
    started = time.perf_counter()
    cfg = absolute_paths(cfg)  # trials run in other processes, in other working directories
    with tracking.start(cfg, "tune", run_name=study_name(cfg)) as tracker:
        if tracker.enabled:
            cfg = dataclasses.replace(cfg, tracking=dataclasses.replace(cfg.tracking, uri=tracker.uri))
        prepare_once(cfg, sd, tracker)
        if backend == "ray":
            from torchloom.tune import ray_backend

            ray_backend.run(cfg, sd, params, tracker.run_id)
        else:
            from torchloom.tune import optuna_backend

            optuna_backend.run(cfg, sd, params, tracker.run_id)
        return report(cfg, sd, params, tracker, backend, time.perf_counter() - started)


def report(cfg: Config, sd: Path, params: list[Param], tracker, backend: str, seconds: float) -> dict:
    import fcntl

    # Processes sharing the study (Optuna) take turns: each writes the results it sees and the best model.
    with open(sd / ".report.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _report(cfg, sd, params, tracker, backend, seconds)


def _report(cfg: Config, sd: Path, params: list[Param], tracker, backend: str, seconds: float) -> dict:
    mode = mode_of(cfg)
    metric = cfg.tune.metric
    rows = collect(cfg, sd, params)
    best = pick_best(rows, metric, mode)
    write_csv(rows, params, metric, sd / "results.csv")
    if rows:
        plot(rows, params, metric, mode, sd / "results.png")
    print(table(rows, params, metric, best), flush=True)
    summary: dict[str, Any] = {
        "study_name": study_name(cfg), "backend": backend, "metric": metric, "mode": mode,
        "trials": len(rows), "stopped_early": sum(r["stopped_early"] for r in rows),
        "seconds": round(seconds, 1), "results_csv": str(sd / "results.csv"),
    }
    if best is None:
        write_json(sd / STUDY_FILE, {**json.loads((sd / STUDY_FILE).read_text()), **summary})
        raise UserError(f"tune: no trial in {sd} reported validation {metric}; see the trials' logs in"
                        f" {sd / 'trials'}")
    ev = export_best(cfg, sd, best, tracker)
    summary.update({
        "best_trial": best["trial"], "best_value": best[metric],
        "best_params": {p.key: best[p.key] for p in params},
        "best_config": str(sd / "best_config.toml"), "model_dir": str(sd / "model"),
        "test": {k: v for k, v in (ev.get("metrics") or {}).items() if k in ("accuracy", "macro_f1", "n")},
    })
    write_json(sd / STUDY_FILE, {**json.loads((sd / STUDY_FILE).read_text()), **summary})
    tracker.log_metrics({f"best_val_{metric}": best[metric], "trials": len(rows),
                         "trials_stopped_early": summary["stopped_early"]})
    tracker.set_tags({"best_trial": best["trial"]})
    for name in ("results.csv", "results.png", "best_config.toml", STUDY_FILE):
        tracker.log_artifact(sd / name)
    shown = ", ".join(f"{p.key}={short(best[p.key])}" for p in params)
    test = summary["test"]
    print(f"\ntorchloom tune finished: {len(rows)} trials ({summary['stopped_early']} stopped early) in"
          f" {seconds:.0f} s\n  best    {best['trial']}: validation {metric} {best[metric]:.4f} with {shown}\n"
          + (f"  test    accuracy {test['accuracy']:.4f}   macro-F1 {test['macro_f1']:.4f}\n" if test else "")
          + f"  results {sd / 'results.csv'}  (plot {sd / 'results.png'})\n"
          f"  config  {sd / 'best_config.toml'}\n  model   {sd / 'model'}  (torchloom serve {sd / 'model'})",
          flush=True)
    return summary

