"""torchloom across hosts: torchrun multi-node, a Spark standalone cluster and a Ray cluster, each on
hosts made of network namespaces (cluster/netns.py), each training to the local engine's weights.

Every process, the driver included, runs inside the namespaces; the hosts share the filesystem (the
run directory), as hosts on NFS would. CPU, fp32, one thread per rank: results are bit-identical.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from support.engine_reference import COMMON as ENGINE_COMMON
from support.engine_reference import LAST, assert_same_weights, new_run, reference
from support.spark_jvm import JVM_ENV  # the suite's JVM options: the cluster's JVMs keep them

from cluster.netns import Cluster, Host, skip_without_namespaces
from torchloom.config.schema import TrainConfig
from torchloom.data.buckets import use_length_buckets
from torchloom.data.loader import ShardedLoader
from torchloom.manifest import read as read_manifest

pytestmark = pytest.mark.cluster  # see tests/support/schedule.py
skip_without_namespaces()

COMMON = [*ENGINE_COMMON, "--tracking.enabled", "false"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return reference(tmp_path_factory.mktemp("multihost"))


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without anything that would pin Spark or Ray to the root namespace's setup."""
    env = {k: v for k, v in os.environ.items() if k in JVM_ENV
           or not k.startswith(("SPARK_", "PYSPARK_", "RAY_", "MASTER_", "TORCHELASTIC_", "TORCHLOOM_"))}
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", GLOO_SOCKET_IFNAME="eth0",
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


# Ray's GCS marks a node that stopped answering dead after 5 failed health checks, each with a 10 s timeout and 3 s
# apart by default (about a minute); on the head of these clusters, 3 s and 1 s: about 20 s.
RAY_QUICK_DEATH = {"RAY_health_check_timeout_ms": "3000", "RAY_health_check_period_ms": "1000"}


def rank_hosts(text: str) -> dict[int, str]:
    """{rank: host} from each rank's first log line ("rank R of W on HOST (pid P): ...")."""
    return {int(r): h for r, h in re.findall(r"rank (\d+) of \d+ on (\S+) \(pid", text)}


def wait_for(what: str, check, timeout: float, logs: list[Path]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.5)
    tails = "\n".join(f"--- {p}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-15:])
                      for p in logs if p.is_file())
    raise AssertionError(f"{what}: not within {timeout:.0f} s\n{tails}")


def torchloom(host: Host, args: list[str], env: dict, timeout: float, log: Path,
              expect: int = 0) -> subprocess.CompletedProcess:
    proc = host.run([sys.executable, "-m", "torchloom", *args], env=env, timeout=timeout)
    log.write_text(proc.stdout + proc.stderr)
    where = f"torchloom {args[0]} on {host.name}: exit {proc.returncode}"
    assert proc.returncode == expect, f"{where}\n{proc.stderr[-4000:]}"
    return proc


def without_exit_barrier_race(text: str) -> str:
    """The text less torch elastic's report of its known exit-barrier race (pytorch/pytorch#69520): an agent
    that hosts the store may leave as soon as the barrier is complete, and another agent, still waiting for
    the answer, logs the lost connection (a C++ warning with its frames, then an ERROR with a traceback).
    The job has ended well by then; every other traceback or failure stays in the text."""
    if "Error waiting on exit barrier" not in text:
        return text
    # torch names its file relative to sys.path, or in full where the environment is reached through a link
    agent = re.compile(r"^E\d{4} [\d:.]+ \d+ (?:\S*/)?torch/distributed/elastic/agent/server/api\.py:\d+\] ")
    kept, in_warning = [], False
    for line in text.splitlines():
        if agent.match(line):
            continue
        if "failed on SocketImpl" in line and "Failed to recv" in line:
            in_warning = True  # the C++ warning: its frames and a blank line follow
            continue
        if in_warning and (not line.strip() or line.startswith(("Exception raised from", "frame #", "<omitting"))):
            continue
        in_warning = False
        kept.append(line)
    return "\n".join(kept)


def private_run(setup, tmp_path: Path, hosts: list[Host]) -> Path:
    """A prepared run directory that these hosts do not see (storage only the driver's host mounts)."""
    private = tmp_path / "private"
    private.mkdir()
    for h in hosts:
        h.hidden.append(str(private))
    return new_run(private, setup["data"], "run")


# the collective timeout of a run the hosts cannot see: an error that came from a collective would come after it
HIDDEN_TIMEOUT = ["--engine.collective_timeout_s", "600"]


def assert_not_visible_error(proc: subprocess.CompletedProcess, rd: Path, hosts: list[Host], seconds: float):
    errors = [line for line in proc.stderr.splitlines() if line.startswith("torchloom: error:")]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(errors) == 1 and "not visible on host" in errors[0] and str(rd) in errors[0], proc.stderr[-3000:]
    assert any(h.name in errors[0] for h in hosts)
    assert seconds < 300  # not a collective's timeout: the command sets it to 600 s (HIDDEN_TIMEOUT)


def torchrun_argv(rd: Path, setup, endpoint: str, run_id: str, restarts: int, *extra: str) -> list[str]:
    """The multi-node command of docs/engines.md, one node per host."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{endpoint}:29400", "--rdzv-id", run_id,
            "--max-restarts", str(restarts), "-m", "torchloom.engines.torchrun", "--output.dir", str(rd),
            "--model.path", setup["model"], *COMMON, *extra]


@pytest.mark.parametrize("round_", [0, pytest.param(1, marks=pytest.mark.soak)])
def test_torchrun_sigterm_to_a_worker_on_one_host_checkpoints_and_goes_on_to_the_local_weights(setup, tmp_path,
                                                                                              round_):
    # Nodes on b and c. The worker on c gets SIGTERM (its host is being taken back) at a random step: both ranks
    # stop after the same step with a checkpoint of it and exit 75; torchrun on each host starts its worker
    # again, they meet in a new rendezvous round, go on from that checkpoint and end at the local weights,
    # with engine.max_restarts 0 untouched.
    import random

    step = random.Random(2929 + round_).randrange(2, 12)
    rd = new_run(setup["root"], setup["data"], f"torchrun-term-{round_}")
    with Cluster(["b", "c"]) as hosts:
        b, c = hosts["b"], hosts["c"]
        env = clean_env(TMPDIR=str(tmp_path), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
                        TORCHLOOM_FAULT=f"host={c.name},step={step},kind=term")
        argv = torchrun_argv(rd, setup, b.name, f"tl-term-{round_}", 2, "--engine.max_restarts", "0",
                             "--train.keep_last", "20")
        logs = {h.name: tmp_path / f"{h.name}.log" for h in (b, c)}
        procs = [h.popen(argv, log=logs[h.name], env=env) for h in (b, c)]
        for p in procs:
            p.wait(timeout=420)
        text = {h: p.read_text(errors="replace") for h, p in logs.items()}
        assert all(p.returncode == 0 for p in procs), text[b.name][-3000:] + text[c.name][-3000:]
    (on_c,) = rank_hosts(text[c.name])
    said = [x for x in (text[b.name] + text[c.name]).splitlines() if "torchloom: train: preempted at step" in x]
    assert len(said) == 1 and f"(notice: SIGTERM to rank {on_c} on host {c.name})" in said[0], said
    stopped_at = int(said[0].split("preempted at step ")[1].split()[0])
    # the ranks agree on a notice one step boundary after it reached one of them (train/distributed.AgreedLater)
    assert stopped_at in (step, step + 1, step + 2) and (rd / "checkpoints" / f"step-{stopped_at}").is_dir()
    assert "after a preemption: resuming from the latest checkpoint" in text[b.name] + text[c.name]
    assert "Traceback" not in without_exit_barrier_race(text[b.name] + text[c.name])
    records = [json.loads(x) for x in (rd / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [r["step"] for r in records if r.get("kind") == "preempted"] == [stopped_at]
    assert_same_weights(setup["ref"] / "checkpoints" / LAST, rd / "checkpoints" / LAST)


def write_csv(path: Path) -> Path:
    """120 usable rows of 3 topics, plus one without text and one without a label (set aside)."""
    import csv

    words = {"sport": "match goal team", "tech": "chip software data", "money": "bank price market"}
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["body", "topic"])
        for label, vocab in words.items():
            for i in range(40):
                w.writerow([f"{vocab} number {i} " + " ".join(reversed(vocab.split())), label])
        w.writerow(["", "sport"])
        w.writerow(["a text without a label", ""])
    return path


def spark_class() -> str:
    import pyspark

    return str(Path(pyspark.__file__).parent / "bin" / "spark-class")


def start_ray(hosts: list[Host], head: Host, env: dict, temps: dict, cpus: int = 1) -> None:
    env = {**env, "PATH": f"{Path(sys.executable).parent}:{env['PATH']}"}
    out = head.run(["ray", "start", "--head", "--node-ip-address", head.address, "--port", "6379", "--num-cpus", "0",
                    "--temp-dir", temps[head.name], "--disable-usage-stats"], env={**env, **RAY_QUICK_DEATH},
                   timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    for h in hosts:
        out = h.run(["ray", "start", "--address", f"{head.address}:6379", "--node-ip-address", h.address,
                     "--num-cpus", str(cpus), "--temp-dir", temps[h.name]], env=env, timeout=120)
        assert out.returncode == 0, out.stderr[-3000:]


@contextlib.contextmanager
def ray_cluster_driver(setup, tmp_path: Path, rd: Path, fault: str, *extra: str):
    """A Ray head on a (no CPUs) and nodes on b and c, token auth on, and `torchloom train` of two workers with
    engine.min_workers 1 started on a with this fault; yields (head, nodes, env, driver, its log)."""
    with Cluster(["a", "b", "c"]) as hosts:
        a, nodes = hosts["a"], [hosts["b"], hosts["c"]]
        env = clean_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32), RAY_USAGE_STATS_ENABLED="0",
                        TORCHLOOM_FAULT=fault)
        temps = {h.name: tempfile.mkdtemp(prefix="tlray") for h in (a, *nodes)}
        try:
            start_ray(nodes, a, env, temps)
            args = ["train", "--engine.name", "ray", "--engine.ray_address", f"{a.address}:6379",
                    "--engine.cpus_per_worker", "1", "--output.dir", str(rd), "--model.path", setup["model"], *COMMON,
                    "--engine.min_workers", "1", "--train.trace_rows", "true", *extra]
            log = tmp_path / "driver.log"
            driver = a.popen([sys.executable, "-m", "torchloom", *args], log=log, env=env)
            yield a, nodes, env, driver, log
        finally:
            for t in temps.values():
                shutil.rmtree(t, ignore_errors=True)


# CI's Ray host loss (~100 s); the store's (tests/cluster/test_store.py, ~240 s) runs under -m soak
def test_ray_with_min_workers_goes_on_on_the_survivor_after_losing_a_host(setup, tmp_path):
    # Two nodes, two workers, engine.min_workers 1. Rank 1 stops answering at step 8 (after the step-5
    # checkpoint); then its whole host goes: every process SIGKILLed, the link down. torchloom re-runs
    # the workers on what the alive nodes hold, one worker on the survivor, which resumes step 5 with
    # the same global batches as row ids (train.trace_rows) as two uninterrupted workers would have had.
    # (Not the same weights: dropout masks are drawn per worker.)
    rd = new_run(setup["root"], setup["data"], "ray-loss")
    with ray_cluster_driver(setup, tmp_path, rd, "rank=1,step=8,kind=hang", "--engine.collective_timeout_s", "15",
                            "--engine.max_restarts", "3") as (_, nodes, _, driver, log):
        wait_for("rank 1 to stop at step 8", lambda: (rd / "logs" / "fault-fired-rank1-step8").exists(), 240,
                 [log])
        lost_name = rank_hosts((rd / "logs" / "rank-1.log").read_text())[1]
        lost = next(h for h in nodes if h.name == lost_name)
        lost.link_down()  # first: no FIN or RST reaches the others, as when a host loses power
        lost.kill_all()
        lost_at = time.monotonic()
        wait_for("the survivor to notice", lambda: (rd / "logs" / "error-rank0.json").exists(), 60, [log])
        noticed_s = time.monotonic() - lost_at
        driver.wait(timeout=420)
        text = log.read_text(errors="replace")
        assert driver.returncode == 0, text[-4000:]
    assert noticed_s < 60  # the collective timeout (15 s here), not the 30-minute default
    assert f"rank 1 on host {lost_name} stopped answering (lost); resuming from the latest checkpoint" in text, \
        text[-3000:]
    assert "going on with 1 (engine.workers 2, engine.min_workers 1)" in text, text[-3000:]
    result = json.loads((rd / "train_result.json").read_text())
    assert (result["world_size"], result["resumed_world_size"], result["resumed_at_step"]) == (1, 2, 5)
    assert "resumed at step 5 on 1 workers (the checkpoint's run had 2)" in text
    survivor = next(h for h in nodes if h.name != lost_name)
    assert set(rank_hosts((rd / "logs" / "rank-0.log").read_text()).values()) == {survivor.name}
    assert_two_workers_batches_after(rd, 5)
    assert (rd / "checkpoints" / LAST).is_dir()


def assert_two_workers_batches_after(rd: Path, resumed_at: int) -> None:
    """One worker's steps after resuming at `resumed_at` (to 13) took the global batches, as row ids
    (train.trace_rows), that two uninterrupted workers would have had."""
    records = [json.loads(line) for line in (rd / "logs" / "rows-rank0.jsonl").read_text().splitlines()]
    restart = max(i for i, r in enumerate(records) if r["step"] == resumed_at + 1)
    after = {r["step"]: r["rows"] for r in records[restart:]}
    manifest = read_manifest(rd / "data")
    buckets = use_length_buckets(TrainConfig().length_bucketing, manifest)  # the run's default
    two = [list(ShardedLoader(manifest, "train", rank=r, world_size=2, batch_size=4, global_batch=8, seed=42,
                              shuffle_buffer=4096, length_bucketing=buckets)) for r in range(2)]
    expected = {i + 1: two[0][i]["index"].tolist() + two[1][i]["index"].tolist() for i in range(13)}
    assert sorted(after) == list(range(resumed_at + 1, 14))
    assert after == {s: expected[s] for s in range(resumed_at + 1, 14)}


def last_step(rd: Path) -> int:
    if not (rd / "metrics.jsonl").is_file():
        return 0
    records = [json.loads(x) for x in (rd / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return max((r["step"] for r in records if r.get("kind") == "train"), default=0)


def ray_node_id(head: Host, node: Host, env: dict) -> str:
    code = ("import ray; ray.init(address='{0}:6379', logging_level='ERROR');"
            "print(next(n['NodeID'] for n in ray.nodes() if n['Alive'] and n['NodeManagerAddress'] == '{1}'))")
    out = head.run([sys.executable, "-c", code.format(head.address, node.address)], env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


def test_ray_drain_node_is_a_notice_and_training_goes_on_on_the_survivor(setup, tmp_path):
    # Two nodes, two workers, engine.min_workers 1, engine.max_restarts 0. Mid-run, `ray drain-node` (what an
    # autoscaler does to a spot node it is told will go) drains rank 1's node: both ranks stop after the same
    # step with a checkpoint of it, and torchloom goes on on the node that is not draining, with the same
    # global batches, spending no restart.
    rd = new_run(setup["root"], setup["data"], "ray-drain")
    # time to drain mid-run: rank 0's steps take 1.5 s more
    with ray_cluster_driver(setup, tmp_path, rd, "rank=0,step=1,kind=slow,sleep=1.5", "--engine.max_restarts", "0",
                            "--train.log_every", "1") as (a, nodes, env, driver, log):
        wait_for("step 2", lambda: last_step(rd) >= 2, 240, [log])
        drained_name = rank_hosts((rd / "logs" / "rank-1.log").read_text())[1]
        drained = next(h for h in nodes if h.name == drained_name)
        # --node-id given: without it, this Ray's CLI starts an instance of its own and drains that
        out = drained.run(["ray", "drain-node", "--address", f"{a.address}:6379", "--node-id",
                           ray_node_id(a, drained, env), "--reason", "DRAIN_NODE_REASON_PREEMPTION",
                           "--reason-message", "spot instance reclaimed", "--deadline-remaining-seconds", "300"],
                          env={**env, "PATH": f"{Path(sys.executable).parent}:{env['PATH']}"}, timeout=60)
        assert out.returncode == 0, out.stderr[-3000:]
        driver.wait(timeout=420)
        text = log.read_text(errors="replace")
        assert driver.returncode == 0, text[-4000:]
    result = json.loads((rd / "train_result.json").read_text())
    [p] = result["preemptions"]
    assert p["notice"].startswith("Ray drains node ") and f"on host {drained_name}" in p["notice"], p
    assert p["checkpoint_s"] >= 0 and p["resumed_from_step"] == p["step"] and p["workers"] == 1, p
    assert (result["world_size"], result["resumed_world_size"], result["resumed_at_step"]) == (1, 2, p["step"])
    line = f"preempted at step {p['step']} (notice: Ray drains node "
    assert line in text and "resuming on 1 workers" in text, text[-3000:]
    assert "attempt 1 of 1 failed" not in text and "stopped answering" not in text
    survivor = next(h for h in nodes if h.name != drained_name)
    assert set(rank_hosts((rd / "logs" / "rank-0.log").read_text()).values()) >= {survivor.name}
    assert_two_workers_batches_after(rd, p["step"])


def java_pid(host: Host, main_class: str) -> int:
    for pid in host.pids():
        try:
            if main_class in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                return pid
        except OSError:
            continue
    raise AssertionError(f"no {main_class} on {host.name}")


def test_spark_worker_decommissioned_by_its_signal_is_a_notice_and_training_goes_on_when_slots_are_back(
        setup, tmp_path):
    # Spark's own mechanism: with spark.decommission.enabled, SIGPWR to a standalone Worker (what Spark's
    # scripts and Kubernetes use) decommissions it and its executors; the driver hears of it, the executor's
    # Python processes do not. torchloom's driver passes the notice on: both ranks stop after one step with its
    # checkpoint. A replacement worker host joins, the next attempt waits for its slot, and the run ends at the
    # local weights with engine.max_restarts 0.
    import signal

    rd = new_run(setup["root"], setup["data"], "spark-decommission")
    with Cluster(["a", "b", "c", "d"]) as hosts:
        a, workers, spare = hosts["a"], [hosts["b"], hosts["c"]], hosts["d"]
        env = clean_env(SPARK_LOG_DIR=str(tmp_path), SPARK_NO_DAEMONIZE="1", TMPDIR=str(tmp_path),
                        SPARK_WORKER_OPTS="-Dspark.decommission.enabled=true")
        master_log = tmp_path / "master.log"
        a.popen([spark_class(), "org.apache.spark.deploy.master.Master", "--host", a.name, "--port", "7077",
                 "--webui-port", "8080"], log=master_log, env=env)

        def worker(h: Host) -> None:
            h.popen([spark_class(), "org.apache.spark.deploy.worker.Worker", f"spark://{a.name}:7077",
                     "--host", h.name, "--cores", "1", "--memory", "1500m", "--webui-port", "8081",
                     "--work-dir", str(tmp_path / f"work-{h.name}")], log=tmp_path / f"worker-{h.name}.log", env=env)

        for h in workers:
            worker(h)
        wait_for("two Spark workers registered with the master",
                 lambda: master_log.is_file() and master_log.read_text().count("Registering worker") >= 2,
                 120, [master_log])
        log = tmp_path / "driver.log"
        driver = a.popen([sys.executable, "-m", "torchloom", "train", "--engine.name", "spark",
                          "--prepare.spark_master", f"spark://{a.name}:7077",
                          "--prepare.spark_conf", '{"spark.decommission.enabled" = "true"}',
                          "--output.dir", str(rd), "--model.path", setup["model"], *COMMON,
                          "--engine.max_restarts", "0", "--train.keep_last", "20", "--train.log_every", "1"],
                         log=log, env={**env, "TORCHLOOM_FAULT": "rank=0,step=1,kind=slow,sleep=1.0"})
        wait_for("step 3", lambda: last_step(rd) >= 3, 240, [log])
        gone_name = rank_hosts((rd / "logs" / "rank-1.log").read_text())[1]
        gone = next(h for h in workers if h.name == gone_name)
        os.kill(java_pid(gone, "org.apache.spark.deploy.worker.Worker"), signal.SIGPWR)
        wait_for("the notice", lambda: any((rd / "logs").glob("notice-*.json")), 60, [log, master_log])
        worker(spare)  # the capacity comes back on another host
        driver.wait(timeout=480)
        text = log.read_text(errors="replace")
        assert driver.returncode == 0, text[-4000:]
    said = [x for x in text.splitlines() if "torchloom: train: preempted at step" in x and "resuming on" in x]
    assert len(said) == 1 and "(notice: Spark decommissions executor " in said[0], text[-3000:]
    stopped_at = int(said[0].split("preempted at step ")[1].split()[0])
    assert (rd / "checkpoints" / f"step-{stopped_at}").is_dir()
    text = without_exit_barrier_race(text)
    assert "failed" not in text and "Traceback" not in text, text[-3000:]
    result = json.loads((rd / "train_result.json").read_text())
    assert result["resumed_at_step"] == stopped_at and result["steps"] == 13
    assert set(rank_hosts("".join(p.read_text() for p in rd.glob("logs/rank-*.log"))).values()) >= {spare.name}
    assert_same_weights(setup["ref"] / "checkpoints" / LAST, rd / "checkpoints" / LAST)
