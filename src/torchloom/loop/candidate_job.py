"""The candidate trained on Kubernetes (`torchloom loop --train-on k8s --store s3://...`): the champion's recipe as
`torchloom k8s train` runs a training, in four steps, each a child process or the API, each recorded in the cycle's
job.json so that a loop that restarts goes on from the step it was at:

1. prepare: `torchloom prepare` of the recipe on the snapshot's files, the run on the store (STORE/FLEET-rN)
   (again with --overwrite where a loop before this one started it: the loop's own run);
2. train: the headless Service and the Indexed Job of k8s/job.py (one pod per node, torchrun in each) created
   through the API from the loop's pod and watched to their end (k8s/jobs.py: a Job of the name not recorded
   is refused, the loop's own adopted; deleted once complete, kept when failed);
3. export: `torchloom export` of the run (registered without the alias, as the loop's candidates are);
4. evaluate: `torchloom evaluate` of the run; its report.json's accuracy is the candidate's.

The Job's [k8s] settings are the recipe's, overridden by $TORCHLOOM_TRAIN_K8S (a JSON object of [k8s] keys:
what `torchloom k8s loop` was given, the image, the namespace, the Secret, the nodes and GPUs); its name is the
run's (k8s.name is not taken: each cycle's Job is its own). A recipe whose engine is Spark or Ray trains here
with torchrun in the pods (the local engine's launch, as `torchloom k8s train`'s).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torchloom.errors import UserError

K8S_ENV = "TORCHLOOM_TRAIN_K8S"


def job_config(recipe: Path, out: str):
    """The recipe's config for a training of `out` in an Indexed Job (module docstring)."""
    from torchloom.config.engines import ENGINES, engine_of
    from torchloom.config.load import build
    from torchloom.k8s.job import flag_value
    from torchloom.runs.rundir import CONFIG_FILE

    given = os.environ.get(K8S_ENV, "").strip()
    try:
        k8s = json.loads(given) if given else {}
    except ValueError:
        k8s = None
    if not isinstance(k8s, dict):
        raise UserError(f"${K8S_ENV}: not a JSON object of [k8s] keys; `torchloom k8s loop` writes it, e.g."
                        ' {"image": "registry/torchloom:0.1", "namespace": "ml", "nodes": 2}')
    flags = ["--output.dir", out]
    for key, value in k8s.items():
        if key != "name":
            flags += [f"--k8s.{key}", flag_value(value)]
    cfg = build(str(recipe / CONFIG_FILE), flags)
    if not engine_of(cfg.engine).k8s_job:
        cfg.engine.name = next(name for name, e in ENGINES.items() if e.k8s_job)
    return cfg


def _journal(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _note(path: Path, **done: Any) -> dict[str, Any]:
    state = {**_journal(path), **done}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state))
    tmp.replace(path)
    return state


def _step(args: list[str], log: Path, what: str, say) -> None:
    from torchloom.loop.candidate import child

    say(f"loop: {what}: {' '.join(args[2:])}")
    code = child(args, log, say)
    if code != 0:
        raise UserError(f"loop: {what} failed (exit {code}); its output is in {log}")


def train(recipe: Path, snapshot: Path, cycle_dir: Path, store: str, name: str, say: Callable[[str], object]
          ) -> dict[str, Any]:
    """The four steps (module docstring); a summary as `torchloom run`'s: the run, its accuracy, its registered
    version. A step that fails is a UserError naming its log (or the Job)."""
    from torchloom.k8s.job import train_manifests
    from torchloom.k8s.jobs import JobRun
    from torchloom.loop import candidate
    from torchloom.store.storage import join, read_bytes

    out = join(store, name)
    cycle_dir.mkdir(parents=True, exist_ok=True)
    journal = cycle_dir / "job.json"
    state = _journal(journal)
    if not state.get("prepared"):
        args = candidate.command(recipe, snapshot, out, "prepare") + (["--overwrite"] if state.get("preparing")
                                                                        else [])
        _note(journal, preparing=True, run=out)
        _step(args, cycle_dir / "prepare.log", "preparing the candidate's data on the store", say)
        state = _note(journal, prepared=True)
    cfg = job_config(recipe, out)
    job = JobRun(train_manifests(cfg), cfg.k8s.namespace, cycle_dir / "job-objects.json", say)
    if not state.get("trained"):
        how = job.submit()
        say(f"loop: training the candidate as job {job.job} in namespace {cfg.k8s.namespace} ({how}):"
            f" {cfg.k8s.nodes} pods x {cfg.engine.workers // cfg.k8s.nodes} ranks")
        candidate.RUNNING = True  # the loop's SIGTERM ends the wait; the Job goes on, the next loop adopts it
        try:
            job.wait()
        finally:
            candidate.RUNNING = False
        state = _note(journal, trained=True)
    for gone in job.delete():
        say(f"loop:   deleted {gone}")
    if not state.get("exported"):
        _step(candidate.command(recipe, snapshot, out, "export"), cycle_dir / "export.log", "exporting the candidate",
              say)
        state = _note(journal, exported=True)
    _step(candidate.command(recipe, snapshot, out, "evaluate"), cycle_dir / "evaluate.log",
          "evaluating the candidate", say)
    report = json.loads(read_bytes(join(out, "report.json")))
    from torchloom.loop.registry import registered_from

    return {"run_dir": out, "accuracy": report["metrics"]["accuracy"], "macro_f1": report["metrics"].get("macro_f1"),
            "registered": registered_from(recipe, out, say)}
