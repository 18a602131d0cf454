"""What the stages tell the user on the terminal: a line on stderr (say), the precision, training and mix lines,
and the summary `torchloom run` prints at the end."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from torchloom import preflight
from torchloom.config import Config
from torchloom.config.engines import engine_of
from torchloom.runs.rundir import RunDir

if TYPE_CHECKING:
    from torchloom.train.result import TrainResult


def say(msg: str) -> None:
    print(f"torchloom: {msg}", file=sys.stderr, flush=True)


def precision_line(cfg: Config) -> str:
    """What train.precision is for the workers: decided here for the local engine (this machine is theirs),
    by each worker on its own device on Spark and Ray (the result says what they chose)."""
    if not engine_of(cfg.engine).precision_here:
        return f"precision {cfg.train.precision}" + (" (each worker decides on its device)"
                                                       if cfg.train.precision == "auto" else "")
    from torchloom.model.device import choose_precision

    device = "cuda" if preflight.visible_gpus(cfg) else "cpu"
    choice = choose_precision(cfg.train.precision, device, scaler_ok=cfg.train.strategy == "ddp")
    if choice.warning:
        say(f"warning: {choice.warning}")
    return f"precision {choice.precision} ({choice.reason})"


def combine_line(combine: dict) -> str:
    """What export says of the mix: the weight and why, from the val scores it was chosen on (accuracy; a
    multi-label model's micro-F1)."""
    metric = combine.get("metric", "accuracy")
    val = combine[f"val_{metric}"]
    scores = (f"val {'micro-F1' if metric == 'micro_f1' else metric}: transformer {val['transformer']:.4f}, baseline"
              f" {val['baseline']:.4f}, shipped {val['shipped']:.4f} on {combine['texts']} texts")
    if combine["weight"] >= 1.0:
        return f"ships the transformer alone (the mix with the baseline did not beat it on val; {scores})"
    if combine["weight"] <= 0.0:
        return (f"the baseline won: ships the baseline alone, the transformer is not run when serving (no mix with"
                f" it beat the baseline on val; {scores})")
    return (f"ships the mix: {combine['weight']:.2f} x the transformer + {1 - combine['weight']:.2f} x the baseline"
            f" ({scores})")


def training_line(cfg: Config, m, result: TrainResult) -> str:
    """How long training ran on the prepared data `m` against what was asked or chosen (train.epochs auto:
    config/budget.py), one line."""
    from torchloom.config import budget

    chosen, why = cfg.train.epochs, None
    if chosen == "auto":
        chosen, why = budget.choose_epochs(cfg.train.budget, m.num_labels, m.split("train").rows,
                                           result.global_batch or budget.known_batch(cfg.train))
    stop = {"early_stopping": "; stopped early: validation had stopped improving",
            "budget": f"; stopped at train.budget {cfg.train.budget}"}.get(result.stop_reason or "", "")
    return (f"{result.epochs:g} of {chosen} epochs" + (f" (epochs auto: {why})" if why else "") + stop
            + (f"; the best on validation (step {result.best_step}) exported"
               if result.best_step and cfg.train.select == "best" else ""))


PHASE_NAMES = {"data": "data", "forward_backward": "forward+backward", "optimizer": "optimizer", "notice": "notice",
               "checkpoint": "checkpoint", "eval": "eval"}


def speed_line(result: TrainResult) -> str:
    """Throughput as a GPU user reads it: samples/s, real tokens/s and the padding, MFU where the GPU's peak is
    known, and where a step's time went (train/clock.py)."""
    line = (f"{result.samples_per_s:.1f} samples/s, {result.tokens_per_s:,.0f} tokens/s"
            f" ({result.padding * 100:.0f}% of the tokens computed were padding{', packed' if result.packed else ''})")
    if result.mfu is not None:
        line += f", MFU {result.mfu * 100:.1f}%"
    if result.compiled_graphs is not None:
        line += f", compiled ({result.compiled_graphs} graph{'s' if result.compiled_graphs != 1 else ''})"
    split = ", ".join(f"{PHASE_NAMES.get(k, k)} {v * 100:.0f}%" for k, v in result.time_split.items())
    return line + (f"; time: {split}" if split else "")


def _primary(cmp: dict, who: str = "") -> str:
    """The comparison's first score: accuracy, or a multi-label run's micro-F1 (named)."""
    if cmp.get("metric") == "micro_f1":
        return f"micro-F1 {cmp[who + 'micro_f1']:.4f}"
    return f"{cmp[who + 'accuracy']:.4f}"


def summary_text(summary: dict, split: str, rd: RunDir, tracker) -> str:
    """What `torchloom run` prints at the end."""
    timings = summary["timings"]
    stage_times = ", ".join(f"{k[:-2]} {v:.0f}s" for k, v in timings.items() if k != "total_s")
    lines = [f"\ntorchloom run finished in {timings['total_s']:.0f} s ({stage_times})",
             f"  {split} accuracy {summary['accuracy']:.4f}   macro-F1 {summary['macro_f1']:.4f}"
             if "micro_f1" not in summary else  # a multi-label run: its accuracy is every tag of a text right
             f"  {split} micro-F1 {summary['micro_f1']:.4f}   macro-F1 {summary['macro_f1']:.4f}   subset accuracy"
             f" {summary['accuracy']:.4f}",
             f"  precision {summary['precision']} ({summary['precision_reason']}); {summary['workers']} workers",
             f"  trained {summary['training']}",
             *([f"  speed   {summary['speed']}"] if summary.get("speed") else []),
             f"  start-up {startup_line(summary['startup'])}"]
    cmp, shipped = summary.get("baseline"), summary.get("shipped")
    if shipped:  # three rows: what ships (above), the transformer alone, the baseline
        lines[1] += (f"   (shipped: {shipped['weight']:.2f} x the transformer + {1 - shipped['weight']:.2f} x the"
                     " baseline, the weight chosen on val)")
        lines.append(f"  transformer {_primary(cmp, 'transformer_')}   macro-F1 {cmp['transformer_macro_f1']:.4f}")
    if cmp:
        key = cmp.get("metric", "accuracy")
        lines.append(f"  baseline {_primary(cmp)}   macro-F1 {cmp['macro_f1']:.4f}   ({cmp['name']};"
                     f" the transformer {cmp[f'{key}_gain'] * 100:+.1f} points of"
                     f" {'micro-F1' if key == 'micro_f1' else 'accuracy'})")
    if summary.get("verdict"):
        lines.append(f"  note    {summary['verdict']}")
    if summary.get("data", {}).get("path"):
        from torchloom.inputs.tables import describe

        lines.append(f"  data    {summary['data']['path']} ({describe(summary['data'])})")
    lines += [f"  model   {summary['model_dir']}", f"  report  {summary['report']}", f"  plots   {rd.home(rd.plots)}",
              f"  predict torchloom predict --model {summary['model_dir']} \"some text\""]
    if tracker.enabled:
        lines.append(f"  mlflow  run {tracker.run_id} in {tracker.shown_uri}")
    return "\n".join(lines)


STARTUP_NAMES = {"spark_start_s": "Spark start", "read_clean_s": "read+clean", "tokenize_s": "tokenize",
                 "baseline_s": "baseline", "worker_launch_s": "worker launch", "process_group_s": "process group",
                 "model_load_s": "model load", "data_s": "loader", "first_batch_s": "first batch",
                 "first_step_s": "first step"}


def startup_line(startup: dict) -> str:
    """The start-up account as one line: each phase before the first step, then when that step ended."""
    parts = [f"{name} {startup[k]:.1f}s" for k, name in STARTUP_NAMES.items() if startup.get(k) is not None]
    end = startup.get("first_step_after_s")
    return ", ".join(parts) + (f" (first step done {end:.0f} s after the start)" if end is not None else "")
