"""The checks before a stage starts: what cannot run on this machine, stores that do not answer, an output.dir that
cannot be written or holds someone else's files, inputs that match nothing, a run that cannot be trained. Each
failure is one line (a UserError), and nothing is written to find out.

Each check runs once per command. The CLI enters command() and checks the config before it takes the run's
lease; `run` and the stages it calls (or `tune` and its study) check the same config again, and within the command
they get the kept answer instead of asking the machine and the store again. Outside a command (a stage called from
Python, a Ray Tune trial's own process) every call checks.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from torchloom import config as config_mod
from torchloom.config import Config
from torchloom.errors import UserError
from torchloom.etl.session import runs_on_this_machine
from torchloom.manifest import read as read_manifest
from torchloom.rundir import RunDir
from torchloom.runfiles import RunFiles
from torchloom.uri import is_uri, redact

T = TypeVar("T")

_answers: dict[tuple[str, str], object] | None = None  # in a command: each check's answer, by what it checked


@contextmanager
def command() -> Iterator[None]:
    """One command: within it, each check answers once for what it checks (see the module's docstring)."""
    global _answers
    _answers = {}
    try:
        yield
    finally:
        _answers = None


def once(check: str, key: str, answer: Callable[[], T]) -> T:
    """answer(), kept for the rest of the command under (check, key); asked every time outside a command. A failed
    check raises and keeps nothing."""
    if _answers is None:
        return answer()
    if (check, key) not in _answers:
        _answers[check, key] = answer()
    return _answers[check, key]  # type: ignore[return-value]


def visible_gpus(cfg: Config) -> int:
    """CUDA devices the ranks could use here (config.ranks_here: the local engine, a Ray instance of our own):
    nvidia-smi first (no torch to import on a machine without one), then torch's own count, which is what the
    workers will see."""
    if not config_mod.ranks_here(cfg) or cfg.engine.device == "cpu":
        return 0
    from torchloom.machine import gpu_names

    if not gpu_names() and cfg.engine.device == "auto":
        return 0
    from torchloom.model.device import gpu_count

    return gpu_count()


_STORES_CHECKED: set[str] = set()


def check_stores(cfg: Config) -> None:
    """A run or data on a store: the store answers, the bucket exists and the credentials may read the data and
    write the run, said in one line before any stage starts (once per URI and process)."""
    from torchloom.etl.inputs import check_reachable

    for key, uri, check in (("output.dir", cfg.output.dir, lambda uri, key: RunFiles(uri).check_writable(key)),
                            ("data.path", cfg.data.path, check_reachable),
                            ("data.val_path", cfg.data.val_path, check_reachable),
                            ("data.test_path", cfg.data.test_path, check_reachable)):
        if is_uri(uri) and redact(uri) != uri:
            raise UserError(f"{key} {redact(uri)}: holds credentials (user:password@ or a query string);"
                            " give them in the environment (AWS_*, GOOGLE_APPLICATION_CREDENTIALS or AZURE_STORAGE_*,"
                            " a profile, an instance role),"
                            " never in the URI, which is written to config.toml and logs")
        if is_uri(uri) and uri not in _STORES_CHECKED:
            if key.startswith("data.") and not runs_on_this_machine(cfg.prepare.spark_master):
                continue  # a Spark cluster reads it with its own connector and credentials
            check(uri, key)
            _STORES_CHECKED.add(uri)


def for_this_machine(cfg: Config) -> Config:
    """engine.workers auto counted on this machine, and what cannot run here refused, before any stage
    starts (config/load.resolve_workers); a config already counted passes through. Stores are checked too.
    Once per config in a command: the counted config is its own answer."""
    counted = once("for_this_machine", repr(cfg), lambda: _for_this_machine(cfg))
    return once("for_this_machine", repr(counted), lambda: counted)


def _for_this_machine(cfg: Config) -> Config:
    check_stores(cfg)
    if not is_uri(cfg.output.dir):
        check_output_dir(RunDir(cfg.output.dir).root)
    if not cfg.output.overwrite:  # --overwrite: runrecord.owned_entries says
        check_foreign_config(RunDir(cfg.output.dir))
    if cfg.engine.workers != "auto" and (not config_mod.ranks_here(cfg) or cfg.engine.device == "cpu"):
        return cfg
    return config_mod.resolve_workers(cfg, visible_gpus(cfg))


def check_input(cfg: Config) -> None:
    """A local data.path (val_path, test_path) that matches nothing, or a table without the version or columns
    asked for, is one line before Spark or MLflow start: a typo costs no JVM start-up. prepare checks it again
    (etl/prepare.py); stores are check_stores'."""
    from torchloom import embedded
    from torchloom.etl.inputs import check_inputs, pin_tables

    check_inputs(cfg.data, embedded.data_path(cfg.data.path))
    pin_tables(cfg.data, embedded.data_path(cfg.data.path), local_only=True)  # prepare pins them again


def check_prepared(cfg: Config) -> None:
    """`train` on a local output.dir without prepared data: the one line read_manifest gives, before anything
    loads (a run on a store is checked when its working copy is staged)."""
    if not is_uri(cfg.output.dir):
        rd = RunDir(cfg.output.dir)
        if not (rd.data / "manifest.json").is_file():
            read_manifest(rd.data)


def check_output_dir(path: Path) -> None:
    """A local output.dir that cannot be made or written (a file on its path, a directory this user may not
    write) is one line before any stage starts, and nothing is created to find out."""
    fix = "pass another --output.dir"
    if path.exists() and not path.is_dir():
        raise UserError(f"output.dir {path}: is a file, not a directory; {fix}")
    nearest = path
    while not nearest.exists() and nearest.parent != nearest:  # a path under a file does not exist either
        nearest = nearest.parent
    if not nearest.is_dir():
        raise UserError(f"output.dir {path}: cannot be created, {nearest} is a file, not a directory; {fix}")
    if not os.access(nearest, os.W_OK | os.X_OK):
        made = "written" if nearest == path else f"created, {nearest} is not writable"
        raise UserError(f"output.dir {path}: cannot be {made} for this user; {fix} or make it writable")


def check_foreign_config(rd: RunDir) -> None:
    """Never write over a config.toml torchloom did not write (a Hugo site's, say), nor into a store's prefix
    that holds objects of someone else's: refused before any stage, from the store itself for a run on one.
    Once per run directory in a command (each stage that saves the config asks again)."""
    once("check_foreign_config", rd.location, lambda: _check_foreign_config(rd))


def _check_foreign_config(rd: RunDir) -> None:
    RunFiles(rd).check_own()


def check_untrained(cfg: Config) -> None:
    """prepare --overwrite into a run that was trained: its checkpoints (and model) would belong to data that is
    gone, and a later resume or export would take them; one line before Spark starts, nothing touched."""
    rd = RunDir(cfg.output.dir)
    if RunFiles(rd).holds(rd.checkpoints):
        raise UserError(f"output.dir {rd.where}: holds checkpoints trained on the data that prepare would replace;"
                        " start the whole run afresh (torchloom run --overwrite) or prepare into another"
                        " --output.dir")


def check_fresh(cfg: Config, files: RunFiles) -> None:
    """A fresh training removes the earlier one's checkpoints (train/checkpoint.clear_earlier): only with
    --overwrite, and only when they are all torchloom's (the run's ledger), else one line before anything starts."""
    from torchloom.ledger import deletable
    from torchloom.train import checkpoint

    rd = files.rd
    steps = files.stored_steps() if files.on_store else [s for s, _ in checkpoint.list_checkpoints(rd.checkpoints)]
    if not steps:
        return
    if not cfg.output.overwrite:
        shown = ", ".join(map(str, sorted(steps)[-3:]))
        more = "..." if len(steps) > 3 else ""
        raise UserError(f"output.dir {rd.where}: holds {len(steps)} checkpoint(s) of an earlier training (steps"
                        f" {more}{shown}), which a fresh training would delete; pass --resume to go on from the"
                        " latest, or --overwrite to train afresh")
    deletable(files.tree(), "output.dir", cfg.inputs(), under="checkpoints")


def check_trainable(cfg: Config) -> int | None:
    """Catch in the driver what would otherwise fail in every worker; returns the step train.resume
    resumes from (None: a fresh start)."""
    from torchloom import manifest as manifest_mod
    from torchloom.embedded import model_path
    from torchloom.model.build import check_model_dir
    from torchloom.train import checkpoint

    rd = RunDir(cfg.output.dir)
    files = RunFiles(rd)
    files.ensure(rd.manifest)  # the workers stream the shards from the store
    if cfg.train.resume == "latest":  # the newest intact checkpoint alone, hashed once (rank 0 finds it stamped)
        files.pull_checkpoints(intact=lambda p: checkpoint.damage(p) is None)
    m = manifest_mod.read(rd.data)
    check_model_dir(model_path(cfg.model.path))
    if m.split("train").rows < cfg.engine.workers:
        raise UserError(
            f"{m.root}: {m.split('train').rows} training rows for {cfg.engine.workers} workers;"
            " add data or lower engine.workers"
        )
    if not cfg.train.resume:
        check_fresh(cfg, files)
    # a path that is no checkpoint, or only damaged ones, fails here, once; rank 0 warns of what it skips
    path = checkpoint.resolve(cfg.train.resume, rd.checkpoints, warn=False)
    return None if path is None else int(checkpoint.read_meta(path)["step"])
