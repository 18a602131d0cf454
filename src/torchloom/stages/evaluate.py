"""The evaluate stage: the exported model (and the baseline beside it) scored on eval.split, the report
written (evaluate/report.py) with the ONNX gate's numbers (evaluate/onnx_gate.py)."""

from __future__ import annotations

import time

from torchloom.console import say
from torchloom.errors import UserError
from torchloom.evaluate.onnx_gate import onnx_gate
from torchloom.jsonio import read_json
from torchloom.runs.run import Run
from torchloom.runs.rundir import RunDir
from torchloom.stages import recorded
from torchloom.stages.baseline import baseline_stage, stored_baseline


@recorded
def evaluate_stage(run: Run, extra: dict | None = None, announce: bool = True) -> dict:
    """Score the exported model (and the baseline beside it); announce: print the verdict line here (run
    prints it in its summary instead)."""
    from torchloom.evaluate.report import write_report
    from torchloom.evaluate.run import evaluate_model_dir

    cfg, rd, files, tracker = run.cfg, run.rd, run.files, run.tracker
    started = time.perf_counter()
    from torchloom import manifest as manifest_mod
    from torchloom.model.export import check_exported

    files.ensure(rd.model, rd.data)
    check_exported(rd.model, "run torchloom export (or torchloom run) first")
    m = manifest_mod.read(rd.data)
    if m.split(cfg.eval.split).rows == 0:
        raise UserError(f"eval.split {cfg.eval.split}: the split is empty in {rd.home(rd.data)}; choose another split"
                        " or prepare with a non-zero fraction for it")
    from torchloom.stages.sessions import ScoringSpark

    with ScoringSpark(run, "evaluate") as spark:
        metrics, misclassified = evaluate_model_dir(cfg, str(rd.model), m, spark)
    cmp, line = None, None
    if cfg.eval.baseline:
        from torchloom.evaluate.baseline import comparison, verdict

        stored = stored_baseline(run, m) or baseline_stage(run)
        cmp = comparison(metrics, stored, cfg.eval.split) if stored else None
        line = verdict(cmp, m, (extra or {}).get("train") or _train_result(rd)) if cmp else None
    seconds = round(time.perf_counter() - started, 2)
    gate = onnx_gate(rd.model)
    write_report(rd, metrics, split=cfg.eval.split, label_names=m.labels, misclassified=misclassified,
                 extra={"evaluate_s": seconds, **(extra or {}), **({"onnx_export": gate} if gate else {})},
                 baseline=cmp, verdict=line)
    files.push(rd.report_md, rd.report_json, rd.misclassified, rd.plots)
    if tracker is not None:
        tracker.log_metrics({f"{cfg.eval.split}_{k}": v for k, v in metrics.items()
                             if isinstance(v, (int, float)) and not isinstance(v, bool)})
        tracker.log_artifact(rd.report_md)
        tracker.log_artifact(rd.report_json)
        tracker.log_artifact(rd.plots, "plots")
    against = f" (baseline {cmp[cmp.get('metric', 'accuracy')]:.4f}, {cmp['macro_f1']:.4f})" if cmp else ""
    scores = (f"micro-F1 {metrics['micro_f1']:.4f}, macro-F1 {metrics['macro_f1']:.4f}, subset accuracy"
              f" {metrics['accuracy']:.4f}" if metrics.get("task") == "multi_label" else
              f"accuracy {metrics['accuracy']:.4f}, macro-F1 {metrics['macro_f1']:.4f}")
    say(f"evaluate ({cfg.eval.split}, {metrics['n']} rows): {scores}{against}; report {rd.home(rd.report_md)}")
    if line and announce:
        say(line)
    return {"seconds": seconds, "metrics": metrics, "baseline": cmp, "verdict": line}


def _train_result(rd: RunDir) -> dict | None:
    try:
        return read_json(rd.train_result)
    except (OSError, ValueError):
        return None
