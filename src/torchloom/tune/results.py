"""A study's results: the table, results.csv and its plot, and the best trial exported and tested."""

from __future__ import annotations

import contextlib
import csv
import io
import shutil
import sys
from pathlib import Path
from typing import Any

from torchloom import config as config_mod
from torchloom.config import Config
from torchloom.errors import UserError
from torchloom.jsonio import read_json, write_atomic, write_json
from torchloom.manifest import read as read_manifest
from torchloom.runs.rundir import RunDir, StudyDir
from torchloom.stages.evaluate import evaluate_stage
from torchloom.stages.export import export_stage
from torchloom.tune import space as space_mod
from torchloom.tune.common import mode_of, study_name, with_output
from torchloom.tune.space import Param, short
from torchloom.tune.trial import best_value, eval_history, read_trial


def collect(cfg: Config, sd: StudyDir, params: list[Param]) -> list[dict]:
    rows = []
    mode = mode_of(cfg)
    for path in sorted(sd.trials.iterdir() if sd.trials.is_dir() else [], key=lambda p: p.name):
        td = RunDir(path)
        if not td.trial_info.is_file():
            continue
        info, res = read_trial(td)
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
            "run_dir": str(td.root),
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
    write_atomic(path, buf.getvalue())


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
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    write_atomic(path, buf.getvalue())


def export_best(cfg: Config, sd: StudyDir, best: dict, tracker) -> dict:
    """The best trial's selected checkpoint to <study>/model, scored on the test split."""
    td = RunDir(best["run_dir"])
    trial_cfg = config_mod.load_saved(td.config)
    with contextlib.redirect_stdout(sys.stderr):
        export_stage(trial_cfg)
    staging = sd.root / ".model.tmp"
    if staging.exists():
        shutil.rmtree(staging)
    shutil.copytree(td.model, staging)
    if sd.model.exists():
        shutil.rmtree(sd.model)
    staging.rename(sd.model)
    shutil.copyfile(td.metrics, sd.metrics)
    best_cfg = with_output(trial_cfg, sd.root / "best", resume="")
    config_mod.save(best_cfg, sd.best_config)
    study_cfg = with_output(trial_cfg, sd.root)
    result: dict = {}
    if read_manifest(sd.data).split(cfg.eval.split).rows:
        result = evaluate_stage(study_cfg, extra={"tune": {"best_trial": best["trial"]}}, tracker=tracker)
    if tracker.enabled and cfg.tracking.log_model:
        tracker.log_model(sd.model)
    return result


def report(cfg: Config, sd: StudyDir, params: list[Param], tracker, backend: str, seconds: float) -> dict:
    import fcntl

    # Processes sharing the study (Optuna) take turns: each writes the results it sees and the best model.
    with open(sd.lock("report"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _report(cfg, sd, params, tracker, backend, seconds)


def _report(cfg: Config, sd: StudyDir, params: list[Param], tracker, backend: str, seconds: float) -> dict:
    mode = mode_of(cfg)
    metric = cfg.tune.metric
    rows = collect(cfg, sd, params)
    if backend == "optuna":  # a study shared through a database: the trials of the other hosts too
        from torchloom.tune.optuna_backend import trials_elsewhere

        rows = sorted(rows + trials_elsewhere(cfg, params, {r["trial"] for r in rows}), key=lambda r: r["started"])
    best = pick_best(rows, metric, mode)
    own = pick_best([r for r in rows if not r.get("elsewhere")], metric, mode)  # the best this host can export
    write_csv(rows, params, metric, sd.results_csv)
    if rows:
        plot(rows, params, metric, mode, sd.results_png)
    print(table(rows, params, metric, best), flush=True)
    summary: dict[str, Any] = {
        "study_name": study_name(cfg), "backend": backend, "metric": metric, "mode": mode,
        "trials": len(rows), "stopped_early": sum(r["stopped_early"] for r in rows),
        "seconds": round(seconds, 1), "results_csv": str(sd.results_csv),
    }
    if best is None:
        write_json(sd.marker, {**read_json(sd.marker), **summary})
        raise UserError(f"tune: no trial in {sd.where} reported validation {metric}; see the trials' logs in"
                        f" {sd.trials}")
    if own is None:
        write_json(sd.marker, {**read_json(sd.marker), **summary, "best_trial": best["trial"]})
        print(f"\ntorchloom tune finished: {len(rows)} trials; the best, {best['trial']} (validation {metric}"
              f" {best[metric]:.4f}), and every scored one ran on other hosts ({best['run_dir']}): its model is"
              " exported by the `torchloom tune` of that host", flush=True)
        return summary
    if own is not best:
        print(f"tune: the study's best trial, {best['trial']} (validation {metric} {best[metric]:.4f}), ran on"
              f" another host ({best['run_dir']}), which exports it; this host exports its own best, {own['trial']}",
              file=sys.stderr, flush=True)
        best = own
    ev = export_best(cfg, sd, best, tracker)
    summary.update({
        "best_trial": best["trial"], "best_value": best[metric],
        "best_params": {p.key: best[p.key] for p in params},
        "best_config": str(sd.best_config), "model_dir": str(sd.model),
        "test": {k: v for k, v in (ev.get("metrics") or {}).items() if k in ("accuracy", "macro_f1", "n")},
    })
    write_json(sd.marker, {**read_json(sd.marker), **summary})
    tracker.log_metrics({f"best_val_{metric}": best[metric], "trials": len(rows),
                         "trials_stopped_early": summary["stopped_early"]})
    tracker.set_tags({"best_trial": best["trial"]})
    for path in (sd.results_csv, sd.results_png, sd.best_config, sd.marker):
        tracker.log_artifact(path)
    shown = ", ".join(f"{p.key}={short(best[p.key])}" for p in params)
    test = summary["test"]
    print(f"\ntorchloom tune finished: {len(rows)} trials ({summary['stopped_early']} stopped early) in"
          f" {seconds:.0f} s\n  best    {best['trial']}: validation {metric} {best[metric]:.4f} with {shown}\n"
          + (f"  test    accuracy {test['accuracy']:.4f}   macro-F1 {test['macro_f1']:.4f}\n" if test else "")
          + f"  results {sd.results_csv}  (plot {sd.results_png})\n"
          f"  config  {sd.best_config}\n  model   {sd.model}  (torchloom serve {sd.model})",
          flush=True)
    return summary
