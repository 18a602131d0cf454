"""The checks before a stage starts: what cannot run on this machine, stores that do not answer, an output.dir that
cannot be written or holds someone else's files, inputs that match nothing, a run that cannot be trained. Each
failure is one line (a UserError), and nothing is written to find out.

Each check runs once per run: open_run checks the config and builds the command's Run (runs/run.py), which the CLI
hands to its stages; a check a stage asks again (the prefix is torchloom's, before config.toml is written) is
kept on that Run (Run.once), never in this module. A stage called from Python with a Config, or a Ray Tune
trial's own process, opens its own Run, checked the same way.
"""

from __future__ import annotations

from torchloom import config as config_mod
from torchloom.config import Config
from torchloom.errors import UserError
from torchloom.runs.run import Run
from torchloom.runs.rundir import RunDir
from torchloom.runs.runfiles import RunFiles
from torchloom.uri import is_uri, redact


def open_run(cfg: Config, files: RunFiles | None = None) -> Run:
    """The command's Run (runs/run.py), once every check below has passed: engine.workers auto counted on this machine,
    what cannot run here refused, the stores asked (for_this_machine). files: the run's, where the caller has them
    already (the CLI, which read the run's recorded config with them)."""
    run = Run(cfg, files if files is not None else RunFiles(RunDir(cfg.output.dir)))
    return run.but(cfg=for_this_machine(run))


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


def check_stores(cfg: Config, run: Run | None = None) -> None:
    """A run or data on a store: the store answers, the bucket exists and the credentials may read the data and
    write the run, said in one line before any stage starts (once per run: `run` keeps what passed)."""
    from torchloom.inputs.locate import check_reachable

    def writable(uri: str, key: str) -> None:
        if run is not None:
            check_writable(run)

    for key, uri, check in (("output.dir", cfg.output.dir, writable),
                            ("data.path", cfg.data.path, check_reachable),
                            ("data.val_path", cfg.data.val_path, check_reachable),
                            ("data.test_path", cfg.data.test_path, check_reachable)):
        if is_uri(uri) and redact(uri) != uri:
            raise UserError(f"{key} {redact(uri)}: holds credentials (user:password@ or a query string);"
                            " give them in the environment (AWS_*, GOOGLE_APPLICATION_CREDENTIALS or AZURE_STORAGE_*,"
                            " a profile, an instance role),"
                            " never in the URI, which is written to config.toml and logs")
        if is_uri(uri):
            if key.startswith("data.") and not cfg.prepare.spark_here:
                continue  # a Spark cluster reads it with its own connector and credentials
            check(uri, key)


def check_writable(run: Run) -> None:
    """The run's store answers and these credentials may write and delete there, or its local directory can be
    made and written (once per run)."""
    run.check_writable()


def for_this_machine(run: Run) -> Config:
    """run.cfg with engine.workers auto counted on this machine, and what cannot run here refused, before any
    stage starts (config/load.resolve_workers); a config already counted passes through. Stores are checked too,
    and a local output.dir that cannot be written, and a run directory holding someone else's files."""
    cfg = run.cfg
    check_stores(cfg, run)
    check_writable(run)  # a local directory too: it can be made and written
    if not cfg.output.overwrite:  # --overwrite: runrecord.owned_entries says
        check_foreign_config(run)
    if cfg.engine.workers != "auto" and (not config_mod.ranks_here(cfg) or cfg.engine.device == "cpu"):
        return cfg
    return config_mod.resolve_workers(cfg, visible_gpus(cfg))


def check_input(cfg: Config) -> None:
    """A local data.path (val_path, test_path) that matches nothing, or a table without the version or columns
    asked for, is one line before Spark or MLflow start: a typo costs no JVM start-up. prepare checks it again
    (etl/prepare.py); stores are check_stores'."""
    from torchloom import embedded
    from torchloom.inputs.locate import check_inputs, pin_tables

    check_inputs(cfg.data, embedded.data_path(cfg.data.path))
    pin_tables(cfg.data, embedded.data_path(cfg.data.path), local_only=True)  # prepare pins them again


def check_prepared(run: Run) -> None:
    """`train` on a local output.dir without prepared data: the one line read_manifest gives, before anything
    loads (a run on a store is checked when its working copy is staged)."""
    if not run.files.place.holds(run.rd.manifest):  # where the run lives: the store's, never this host's copy
        raise UserError(f"{run.rd.home(run.rd.data)}: no prepared data (manifest.json) here; run torchloom prepare"
                        " first")


def check_foreign_config(run: Run) -> None:
    """Never write over a config.toml torchloom did not write (a Hugo site's, say), nor into a store's prefix
    that holds objects of someone else's: refused before any stage, from the store itself for a run on one.
    Once per run (each stage that saves the config asks again)."""
    run.check_own()


def check_untrained(run: Run) -> None:
    """prepare --overwrite into a run that was trained: its checkpoints (and model) would belong to data that is
    gone, and a later resume or export would take them; one line before Spark starts, nothing touched."""
    rd = run.rd
    if run.files.place.holds(rd.checkpoints):
        raise UserError(f"output.dir {rd.where}: holds checkpoints trained on the data that prepare would replace;"
                        " start the whole run afresh (torchloom run --overwrite) or prepare into another"
                        " --output.dir")


def check_fresh(cfg: Config, files: RunFiles) -> None:
    """A fresh training over an earlier one's checkpoints: only with --overwrite (train/resume.check_fresh)."""
    from torchloom.train.resume import check_fresh as check

    check(files, cfg.train.resume, cfg.output.overwrite, cfg.inputs(), flags=("--resume", "--overwrite"))


def check_trainable(run: Run) -> int | None:
    """Catch in the driver what would otherwise fail in every worker; returns the step train.resume
    resumes from (None: a fresh start)."""
    from torchloom import manifest as manifest_mod
    from torchloom.embedded import model_path
    from torchloom.model.build import check_model_dir
    from torchloom.train import checkpoint

    cfg, files, rd = run.cfg, run.files, run.rd
    files.ensure(rd.manifest)  # the workers stream the shards from the store
    if cfg.train.resume == "latest":  # the newest intact checkpoint alone, hashed once (rank 0 finds it stamped)
        files.checkpoints.pull(intact=lambda p: checkpoint.damage(p) is None)
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
