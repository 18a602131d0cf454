"""The candidate: the champion's recipe (the resolved config its run recorded, config.toml: the model, the
training, the engine, the tracking) run again with `torchloom run` on the snapshot's files instead of the
original data. Only what the snapshot changes is overridden: the data paths and columns, the output directory,
and an alias the registry would otherwise move before any gate (the loop moves it on promotion). The run is a
child process (its own memory, its own failure) that ends with the loop, a SIGKILLed loop included (the kernel's
parent-death signal: no orphaned run goes on writing into the directory the restarted loop trains in again, with
--overwrite: the run is the loop's own); its output is kept in the cycle's train.log, progress lines passed
through."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from torchloom.errors import UserError
from torchloom.loop.snapshot import FILES
from torchloom.uri import has_scheme

RUNNING = False  # a candidate is training now (the loop's SIGTERM then stops it too)
TAIL = ("train: step", "epoch", "evaluate:", "export:", "accuracy")


def recipe_of(model_path: str, given: str = "") -> Path:
    """The champion's run directory: `given`, else the one its model was exported into (RUN/model), else for a
    model served from the registry the run its version was registered from (loop/registry.py)."""
    from torchloom.runs.rundir import CONFIG_FILE

    run = Path(given) if given else Path(model_path).parent
    if not given and not (run / CONFIG_FILE).is_file():
        from torchloom.loop.registry import recorded_run

        recorded = recorded_run(model_path)
        run = Path(recorded) if recorded and not has_scheme(recorded) else run
    if not (run / CONFIG_FILE).is_file() or not (run / "data").is_dir():
        where = f"--recipe {given}" if given else f"the champion's model {model_path}"
        raise UserError(f"loop: {where}: no run directory with a config.toml and its prepared data there; give the"
                        " champion's run with --recipe RUN_DIR (what torchloom run wrote)")
    return run


def data_flags(snapshot: Path) -> list[str]:
    """The snapshot's files as the recipe's data, in place of the original's."""
    return ["--data.path", str(snapshot / FILES["train"]), "--data.val_path", str(snapshot / FILES["val"]),
            "--data.test_path", str(snapshot / FILES["test"]), "--data.format", "parquet", "--data.version", "",
            "--data.text_column", "text", "--data.label_column", "label", "--data.label_columns", "",
            "--data.split_column", "", "--data.task", "single_label"]


def command(recipe: Path, snapshot: Path, out: Path | str, stage: str = "run") -> list[str]:
    from torchloom.config.load import load_saved
    from torchloom.runs.rundir import CONFIG_FILE

    cfg = load_saved(recipe / CONFIG_FILE)
    args = [sys.executable, "-m", "torchloom", stage, "--config", str(recipe / CONFIG_FILE), *data_flags(snapshot),
            "--output.dir", str(out)]
    if cfg.export.register and stage in ("run", "export"):
        args += ["--export.alias", ""]
    return args


def train(recipe: Path, snapshot: Path, out: Path, say) -> dict[str, Any]:
    """Run the recipe (module docstring); the run's summary.json. A run that fails is a UserError naming its log."""
    import json

    out.parent.mkdir(parents=True, exist_ok=True)
    args = command(recipe, snapshot, out)
    if out.exists():
        args.append("--overwrite")  # a run the loop started before it stopped: the loop's own, started again
    say(f"loop: training the candidate: {' '.join(args[2:])}")
    code = child(args, out.parent / "train.log", say)
    summary = out / "summary.json"
    if code != 0 or not summary.is_file():
        raise UserError(f"loop: training the candidate failed (exit {code}); its output is in"
                        f" {out.parent / 'train.log'}")
    return json.loads(summary.read_text())


def child(args: list[str], log_path: Path, say=None) -> int:
    """`args` as a child process of its own session that ends with the loop; its output into `log_path`, the
    progress lines (TAIL) passed on to `say`; its exit code."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    global RUNNING
    with open(log_path, "w", encoding="utf-8") as log:
        RUNNING = True
        from torchloom.engines.lifeline import child_lifeline

        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                start_new_session=True, preexec_fn=child_lifeline(os.getpid()))  # noqa: PLW1509
        try:
            for line in proc.stdout:
                log.write(line)
                log.flush()  # a person (or a test) tailing the log sees the child as it goes
                if say is not None and any(mark in line for mark in TAIL):
                    say(f"loop:   {line.rstrip()[:200]}")
            return proc.wait()
        except BaseException:  # the loop stopped: its child goes with it
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait()
            raise
        finally:
            RUNNING = False
