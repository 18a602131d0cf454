"""The Spark engine: the same workers, launched by pyspark's TorchDistributor.

On a `local[...]` master the processes run on the driver (`local_mode=True`); on any other master
(`local-cluster[...]`, `spark://`, `yarn`, `k8s://`) each worker is a task of a barrier stage on an
executor. torchloom must be importable on the executors (installed there, as it is in one venv).
Spark re-runs a failed barrier stage from scratch; torchloom instead re-runs it up to
`engine.max_restarts` times, and the new workers resume from the latest complete checkpoint.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import time
from pathlib import Path

from torchloom.config import Config, to_dict
from torchloom.engines.common import not_visible, replace_engine
from torchloom.engines.driver import Attempt, attempts
from torchloom.engines.worker import enter_worker_env, run_worker, worker_env
from torchloom.errors import UserError, missing_extra
from torchloom.etl.session import conf_value, get_spark, is_local_master
from torchloom.jsonio import write_json
from torchloom.machine import gpu_names
from torchloom.poller import Poller
from torchloom.runs.rundir import RunDir
from torchloom.runs.runfiles import RunFiles
from torchloom.train.result import TrainResult


def _entry(cfg_dict: dict, run_dir: str, launch_id: str, env: dict, launched_at: float,
           attempt: int | None = None) -> None:
    # Executors are long-lived processes started with whatever environment the session had, not the
    # driver's at launch: the job brings its workers' environment along.
    enter_worker_env(env)
    # Output goes to the run's log files: Spark would otherwise print it twice on local[N] and keep
    # it in executor work dirs on a cluster. The driver tails the files.
    run_worker(cfg_dict, run_dir, launch_id, capture=True, launched_at=launched_at, attempt=attempt)


def decommissioning(spark) -> list[tuple[str, str]]:
    """(executor id, host) of the executors that run a task now and that Spark is decommissioning (a
    standalone worker told to leave, a Kubernetes pod or YARN node being taken back, with
    spark.decommission.enabled). [] where this process cannot ask (Spark Connect: no SparkContext)."""
    from py4j.protocol import Py4JError
    from pyspark.errors import PySparkException

    try:
        scheduler = spark.sparkContext._jsc.sc().taskScheduler()
        running = [x for x in str(scheduler.runningTasksByExecutors().keys().mkString(",")).split(",") if x]
        found = []
        for executor in running:
            state = scheduler.getExecutorDecommissionState(executor)
            if state.isDefined():
                host = state.get().workerHost()
                found.append((executor, str(host.get()) if host.isDefined() else "?"))
        return found
    except (AttributeError, Py4JError, PySparkException):
        return []


SLOTS_BACK_WAIT_S = 900.0  # after a preemption: how long the next attempt waits for the slots to come back


def wait_for_slots(spark, cfg: Config, master: str) -> None:
    """After a preemption: the next attempt's barrier stage needs all of its slots at once, and Spark fails it
    at once without them, so wait (up to SLOTS_BACK_WAIT_S) for executors to replace the ones taken back."""
    tasks = cfg.engine.workers
    slots = barrier_slots(spark)
    if slots is None or slots >= tasks:
        return
    print(f"torchloom: train: Spark ({master}) has {slots} of the {tasks} barrier slots the workers need; waiting"
          f" up to {SLOTS_BACK_WAIT_S / 60:.0f} min for executors to come back", file=sys.stderr, flush=True)
    slots = registered_slots(spark, tasks, SLOTS_BACK_WAIT_S)
    if slots is not None and slots < tasks:
        raise UserError(f"engine.workers {tasks}: Spark ({master}) still has {slots} barrier slots"
                        f" {SLOTS_BACK_WAIT_S / 60:.0f} min after a preemption; run the same command with --resume"
                        " once the cluster has its executors back")


class DecommissionWatch(Poller):
    """The driver's side of Spark's notice: an executor that runs a worker is being decommissioned (its
    Python processes get no signal from Spark), so the driver writes the attempt's notice file, which the
    workers watch (worker.watch_notice_file)."""

    def __init__(self, spark, files: RunFiles, path: Path, told: set[str], every_s: float = 2.0):
        super().__init__(every_s, "torchloom-spark-decommission")
        self.spark, self.files, self.path, self.given = spark, files, path, False
        self.told = told  # executors whose decommission an earlier attempt was told of

    def poll(self) -> None:
        if self.given:
            return
        found = [(e, h) for e, h in decommissioning(self.spark) if e not in self.told]
        if not found:
            return
        executor, host = found[0]
        self.told.update(e for e, _ in found)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_json(self.path, {"notice": f"Spark decommissions executor {executor} on host {host}",
                               "time": time.time()}, indent=None)
        self.files.push(self.path, quiet=True)
        self.given = True

    def last_poll(self) -> None:  # the attempt is over: a notice now is for nobody
        pass


def wants_gpu(cfg: Config, spark) -> bool:
    if cfg.engine.device == "cpu":
        return False
    key = ("spark.driver.resource.gpu.amount" if is_local_master(conf_value(spark, "spark.master")) else
        "spark.task.resource.gpu.amount")
    has = float(conf_value(spark, key, "0") or 0) > 0
    local = is_local_master(conf_value(spark, "spark.master"))
    if cfg.engine.device == "auto" and not has and local and (gpus := len(gpu_names())):
        print(f"torchloom: warning: train: this machine has {gpus} GPU(s) but Spark gives its tasks none ({key} is"
              f" unset), so the workers train on CPUs; pass --prepare.spark_conf '{{\"{key}\" = \"{gpus}\"}}' to"
              " train on them, or --engine.device cpu to say CPUs", file=sys.stderr, flush=True)
    if cfg.engine.device == "cuda" and not has:
        raise UserError(f"engine.device cuda: Spark has no GPUs configured ({key} is unset); set it with"
                        f" --prepare.spark_conf '{{\"{key}\" = \"1\"}}' or use engine.device cpu")
    return has


SLOT_WAIT_S = 30.0  # how long executors may take to register before too few barrier slots is an error


def barrier_slots(spark) -> int | None:
    """Tasks a barrier stage may run at once, as Spark's own check counts them (executor cores over
    spark.task.cpus, and GPUs); None where this process cannot ask (Spark Connect: no SparkContext)."""
    from py4j.protocol import Py4JError
    from pyspark.errors import PySparkException

    try:
        sc = spark.sparkContext._jsc.sc()
        return int(sc.maxNumConcurrentTasks(sc.resourceProfileManager().defaultResourceProfile()))
    except (AttributeError, Py4JError, PySparkException):
        return None


def planned_slots(master: str, spark) -> int | None:
    """The slots a local-cluster[N,C,M] master will have once its executors registered; None for others."""
    m = re.fullmatch(r"local-cluster\[\s*(\d+)\s*,\s*(\d+)\s*,\s*\d+\s*\]", master.strip())
    if not m:
        return None
    return int(m.group(1)) * (int(m.group(2)) // max(1, int(conf_value(spark, "spark.task.cpus", "1") or 1)))


def registered_slots(spark, tasks: int, wait_s: float = SLOT_WAIT_S) -> int | None:
    """The barrier slots of the executors registered so far, asked again for up to `wait_s` while fewer
    than `tasks` (executors register for a while after the session starts)."""
    deadline = time.monotonic() + wait_s
    while True:
        slots = barrier_slots(spark)
        if slots is None or slots >= tasks or time.monotonic() >= deadline:
            return slots
        time.sleep(0.5)


def check_slots(cfg: Config, spark=None):
    """Before anything is written: a barrier stage runs all of its tasks at once, and with fewer slots than
    workers Spark retries it for minutes before it fails. Returns the session (started if `spark` is None)."""
    spark = spark or get_spark(cfg.prepare)
    master = conf_value(spark, "spark.master", cfg.prepare.spark_master)
    if is_local_master(master):  # TorchDistributor's local mode: processes on the driver, no barrier stage
        return spark
    gpus = int(float(conf_value(spark, "spark.task.resource.gpu.amount", "0") or 0)) if wants_gpu(cfg, spark) else 0
    tasks = cfg.engine.workers // gpus if gpus > 1 else cfg.engine.workers  # as TorchDistributor counts them
    slots = planned_slots(master, spark)
    if slots is None or slots >= tasks:
        slots = registered_slots(spark, tasks)
    if slots is not None and slots < tasks:
        raise UserError(f"engine.workers {cfg.engine.workers}: Spark ({master}) has {slots} barrier slot"
                        f"{'' if slots == 1 else 's'} (executor cores / spark.task.cpus) and the workers need"
                        f" {tasks} at once; lower --engine.workers to {max(slots, 1) * max(gpus, 1)} or give Spark"
                        " more executors or cores")
    return spark


def _sees(location: str):
    def visible() -> bool:  # in the executor: its host's own files of the run (its staging copy is its own)
        files = RunFiles(RunDir(location))
        return files.reachable(files.rd.manifest)  # a run on a store: the executor's host must reach it

    def check(batches):
        import socket

        import pandas as pd

        for _ in batches:
            yield pd.DataFrame({"host": [socket.gethostname()], "visible": [visible()]})
    return check


def check_executors_see(spark, files: RunFiles, workers: int) -> None:
    """Before the launch: a barrier stage of `workers` tasks (placed as the training's will be) reports
    each task's host and whether it sees the run directory. A host without it fails the launch in
    seconds with one line, where the training processes would fail one by one, retried."""
    rows = (spark.range(0, workers, 1, workers)
            .mapInPandas(_sees(files.rd.location), schema="host string, visible boolean", barrier=True).collect())
    blind = sorted({r.host for r in rows if not r.visible})
    if blind:
        raise not_visible(files, blind)


def train(cfg: Config, run: RunFiles | str | Path, quiet: bool = False, spark=None) -> TrainResult:
    """Train with cfg.engine.workers processes launched by TorchDistributor; returns rank 0's result."""
    try:
        from pyspark.ml.torch.distributor import TorchDistributor
    except ImportError:
        raise missing_extra("pyspark", "spark") from None
    files = RunFiles.of(run)  # the command's Run's files (a path: a Python caller's run directory)
    rd = files.rd
    spark = spark or get_spark(cfg.prepare)
    # No SparkContext from here on: under Spark Connect this process is a client without one.
    master = conf_value(spark, "spark.master", cfg.prepare.spark_master)
    local_mode = is_local_master(master)
    use_gpu = wants_gpu(cfg, spark)
    if not use_gpu:
        cfg = replace_engine(cfg, device="cpu")  # a host's GPUs that Spark did not give the task stay unused
    if not cfg.engine.threads_per_worker and not local_mode:
        # an executor task owns spark.task.cpus cores, whatever the host has
        cfg = replace_engine(cfg, threads_per_worker=int(conf_value(spark, "spark.task.cpus", "1") or 1))
    # torchrun prints a banner unless OMP_NUM_THREADS is set; our workers set their own thread count.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if not local_mode:
        check_slots(cfg, spark)
        check_executors_see(spark, files, cfg.engine.workers)

    told: set[str] = set()  # executors being decommissioned that a notice named already

    def launch_once(attempt: Attempt) -> None:
        distributor = TorchDistributor(num_processes=cfg.engine.workers, local_mode=local_mode, use_gpu=use_gpu)
        distributor.logger.setLevel(logging.WARNING)  # its constructor sets INFO: "Started distributed ..."
        if local_mode:  # the workers run beside the driver: no executor to decommission
            distributor.run(_entry, to_dict(cfg), rd.location, attempt.launch_id, worker_env(), attempt.launched_at)
            return
        if attempt.number:
            wait_for_slots(spark, cfg, master)
        with DecommissionWatch(spark, files, rd.notice_file(attempt.launch_id, attempt.number), told):
            distributor.run(_entry, to_dict(cfg), rd.location, attempt.launch_id, worker_env(), attempt.launched_at,
                            attempt.number)

    # Spark wraps a worker's failure in its own error; the run directory's error files hold the real one
    return attempts(files, cfg, launch_once, f"Spark ({master})", quiet=quiet)
