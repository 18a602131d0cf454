"""The Ray engine: the same workers, launched by Ray Train's TorchTrainer.

`engine.ray_address` "" starts a local Ray instance for the job (and stops it after); "auto" or
"ray://host:10001" joins a cluster. Ray Train sets up the process group; metrics reach Ray through
`ray.train.report` at every evaluation, on every rank. Ray itself restarts nothing
(FailureConfig(max_failures=0)): Ray restarts on any failure, a rank's own error too, which would
only happen again. torchloom re-runs `fit()` up to engine.max_restarts times after a lost process
(a killed worker, a lost node), and the new workers resume from torchloom's latest complete
checkpoint in the run directory, which must be on storage every node sees.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
from pathlib import Path

from torchloom.config import Config, to_dict, valid_world_sizes
from torchloom.engines import ray_notice
from torchloom.engines.common import lost_ranks, replace_engine
from torchloom.engines.driver import Attempt, attempts
from torchloom.engines.worker import run_worker, worker_env
from torchloom.errors import UserError, first_line, missing_extra
from torchloom.machine import usable_cores
from torchloom.model.env import model_env
from torchloom.private import private_dir
from torchloom.ray_instance import start_local_ray
from torchloom.runs.rundir import RunDir
from torchloom.runs.runfiles import RunFiles
from torchloom.train.reporter import Reporter
from torchloom.train.result import TrainResult


class RayReporter(Reporter):
    """Ray's report must be called the same number of times on every rank: the loop does so."""

    def report(self, metrics: dict, checkpoint_dir: str | None) -> None:
        import ray.train

        ray.train.report({k: v for k, v in metrics.items() if isinstance(v, (int, float))})


def _entry(config: dict) -> None:
    import logging

    import ray.train

    logging.getLogger("ray.train").setLevel(logging.WARNING)  # one INFO line per report and rank otherwise
    try:  # Train v2 logs "Reporting training result ..." per rank on a logger named by its file path
        from ray.train.v2._internal.execution import context as train_context

        logging.getLogger(train_context.__file__).setLevel(logging.WARNING)
    except ImportError:
        pass
    if ray.train.get_context().get_local_rank() == 0:
        ray_notice.watch_drain()  # one worker per node asks whether Ray is draining it
    device = "cpu"
    if config["use_gpu"]:  # the GPU Ray assigned this worker, not one picked by LOCAL_RANK
        import ray.train.torch  # noqa: F811

        device = str(ray.train.torch.get_device())
    run_worker(config["cfg"], config["run_dir"], config["launch_id"], engine_reporter=RayReporter(), capture=True,
               launched_at=config["launched_at"], device=device)


# Set in every task and actor of a Ray instance torchloom started (e.g. the trials of a local Tune study).
OWN_INSTANCE = "TORCHLOOM_OWN_RAY_INSTANCE"


def unreachable(address: str, timeout: float = 5.0) -> str | None:
    """Why nothing answers a TCP connection at a host:port Ray address (a GCS, or `ray://` a Ray Client
    server), or None: it answers, or the address is one Ray resolves itself ("auto", another scheme)."""
    rest = address[len("ray://"):] if address.startswith("ray://") else address
    host, sep, port = rest.rpartition(":")
    if not sep or "/" in rest or not port.isdigit() or not host:
        return None
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except TimeoutError:
        return f"{host}:{port}: no answer in {timeout:g} s"
    except OSError as e:
        return f"{host}:{port}: {e.strerror or type(e).__name__}"
    return None


def init_ray(address: str) -> bool:
    """Connect to (or start) Ray; returns True when this call started a local instance.

    A cluster is joined with whatever authentication it runs (its token in ~/.ray/auth_token,
    RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN, as Ray reads them). A local instance is ray_instance's:
    127.0.0.1 only, Ray's token authentication on, nothing written to ~/.ray.
    """
    import ray

    if ray.is_initialized():
        return False
    if address:
        def nobody_there(why: str) -> UserError:
            return UserError(f"engine.ray_address {address}: no Ray cluster answers there ({why[:90]});"
                             " start one (`ray start --head`), fix the address, or leave engine.ray_address empty"
                             " for a local instance")

        why = unreachable(address)
        if why:  # Ray itself retries an address where nothing listens for minutes, warning every 5 s
            raise nobody_there(why)
        try:
            ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
        except (ConnectionError, TimeoutError, ValueError) as e:
            raise nobody_there(first_line(e)) from None
        return False
    # Unix socket paths are limited to 107 bytes, so Ray's session dir cannot live in a deep run dir.
    temp = private_dir(f"torchloom-ray-{os.getuid()}")
    start_local_ray(temp, num_cpus=usable_cores(), env_vars={**model_env(), OWN_INSTANCE: "1"},
                    env=worker_malloc(), log_to_driver=False)
    return True


def in_tune_trial() -> bool:
    """True inside a Ray Tune trial (torchloom tune): the workers' reports must reach Tune too."""
    try:
        from ray.tune.trainable.trainable_fn_utils import _in_tune_session
    except ImportError:
        return False
    return _in_tune_session()


def scaling(cfg: Config, started_local: bool):
    import ray
    from ray.train import ScalingConfig

    cluster_gpus = ray.cluster_resources().get("GPU", 0)
    if cfg.engine.device == "cuda" and cluster_gpus < cfg.engine.workers:
        raise UserError(f"engine.device cuda: the Ray cluster has {cluster_gpus:g} GPUs for {cfg.engine.workers}"
                        " workers; lower engine.workers or use engine.device cpu")
    use_gpu = cfg.engine.device == "cuda" or (cfg.engine.device == "auto" and cluster_gpus >= cfg.engine.workers)
    if cfg.engine.device == "auto" and 0 < cluster_gpus < cfg.engine.workers:
        print(f"torchloom: warning: train: the Ray cluster has {cluster_gpus:g} GPU(s) for {cfg.engine.workers}"
              f" workers, so they train on CPUs; pass --engine.workers {int(cluster_gpus)} (one per GPU) to train on"
              " the GPUs, or --engine.device cpu to say CPUs", file=sys.stderr, flush=True)
    cpus = cfg.engine.cpus_per_worker
    if not cpus:
        # On a local instance split the cores, leaving a sliver for Ray's own controller actor.
        cpus = 0.99 * usable_cores() / cfg.engine.workers if started_local else 1.0
    return ScalingConfig(num_workers=cfg.engine.workers, use_gpu=use_gpu, resources_per_worker={"CPU": cpus})


def placeable_workers(scaling_config) -> int:
    """How many workers of this shape the cluster's alive nodes hold."""
    import ray

    cpu = float(scaling_config.resources_per_worker.get("CPU", 1) or 0)
    draining = ray_notice.draining_nodes()  # alive, but being taken back: nothing new is placed there
    total = 0
    for node in ray.nodes():
        if not node.get("Alive") or node.get("NodeID") in draining:
            continue
        res = node.get("Resources", {})
        n = int(res.get("CPU", 0) // cpu + 1e-9) if cpu else 1 << 30
        if scaling_config.use_gpu:
            n = min(n, int(res.get("GPU", 0)))
        total += n
    return total


NODE_DEATH_WAIT_S = 90.0  # how long a re-run waits for Ray to mark a lost rank's node dead


def answers(node: dict, timeout_s: float = 2.0) -> bool:
    """The node's raylet accepts a TCP connection: its host is up (a process on it may still be lost)."""
    try:
        with socket.create_connection((node["NodeManagerAddress"], int(node["NodeManagerPort"])), timeout=timeout_s):
            return True
    except (OSError, KeyError, ValueError):
        return False


def wait_for_lost_nodes(lost: list[dict]) -> None:
    """Before a re-run after lost ranks (engine.min_workers waits in shrink_to_alive instead): Ray marks a node
    dead only after missed heartbeats, and until then places workers of the next attempt there, which fail
    again and spend the restart budget. A lost rank's node whose raylet does not answer is gone with its
    host: wait (up to NODE_DEATH_WAIT_S) for Ray to mark it dead. A lost process on a host that answers is
    re-run at once."""
    import ray

    hosts = {p.get("host") for p in lost}
    gone = [n for n in ray.nodes() if n.get("Alive") and n.get("NodeManagerHostname") in hosts and not answers(n)]
    if not gone:
        return
    names = ", ".join(sorted({n["NodeManagerHostname"] for n in gone}))
    print(f"torchloom: train: the Ray node on {names} does not answer; waiting for Ray to mark it dead before"
          " re-running the workers", file=sys.stderr, flush=True)
    deadline = time.monotonic() + NODE_DEATH_WAIT_S
    while gone and time.monotonic() < deadline:
        time.sleep(1.0)
        alive = {n.get("NodeID") for n in ray.nodes() if n.get("Alive")}
        gone = [n for n in gone if n.get("NodeID") in alive]


def shrink_to_alive(cfg: Config, scaling_config, lost: int = 0):
    """Before a re-run (engine.min_workers set): as many workers as the alive nodes place, within the
    allowed sizes. The workers resume the latest checkpoint on the new count with the same global
    batches. `lost` ranks stopped answering: Ray marks a dead node only after missed heartbeats, so
    wait (up to NODE_DEATH_WAIT_S) for the capacity to drop by them; a rank that hung on a host that
    lives on leaves the capacity as it was, and the re-run, after that wait, uses it."""
    from ray.train import ScalingConfig

    sizes = valid_world_sizes(cfg)
    fits = placeable_workers(scaling_config)
    deadline = time.monotonic() + NODE_DEATH_WAIT_S
    while lost and fits > scaling_config.num_workers - lost and time.monotonic() < deadline:
        time.sleep(1.0)
        fits = placeable_workers(scaling_config)
    workers = next((w for w in sizes if w <= fits), sizes[-1])
    if workers == scaling_config.num_workers:
        return cfg, scaling_config
    print(f"torchloom: train: the alive Ray nodes that are not draining place {fits} workers; going on with {workers}"
          f" (engine.workers {cfg.engine.workers}, engine.min_workers {cfg.engine.min_workers})",
          file=sys.stderr, flush=True)
    return replace_engine(cfg, workers=workers), ScalingConfig(
        num_workers=workers, use_gpu=scaling_config.use_gpu, resources_per_worker=scaling_config.resources_per_worker)


def worker_priority(started_local: bool) -> dict:
    """Environment that starts the train workers at normal CPU priority on a Ray instance of our own.

    Ray starts every worker process at niceness 15, below its own daemons (dashboard, log monitor,
    GCS, raylet and the agents, all at 0), so each of their wake-ups preempts a training step; in
    DDP the other ranks then wait for that rank at the next all-reduce. On a local instance that
    torchloom started for this job the workers are the job, so they run at 0 like the rest (the way
    Ray's own job supervisor does). On a shared cluster Ray's default stays.
    """
    own = started_local or os.environ.get(OWN_INSTANCE) == "1"  # or inside a trial of our own instance
    return {"RAY_worker_niceness": "0"} if own else {}


def worker_malloc() -> dict:
    """Environment that gives each Ray process a single glibc malloc arena (MALLOC_ARENA_MAX=1).

    Ray Train runs the training function in a thread of the worker actor rather than its main
    thread, so its allocations go to a per-thread arena, unlike local and Spark workers; Ray's
    many-threaded daemons likewise spread over many arenas. Together with the workers' niceness
    (worker_priority), one arena brought torchloom on Ray level with its local engine's steady state in
    `benchmarks/engines.py` (docs/benchmarks.md); which process gains most is not pinned down. A value in
    torchloom's own environment wins.
    """
    return {"MALLOC_ARENA_MAX": os.environ.get("MALLOC_ARENA_MAX", "1")}


def tune_callbacks() -> list:
    if not in_tune_trial():
        return []
    from ray.tune.integration.ray_train import TuneReportCallback

    return [TuneReportCallback()]  # rank 0's eval metrics to the trial, for the scheduler (ASHA)


def failure_config():
    """Ray restarts nothing: not after a failure (torchloom re-runs after a lost process only), and not
    after a preemption (torchloom's workers stop at one step with a checkpoint, and torchloom goes on)."""
    import dataclasses

    from ray.train import FailureConfig

    names = {f.name for f in dataclasses.fields(FailureConfig)}
    preemptions = {"max_preemption_failures": 0} if "max_preemption_failures" in names else {}
    return FailureConfig(max_failures=0, **preemptions)


def trainer(cfg: Config, rd: RunDir, attempt: Attempt, scaling_config, started_local: bool):
    from ray.train import RunConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    return TorchTrainer(
        _entry,
        torch_config=TorchConfig(timeout_s=int(cfg.engine.collective_timeout_s)),  # Ray makes the group
        train_loop_config={"cfg": to_dict(cfg), "run_dir": rd.location, "launch_id": attempt.launch_id,
                           "use_gpu": scaling_config.use_gpu, "launched_at": attempt.launched_at},
        scaling_config=scaling_config,
        run_config=RunConfig(
            # a run name per attempt: Ray would take a run of the same name for one to continue
            name=f"torchloom-{attempt.launch_id}-{attempt.number}", storage_path=str(rd.ray_storage),
            failure_config=failure_config(),  # torchloom restarts, only after a lost process
            callbacks=tune_callbacks(),
            worker_runtime_env={"env_vars": {
                **worker_env(),
                **worker_priority(started_local),
                **worker_malloc(),
                **ray_notice.setup_hook_env(),  # SIGTERM to a worker is a notice of preemption
                # Train v2 sends each print to its logger as well, and so to our rank log a second time
                "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
            }},
        ),
    )


def train(cfg: Config, run: RunFiles | str | Path, quiet: bool = False) -> TrainResult:
    """Train with cfg.engine.workers Ray Train workers; returns rank 0's result."""
    try:
        import ray
        import ray.train.torch  # noqa: F401
    except ImportError:
        raise missing_extra("ray", "ray") from None

    files = RunFiles.of(run)  # the command's Run's files (a path: a Python caller's run directory)
    rd = files.rd
    started_local = init_ray(cfg.engine.ray_address)
    scaling_config = scaling(cfg, started_local)
    if not cfg.engine.threads_per_worker:
        # torch threads = the CPUs Ray gives each worker (the host's core count would oversubscribe)
        cfg = replace_engine(cfg, threads_per_worker=max(1, int(scaling_config.resources_per_worker["CPU"] + 0.01)))

    def launch_once(attempt: Attempt) -> None:
        nonlocal cfg, scaling_config
        if attempt.number:
            lost = lost_ranks(files, attempt.launch_id, attempt.number - 1)
            if cfg.engine.min_workers:
                cfg, scaling_config = shrink_to_alive(cfg, scaling_config, len(lost))
            elif lost:
                wait_for_lost_nodes(lost)
        trainer(cfg, rd, attempt, scaling_config, started_local).fit()

    def resize() -> int:  # after a preemption: a draining node places nothing, so go on on what is left
        nonlocal cfg, scaling_config
        if cfg.engine.min_workers:
            cfg, scaling_config = shrink_to_alive(cfg, scaling_config)
        return cfg.engine.workers

    try:
        # Ray wraps a worker's failure in its own error; the run directory's error files hold the real one
        return attempts(files, cfg, launch_once, "Ray", quiet=quiet, resize=resize)
    finally:
        if started_local:
            ray.shutdown()
