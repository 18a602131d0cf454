"""The same training on the local, Spark and Ray engines: same weights, errors surfaced, kills survived.

Spark runs as `local-cluster[2,1,1024]`, so the workers are real executor tasks; Ray is a local
instance. CPU, fp32, one thread per worker on every engine: results are bit-identical.
"""

from __future__ import annotations

import os
import shutil

import pytest
from support.engine_reference import COMMON, assert_same_weights, reference

from torchloom.config import build
from torchloom.engines.common import TrainingFailed

pytest.importorskip("pyspark")
pytest.importorskip("ray")
pytestmark = pytest.mark.ray  # every test here: see tests/support/schedule.py

@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return reference(tmp_path_factory.mktemp("engines"))

# 1 round in CI; `-m soak` runs the other 9 of the 10
ROUNDS = [0, *(pytest.param(n, marks=pytest.mark.soak) for n in range(1, 10))]


@pytest.fixture
def fault(monkeypatch):
    def arm(spec: str) -> None:
        monkeypatch.setenv("TORCHLOOM_FAULT", spec)
    return arm


def run_on(engine: str, setup, name: str, *extra: str):
    rd = setup["root"] / name
    rd.mkdir()
    shutil.copytree(setup["data"], rd / "data")
    args = ["--output.dir", str(rd), "--model.path", setup["model"], "--engine.name", engine, *COMMON, *extra]
    if engine == "spark":  # decommission on, as a cluster that takes executors back with notice has it
        args += ["--prepare.spark_master", "local-cluster[2,1,1024]",
                 "--prepare.spark_conf", '{"spark.decommission.enabled" = "true"}']
    cfg = build(None, args)
    if engine == "spark":
        from torchloom.engines import spark

        return rd, spark.train(cfg, rd, quiet=True, spark=spark_session(cfg))
    from torchloom.engines import ray

    return rd, ray.train(cfg, rd, quiet=True)


_sessions: dict = {}


def spark_session(cfg):
    from torchloom.etl.session import get_spark

    active = _sessions.get("local-cluster")
    if active is None:
        from pyspark.sql import SparkSession

        # the suite's shared local[2] session cannot run executors: stop it and start a cluster
        current = SparkSession.getActiveSession()
        if current is not None and not current.sparkContext.master.startswith("local-cluster"):
            current.stop()
        active = _sessions["local-cluster"] = get_spark(cfg.prepare)
    return active


@pytest.fixture(scope="module", autouse=True)
def stop_sessions():
    yield
    if "local-cluster" in _sessions:
        _sessions.pop("local-cluster").stop()


def assert_rank_logs(rd) -> None:
    """Every rank's output reached the run's log files, once, without Ray Train's chatter."""
    assert (rd / "logs" / "rank-0.log").is_file() and (rd / "logs" / "rank-1.log").is_file()
    for rank in (0, 1):
        text = (rd / "logs" / f"rank-{rank}.log").read_text()
        assert "Reporting training result" not in text  # Ray Train's per-report INFO line (a dict per rank)
        # each rank says where it runs; workers at full CPU priority (Ray's default niceness is 15)
        assert f"rank {rank} of 2 on " in text and "1 torch thread" in text
        assert "niceness" not in text
        starts = [x for x in text.splitlines() if x.startswith(f"rank {rank} of 2 on ")]
        assert starts and len(starts) == len(set(starts))  # once per process: no line written twice


# CI proves the loss of a worker on these engines across hosts (tests/cluster/test_store.py loses the checkpointing
# host on Spark and Ray, test_multihost.py a Ray node) and the restart logic on the local engine (test_train.py)
@pytest.mark.soak
@pytest.mark.parametrize("engine", ["spark", "ray"])
def test_killed_worker_is_survived_and_weights_equal_the_local_engine(engine, setup, fault):
    # rank 1 is SIGKILLed mid-epoch at step 8, after the checkpoint at step 5
    fault("rank=1,step=8,kind=kill")
    rd, result = run_on(engine, setup, f"{engine}-kill", "--engine.max_restarts", "2")
    assert (rd / "logs" / "fault-fired-rank1-step8").exists()
    assert result.steps == 13 and result.resumed_from.endswith("step-5")
    assert_same_weights(setup["ref"] / "checkpoints" / "step-13", rd / "checkpoints" / "step-13")
    assert_rank_logs(rd)


@pytest.mark.parametrize("engine", ["spark", "ray"])
def test_an_exception_in_one_rank_is_the_error_and_is_not_restarted(engine, setup, fault):
    # Restarts are for lost processes: an error of a rank's own would happen again, so the job fails
    # at once, whatever engine.max_restarts allows.
    fault("rank=1,step=3,kind=raise")
    with pytest.raises(TrainingFailed) as err:
        run_on(engine, setup, f"{engine}-raise", "--engine.max_restarts", "1")
    text = str(err.value)
    assert "training failed on rank 1: InjectedFault: injected fault on rank 1 at step 3" in text
    assert "traceback of rank 1" in text
    rd = setup["root"] / f"{engine}-raise"
    logs = "".join(p.read_text() for p in (rd / "logs").glob("rank-*.log"))
    assert "resuming from the latest checkpoint" not in logs  # no attempt trained again
    # torchloom re-runs the workers itself, on both engines: not even a second start (no restart spent)
    assert not list((rd / "logs").glob("placement-*-start1.json"))


@pytest.mark.parametrize("engine", ["spark", "ray"])
def test_resume_on_another_engine_from_the_local_engines_checkpoint(engine, setup):
    # the local engine wrote step-5; this engine resumes from it and ends at the local run's weights
    ckpt = setup["ref"] / "checkpoints" / "step-5"
    rd, result = run_on(engine, setup, f"{engine}-from-local", "--train.resume", str(ckpt))
    assert result.resumed_from == str(ckpt) and result.steps == 13
    assert_same_weights(setup["ref"] / "checkpoints" / "step-13", rd / "checkpoints" / "step-13")
    assert_rank_logs(rd)


def test_missing_engine_gives_an_install_hint(monkeypatch, tmp_path):
    import subprocess
    import sys

    code = ("import sys; sys.modules['ray'] = None\n"
            "from torchloom.engines import ray as r\n"
            "from torchloom.config import build\n"
            "try:\n    r.train(build(None, []), '.')\nexcept Exception as e:\n    print(type(e).__name__, e)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"}).stdout
    assert "UserError ray is not installed: pip install 'ray[train,tune]>=2.40' 'optuna>=4.0'" in out


def test_a_local_ray_instance_that_cannot_start_is_one_line(tmp_path):
    import subprocess
    import sys

    blocked = tmp_path / "not-a-dir"
    blocked.write_text("")  # Ray's temp dir is a file: ray.init fails as it does on a host out of room
    code = ("import ray\nfrom torchloom.ray_instance import start_local_ray\n"
            f"try:\n    start_local_ray({str(blocked / 'ray')!r}, num_cpus=1, env_vars={{}})\n"
            "except Exception as e:\n    print(type(e).__name__, e)\nprint('initialized', ray.is_initialized())")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    lines = proc.stdout.splitlines()
    assert len(lines) == 2 and lines[1] == "initialized False", proc.stdout + proc.stderr[-2000:]
    assert lines[0].startswith(f"UserError ray: the local Ray instance in {blocked / 'ray'} did not start ("), lines
    assert "engine.ray_address" in lines[0]


def test_torchrun_on_the_worker_module_gives_the_same_weights(setup, tmp_path):
    import subprocess
    import sys

    rd = tmp_path / "torchrun"
    rd.mkdir()
    shutil.copytree(setup["data"], rd / "data")
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                    "-m", "torchloom.engines.torchrun", "--output.dir", str(rd), "--model.path", setup["model"],
                    *COMMON],
                   check=True, capture_output=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert_same_weights(setup["ref"] / "checkpoints" / "step-13", rd / "checkpoints" / "step-13")


def test_under_your_own_torchrun_a_ranks_error_is_not_trained_again(setup, tmp_path, fault):
    # torch elastic restarts on any failure; the restarted workers see that rank 1 failed of its own
    # accord and refuse in one line, without training again
    import subprocess
    import sys

    fault("rank=1,step=3,kind=raise")
    rd = tmp_path / "torchrun-raise"
    rd.mkdir()
    shutil.copytree(setup["data"], rd / "data")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "--max-restarts", "1", "-m", "torchloom.engines.torchrun", "--output.dir", str(rd),
                           "--model.path", setup["model"], "--engine.max_restarts", "1", *COMMON],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "InjectedFault: injected fault on rank 1 at step 3" in out, out[-3000:]
    refusals = [x for x in out.splitlines() if "not restarted: rank 1 failed with InjectedFault" in x]
    assert refusals and all(x.startswith("torchloom: rank ") for x in refusals), out[-3000:]
    assert "NotRestarted" not in out  # the refusal is a line, not a traceback
    assert "resuming from the latest checkpoint" not in out
    assert not list((rd / "checkpoints").glob("step-1[0-9]"))  # nothing trained past the fault


@pytest.mark.parametrize("round_", ROUNDS)
# Spark's rounds run under -m soak: the handler is the local engine's (tests/test_preemption.py) and CI proves Spark's
# way on from a notice across hosts (tests/cluster/test_multihost.py decommissions a worker: the run goes on when
# slots are back); Ray's SIGTERM watch (engines/ray_notice.py) is Ray's own, so its round 0 stays in CI
@pytest.mark.parametrize("engine", [pytest.param("spark", marks=pytest.mark.soak), "ray"])
def test_sigterm_to_a_random_worker_checkpoints_its_step_and_goes_on_to_the_local_weights(
        engine, round_, setup, fault):
    # The real signal to a Spark executor's or a Ray Train actor's training process at a random step: a notice of
    # preemption, not a lost process. Every rank stops after the same step with a checkpoint of it, the run goes
    # on from there to the local engine's weights, and engine.max_restarts 0 shows no restart was spent.
    import random

    rng = random.Random(f"{engine}-{round_}")
    rank, step = rng.randrange(2), rng.randrange(2, 12)
    fault(f"rank={rank},step={step},kind=term")
    rd, result = run_on(engine, setup, f"{engine}-term-{round_}", "--engine.max_restarts", "0",
                        "--train.keep_last", "20")
    [p] = result.preemptions
    # the notice reaches the loop at this step's end or the next's; the ranks agree on it a boundary later
    assert p["step"] in (step, step + 1, step + 2), (step, p)
    assert p["notice"].startswith(f"SIGTERM to rank {rank} on host ") and p["checkpoint_s"] >= 0, p
    assert p["resumed_from_step"] == p["step"] and p["workers"] == 2
    assert (rd / "checkpoints" / f"step-{p['step']}").is_dir()
    assert result.steps == 13 and result.resumed_from.endswith(f"step-{p['step']}")
    assert_same_weights(setup["ref"] / "checkpoints" / "step-13", rd / "checkpoints" / "step-13")
    assert not list((rd / "logs").glob("error-rank*.json"))


@pytest.mark.soak  # CI proves it across hosts: tests/cluster/test_multihost.py decommissions a worker by its signal
def test_spark_decommissioning_an_executor_is_a_notice_and_the_run_goes_on_to_the_local_weights(setup, fault):
    # Spark tells the driver, not the executor's Python processes, that an executor is being decommissioned (a
    # standalone worker leaving, a Kubernetes pod or YARN node taken back). Here the driver's scheduler backend
    # gets the message a master sends when a worker decommissions (tests/cluster does it through the worker
    # itself). torchloom's driver passes it on: every rank stops after one step with its checkpoint, and the run
    # goes on, when the slots are back, to the local engine's weights with engine.max_restarts 0.
    import json
    import random
    import threading
    import time

    fault("rank=0,step=1,kind=slow,sleep=0.8")  # time for the notice to travel while the workers train
    rd = setup["root"] / "spark-decommission"
    done, said = threading.Event(), []

    def decommission_at_step_3() -> None:
        try:
            decommission()
        except Exception as e:  # the test fails on it below
            said.append(repr(e))

    def decommission() -> None:
        metrics = rd / "metrics.jsonl"
        while not done.is_set():
            lines = metrics.read_text().splitlines() if metrics.is_file() else []
            if any(json.loads(x).get("kind") == "train" and json.loads(x)["step"] >= 3 for x in lines if x.strip()):
                break
            time.sleep(0.1)
        spark = _sessions["local-cluster"]
        sc = spark.sparkContext._jsc.sc()
        running = sorted(str(sc.taskScheduler().runningTasksByExecutors().keys().mkString(",")).split(","))
        executor = random.Random(29).choice(running)
        info = spark._jvm.org.apache.spark.scheduler.ExecutorDecommissionInfo(
            "spot instance reclaimed", spark._jvm.scala.Some("worker-host"))
        assert sc.schedulerBackend().decommissionExecutor(executor, info, False, False)

    thread = threading.Thread(target=decommission_at_step_3, daemon=True)
    thread.start()
    try:
        rd, result = run_on("spark", setup, "spark-decommission", "--engine.max_restarts", "0",
                            "--train.keep_last", "20", "--train.log_every", "1")
    finally:
        done.set()
        thread.join(timeout=10)
    assert not said, said
    [p] = result.preemptions
    assert p["notice"].startswith("Spark decommissions executor ") and "on host worker-host" in p["notice"], p
    assert 3 <= p["step"] < 13 and p["checkpoint_s"] >= 0 and p["resumed_from_step"] == p["step"], p
    assert result.steps == 13 and result.resumed_from.endswith(f"step-{p['step']}")
    assert_same_weights(setup["ref"] / "checkpoints" / "step-13", rd / "checkpoints" / "step-13")
    assert not list((rd / "logs").glob("error-rank*.json"))


SPARK_ABORT = ("An error occurred while calling o91.collect.\n: org.apache.spark.SparkException: Job aborted due to"
               " stage failure: Could not recover from a failed barrier ResultStage. Most recent failure reason: Stage"
               " failed because barrier task ResultTask(1, 0) finished unsuccessfully.\nExecutorLostFailure (executor 2"
               " exited unrelated to the running tasks) Reason: worker lost: Not receiving heartbeat for 15 seconds\n"
               "\tat org.apache.spark.scheduler.DAGScheduler.failJobAndIndependentStages(DAGScheduler.scala:2935)")


def test_an_attempt_spark_aborted_for_a_lost_executor_is_named_by_spark_s_reason(tmp_path, capsys):
    # Spark saw the executor lost and aborted the barrier stage before the ranks' heartbeats could name the lost
    # rank: the re-run line and the final error give Spark's reason, not "Py4JJavaError"
    from torchloom.engines.driver import rerun_or_raise
    from torchloom.runs.rundir import RunDir
    from torchloom.runs.runfiles import RunFiles

    class Py4JJavaError(Exception):
        pass

    rd = RunDir(tmp_path / "run")
    rerun_or_raise(RunFiles(rd), "launch", 0, 2, Py4JJavaError(SPARK_ABORT), "Spark (spark://a:7077)")
    said = capsys.readouterr().err
    assert ("attempt 1 of 2 failed (Spark lost executor 2: worker lost: Not receiving heartbeat for 15 seconds);"
            " re-running the workers") in said, said
    with pytest.raises(TrainingFailed, match=r"^training on Spark \(spark://a:7077\) failed: Spark lost executor 2:"
                                             r" worker lost: Not receiving heartbeat for 15 seconds$"):
        rerun_or_raise(RunFiles(rd), "launch", 1, 2, Py4JJavaError(SPARK_ABORT), "Spark (spark://a:7077)")
