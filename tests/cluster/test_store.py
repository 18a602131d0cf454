"""Hosts that share nothing but an S3 store (issue 28): Ray (head + 3 nodes), Spark standalone (3
worker hosts) and torchrun (2 nodes, one of them lost and replaced), the run on s3:// served by a real S3 server
(moto's) on a host of its own. No host sees another's files: each has a private cache (its staging copy of
the run), the others' are hidden, and so are the input CSV and the reference run. Each engine's job
prepares the CSV from the store, trains, loses a host in the middle and resumes from the store, and
exports to the store; its prepared data, final weights and exported model must be the local engine's on
a local directory, bit for bit, read back from the store.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import time
from pathlib import Path

import pytest
from support.engine_reference import assert_same_weights

from cluster.netns import Cluster, skip_without_namespaces
from cluster.s3_scripts import with_bucket
from cluster.test_multihost import (
    COMMON,
    HIDDEN_TIMEOUT,
    RAY_QUICK_DEATH,
    assert_not_visible_error,
    clean_env,
    private_run,
    rank_hosts,
    torchloom,
    torchrun_argv,
    without_exit_barrier_race,
)

pytestmark = pytest.mark.cluster  # see tests/support/schedule.py
pytest.importorskip("moto")
skip_without_namespaces()

BUCKET = "tl-cluster"
RUN = f"s3://{BUCKET}/runs/torchrun"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "cluster-key", "AWS_SECRET_ACCESS_KEY": "cluster-secret",
               "AWS_DEFAULT_REGION": "us-east-1"}

# Run on the store's host: make the bucket, upload the input CSV.
UPLOAD = with_bucket("storage.upload(sys.argv[3], sys.argv[4])")
DOWNLOAD = """
import sys
from torchloom.store import storage
storage.pull_tree(sys.argv[1], sys.argv[2])
"""


# prepare's settings on every engine and in the reference: three shards per split, row groups of 16 rows
PREPARE = ["--data.text_column", "body", "--data.label_column", "topic", "--prepare.partitions", "3",
           "--prepare.rows_per_group", "16", "--eval.baseline", "false", "--tracking.enabled", "false"]
INPUT = f"s3://{BUCKET}/input/texts.csv"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """{root, model, csv, data, ref, last}: the tiny model, the CSV every job prepares from the store, and the
    local engine's whole job on local disk (prepare, train, export) that every cluster job must end at."""
    from cluster.test_multihost import write_csv
    from torchloom.model.tiny import write_tiny_model

    root = tmp_path_factory.mktemp("store")
    model = write_tiny_model(root / "tiny")
    csv = write_csv(root / "texts.csv")
    ref = root / "ref"
    for args in (["prepare", "--data.path", str(csv), *PREPARE], ["train", *COMMON], ["export"]):
        done = torchloom_here([*args, "--output.dir", str(ref), "--model.path", model], root)
        assert done.returncode == 0, done.stderr[-3000:]
    last = max((p for p in (ref / "checkpoints").glob("step-*")), key=lambda p: int(p.name.split("-")[1])).name
    return {"root": root, "model": model, "csv": csv, "data": ref / "data", "ref": ref, "last": last}
def store_hosts(hosts, setup, tmp_path: Path, workers: list, run: str) -> tuple[dict, dict, Path]:
    """The S3 server on host s with the input CSV uploaded; each host a private cache, the others' and the
    reference (the CSV included) hidden from the workers. Returns (env for all, caches by host, the model dir
    every host has)."""
    s = hosts["s"]
    model = tmp_path / "model"
    shutil.copytree(setup["model"], model)
    caches = {h.name: tmp_path / f"cache-{h.name}" for h in hosts.hosts.values()}
    for p in caches.values():
        p.mkdir()
    for h in workers:
        h.hidden += [str(setup["root"]), *(str(p) for name, p in caches.items() if name != h.name)]
    endpoint = f"http://{s.name}:5000"
    env = clean_env(TMPDIR=str(tmp_path), AWS_ENDPOINT_URL=endpoint, **CREDENTIALS)
    s.popen([sys.executable, "-m", "moto.server", "-H", "0.0.0.0", "-p", "5000"], log=tmp_path / "s3.log", env=env)
    deadline = time.monotonic() + 60
    while True:
        up = s.run([sys.executable, "-c", UPLOAD, endpoint, BUCKET, str(setup["csv"]), INPUT],
                   env={**env, "TORCHLOOM_CACHE": str(caches[s.name])}, timeout=60)
        if up.returncode == 0:
            return env, caches, model
        assert time.monotonic() < deadline, up.stderr[-2000:]
        time.sleep(1)


def from_store(s, env: dict, caches: dict, uri: str, dest: Path) -> Path:
    """Download a prefix of the store, on the store's host (the test process is outside the namespaces)."""
    got = s.run([sys.executable, "-c", DOWNLOAD, uri, str(dest)], env={**env, "TORCHLOOM_CACHE": str(caches[s.name])},
                timeout=120)
    assert got.returncode == 0, got.stderr[-2000:]
    return dest


def assert_the_local_job(setup, s, env: dict, caches: dict, run: str, tmp_path: Path) -> None:
    """The job on the store ended where the local engine's on local disk did: the same prepared data, final
    weights and exported model, read back from the store."""
    back = from_store(s, env, caches, f"{run}/data", tmp_path / "back-data")
    ours, theirs = (json.loads((d / "manifest.json").read_text()) for d in (back, setup["data"]))
    assert ours["fingerprint"] == theirs["fingerprint"] and ours["splits"] == theirs["splits"]
    assert ours["inputs"]["path"] == INPUT  # named as given, also where a local copy was read
    assert_same_weights(setup["ref"] / "checkpoints" / setup["last"],
                        from_store(s, env, caches, f"{run}/checkpoints/{setup['last']}", tmp_path / "back"))
    model = from_store(s, env, caches, f"{run}/model", tmp_path / "back-model")
    assert_same_weights(setup["ref"] / "model", model)
    for name in ("config.json", "tokenizer.json"):
        assert (model / name).read_bytes() == (setup["ref"] / "model" / name).read_bytes(), name


def prepare_from_store(host, run: str, env: dict, caches: dict, model: Path, tmp_path: Path, *extra: str) -> str:
    """`torchloom prepare` on `host` of the CSV on the store into the run on the store; returns what it said."""
    said = torchloom(host, ["prepare", "--data.path", INPUT, "--output.dir", run, "--model.path", str(model),
                            *PREPARE, *extra], {**env, "TORCHLOOM_CACHE": str(caches[host.name])}, 300,
                     tmp_path / f"prepare-{host.name}.log")
    return said.stdout + said.stderr


def export_to_store(host, run: str, env: dict, caches: dict, model: Path, tmp_path: Path) -> None:
    """`torchloom export` on `host`, from the checkpoints of the run on the store to its model/ on the store."""
    torchloom(host, ["export", "--output.dir", run, "--model.path", str(model), "--tracking.enabled", "false"],
              {**env, "TORCHLOOM_CACHE": str(caches[host.name])}, 180, tmp_path / f"export-{host.name}.log")


def placement_hosts(logs: Path) -> set[str]:
    """The hosts the ranks ran on, from the placement files they uploaded."""
    return {json.loads(p.read_text())["host"] for p in logs.glob("placement-*.json")}


def torchloom_here(args: list[str], tmp_path: Path):
    """torchloom in this process's host (outside the namespaces), for a reference that needs no cluster."""
    import subprocess

    env = clean_env(TMPDIR=str(tmp_path), TORCHLOOM_CACHE=str(tmp_path / "cache-here"))
    return subprocess.run([sys.executable, "-m", "torchloom", *args], env=env, capture_output=True, text=True,
                          timeout=300)


def lost_rank_host(workers: list, caches: dict, rank: int, step: int):
    """The worker host whose cache holds the fault marker of `rank` at `step` (None before it fired)."""
    return next((h for h in workers if any(caches[h.name].rglob(f"fault-fired-rank{rank}-step{step}"))), None)


def cut_off(host) -> None:
    host.link_down()  # first: no FIN or RST reaches the others, as when a host loses power
    host.kill_all()


def lose_rank0_host_midway(a, workers: list, argv: list[str], env: dict, caches: dict, s, run: str, tmp_path: Path):
    """Start `torchloom` on a with rank 0 stopping at step 8 (after the step-5 checkpoint reached the store),
    cut rank 0's host off, and let the job finish; returns (the lost host, the driver's output, the logs read
    back from the store)."""
    from cluster.test_multihost import wait_for

    log = tmp_path / "driver.log"
    driver = a.popen([sys.executable, "-m", "torchloom", *argv, "--output.dir", run, *COMMON,
                      "--engine.collective_timeout_s", "15", "--engine.max_restarts", "3"], log=log,
                     env={**env, "TORCHLOOM_CACHE": str(caches[a.name]), "TORCHLOOM_FAULT": "rank=0,step=8,kind=hang"})
    wait_for("rank 0 to stop at step 8", lambda: lost_rank_host(workers, caches, 0, 8) is not None, 240, [log])
    lost = lost_rank_host(workers, caches, 0, 8)
    cut_off(lost)
    driver.wait(timeout=480)
    text = log.read_text(errors="replace")
    assert driver.returncode == 0, text[-4000:]
    return lost, text, from_store(s, env, caches, f"{run}/logs", tmp_path / "logs")


def test_ray_on_the_store_prepares_survives_the_loss_of_the_checkpointing_host_and_exports_the_local_model(
        setup, tmp_path):
    # Head on a (no CPUs), nodes on b, c and d (one worker slot each) for two workers, no shared directory.
    # The driver on the head prepares the CSV from the store with the embedded local Spark (no S3 connector).
    # Rank 0, the rank that writes and uploads the checkpoints, stops answering at step 8 (after the step-5
    # checkpoint reached the store); then its host is cut off. torchloom re-runs both workers on the two nodes
    # left: neither has a checkpoint in its cache, so rank 0 resumes step 5 from the store. A survivor exports.
    import secrets
    import tempfile

    run = f"{RUN}-ray"
    with Cluster(["s", "a", "b", "c", "d"]) as hosts:
        s, a = hosts["s"], hosts["a"]
        nodes = [hosts[n] for n in "bcd"]
        env, caches, model = store_hosts(hosts, setup, tmp_path, [a, *nodes], run)
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32), RAY_USAGE_STATS_ENABLED="0",
                   PATH=f"{Path(sys.executable).parent}:{env['PATH']}")
        temps = {h.name: tempfile.mkdtemp(prefix="tlray") for h in (a, *nodes)}
        hidden_rd = private_run(setup, tmp_path, nodes)  # a directory only the driver's host sees
        try:
            for h in (a, *nodes):  # each node's workers inherit its environment: its own cache
                start = ["ray", "start", "--node-ip-address", h.address, "--temp-dir", temps[h.name]]
                start += (["--head", "--port", "6379", "--num-cpus", "0", "--disable-usage-stats"] if h is a
                          else ["--address", f"{a.address}:6379", "--num-cpus", "1"])
                quick = RAY_QUICK_DEATH if h is a else {}
                out = h.run(start, env={**env, **quick, "TORCHLOOM_CACHE": str(caches[h.name])}, timeout=120)
                assert out.returncode == 0, out.stderr[-3000:]
            # a run on a local directory the nodes do not see (no shared file system): one line, at once
            started = time.monotonic()
            hidden = torchloom(a, ["train", "--output.dir", str(hidden_rd), "--engine.name", "ray",
                                   "--engine.ray_address", f"{a.address}:6379", "--engine.cpus_per_worker", "1",
                                   "--model.path", str(model), *COMMON, *HIDDEN_TIMEOUT],
                               {**env, "TORCHLOOM_CACHE": str(caches[a.name])}, 300, tmp_path / "driver-hidden.log",
                               expect=2)
            assert_not_visible_error(hidden, hidden_rd, nodes, time.monotonic() - started)
            said = prepare_from_store(a, run, env, caches, model, tmp_path)
            lost, text, logs = lose_rank0_host_midway(
                a, nodes, ["train", "--engine.name", "ray", "--engine.ray_address", f"{a.address}:6379",
                           "--engine.cpus_per_worker", "1", "--model.path", str(model)], env, caches, s, run, tmp_path)
            survivors = [h for h in nodes if h is not lost]
            export_to_store(survivors[0], run, env, caches, model, tmp_path)
            assert_the_local_job(setup, s, env, caches, run, tmp_path)
        finally:
            for t in temps.values():
                shutil.rmtree(t, ignore_errors=True)
    assert f"prepare: reading {INPUT} from the store" in said, said[-3000:]
    # the driver names the lost rank from the beats the ranks uploaded, waits for Ray to mark its node dead,
    # and the one re-run (no restart wasted on the dead node) resumes from the store
    assert f"attempt 1 of 4 failed (rank 0 on host {lost.name} stopped answering (lost))" in text, text[-3000:]
    # (Ray, with the cluster's quicker health checks, may have marked it dead before the driver asks)
    assert (f"the Ray node on {lost.name} does not answer; waiting for Ray" in text
            or "has been marked dead because the detector has missed too many heartbeats" in text), text[-3000:]
    assert "attempt 2 of 4 failed" not in text, text[-3000:]
    assert f"restart 1: rank 0 on host {lost.name} stopped answering (lost); resuming from the latest checkpoint in" \
           f" {run}/checkpoints" in (logs / "rank-0.log").read_text()
    assert placement_hosts(logs) == {h.name for h in nodes}  # the head has no CPUs; the third node took over
    assert any(any(caches[h.name].rglob("step-5/meta.json")) for h in survivors)  # taken from the store


def test_spark_standalone_on_the_store_prepares_survives_the_loss_of_the_checkpointing_host_and_exports_the_local_model(
        setup, tmp_path):
    # Master and driver on a, three worker hosts (b, c, d) for two ranks, no shared directory. Prepare runs on
    # the executors, from the CSV on the store and for the run on the store, with no Hadoop connector. Rank 0
    # (it writes and uploads the checkpoints) stops answering at step 8, after the step-5 checkpoint reached
    # the store; its host is cut off. The survivor's collective times out, the barrier stage fails, torchloom
    # re-runs it on the executors left, and rank 0, on a host whose cache has no checkpoint, resumes step 5
    # from the store. The driver's host exports.
    from cluster.test_multihost import spark_class, wait_for

    run = f"{RUN}-spark"
    with Cluster(["s", "a", "b", "c", "d"]) as hosts:
        s, a = hosts["s"], hosts["a"]
        workers = [hosts[n] for n in "bcd"]
        env, caches, model = store_hosts(hosts, setup, tmp_path, [a, *workers], run)
        env.update(SPARK_LOG_DIR=str(tmp_path), SPARK_NO_DAEMONIZE="1", SPARK_MASTER_OPTS="-Dspark.worker.timeout=15")
        hidden_rd = private_run(setup, tmp_path, workers)  # a directory only the driver's host sees
        master_log = tmp_path / "master.log"
        a.popen([spark_class(), "org.apache.spark.deploy.master.Master", "--host", a.name, "--port", "7077",
                 "--webui-port", "8080"], log=master_log, env=env)
        for h in workers:  # executors inherit their worker's environment: its own cache
            h.popen([spark_class(), "org.apache.spark.deploy.worker.Worker", f"spark://{a.name}:7077",
                     "--host", h.name, "--cores", "1", "--memory", "1500m", "--webui-port", "8081",
                     "--work-dir", str(tmp_path / f"work-{h.name}")], log=tmp_path / f"worker-{h.name}.log",
                    env={**env, "TORCHLOOM_CACHE": str(caches[h.name])})
        wait_for("three Spark workers registered with the master",
                 lambda: master_log.is_file() and master_log.read_text().count("Registering worker") >= 3,
                 120, [master_log])
        master = ["--prepare.spark_master", f"spark://{a.name}:7077"]
        # a run on a local directory the executors' hosts do not see: one line naming a host and the path, at once
        started = time.monotonic()
        hidden = torchloom(a, ["train", "--output.dir", str(hidden_rd), "--engine.name", "spark", *master,
                               "--model.path", str(model), *COMMON, *HIDDEN_TIMEOUT],
                           {**env, "TORCHLOOM_CACHE": str(caches[a.name])}, 300, tmp_path / "driver-hidden.log",
                           expect=2)
        assert_not_visible_error(hidden, hidden_rd, workers, time.monotonic() - started)
        # the tasks stream the CSV from the store (inputs/store_read.py) and write their rows through it
        # (etl/store_write.py)
        said = prepare_from_store(a, run, env, caches, model, tmp_path, *master,
                                  "--prepare.spark_conf", '{"spark.executor.memory" = "1g"}')
        conf = ('{"spark.network.timeout" = "20s", "spark.network.timeoutInterval" = "5s",'
                ' "spark.executor.heartbeatInterval" = "4s"}')
        lost, text, logs = lose_rank0_host_midway(
            a, workers, ["train", "--engine.name", "spark", *master, "--prepare.spark_conf", conf,
                         "--model.path", str(model)], env, caches, s, run, tmp_path)
        export_to_store(a, run, env, caches, model, tmp_path)
        assert_the_local_job(setup, s, env, caches, run, tmp_path)
    prepared = tmp_path / "back-data"  # the run's data/, as assert_the_local_job read it back
    assert f"reading {INPUT} (csv) by the tasks with pyarrow" in said, said[-3000:]
    manifest = json.loads((prepared / "manifest.json").read_text())
    assert manifest["counts"]["rows_read"] == 122 and len(manifest["splits"]["train"]["shards"]) == 3
    assert not any(p.name.startswith(".spark-write") for p in prepared.rglob("*"))
    for r in (0, 1):  # every rank's output reached the driver's terminal, and the store
        assert f"[rank{r}] rank {r} of 2 on" in text and (logs / f"rank-{r}.log").is_file(), text[-3000:]
    # Three correct accounts, by which side notices first (the workers' line below names the loss in each): the
    # survivor's collective times out, and torchloom names the lost rank from the heartbeats; Spark sees the
    # executor lost and aborts the barrier stage, and torchloom gives Spark's reason; or Spark resubmits the stage
    # itself, and the driver has nothing to say. Never the bare exception's name.
    rerun = re.search(r"attempt 1 of \d+ failed \((.*)\); re-running the workers", text)
    assert rerun is None or rerun[1] == f"rank 0 on host {lost.name} stopped answering (lost)" or \
        rerun[1].startswith("Spark lost executor "), text[-3000:]
    assert "attempt 2 of 4 failed" not in text, text[-3000:]
    assert f"restart 1: rank 0 on host {lost.name} stopped answering (lost); resuming from the latest checkpoint in" \
           f" {run}/checkpoints" in (logs / "rank-0.log").read_text()
    assert placement_hosts(logs) == {h.name for h in workers}  # one rank per executor host, the third took over
    assert {p.name for p in logs.glob("rank-*.log")} == {"rank-0.log", "rank-1.log"}  # their output reached the store
    survivors = [h for h in workers if h is not lost]
    assert any(any(caches[h.name].rglob("step-5/meta.json")) for h in survivors)  # taken from the store


def test_torchrun_on_the_store_prepares_survives_the_loss_of_a_host_and_exports_the_local_model(setup, tmp_path):
    # torchrun's loss of a host with a replacement joining, with no shared directory: b prepares the CSV from the
    # store (the embedded local Spark); the rank on c stops answering at step 8 (after the step-5 checkpoint
    # reached the store), c goes, a replacement node on d (an empty cache) joins; d's rank takes the step-5
    # checkpoint and the data from the store, and d exports.
    from cluster.test_multihost import wait_for

    with Cluster(["s", "b", "c", "d"]) as hosts:
        s, b, c, d = (hosts[n] for n in "sbcd")
        run = f"{RUN}-loss"
        env, caches, model = store_hosts(hosts, setup, tmp_path, [b, c, d], run)
        said = prepare_from_store(b, run, env, caches, model, tmp_path)
        env.update(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", TORCHLOOM_FAULT=f"host={c.name},step=8,kind=hang")
        argv = [x if x != str(setup["model"]) else str(model)
                for x in torchrun_argv(Path("/unused"), setup, b.name, "tl-store-loss", 3,
                                       "--engine.collective_timeout_s", "15")]
        argv[argv.index("--output.dir") + 1] = run
        logs = {h.name: tmp_path / f"{h.name}.log" for h in (b, c, d)}
        survivor = b.popen(argv, log=logs[b.name], env={**env, "TORCHLOOM_CACHE": str(caches[b.name])})
        c.popen(argv, log=logs[c.name], env={**env, "TORCHLOOM_CACHE": str(caches[c.name])})
        wait_for("the rank on c to stop at step 8", lambda: any(caches[c.name].rglob("fault-fired-*")), 240,
                 list(logs.values()))
        c.link_down()
        c.kill_all()
        replacement = d.popen(argv, log=logs[d.name], env={**env, "TORCHLOOM_CACHE": str(caches[d.name])})
        for p in (survivor, replacement):
            p.wait(timeout=300)
        text = {h: p.read_text(errors="replace") for h, p in logs.items()}
        assert survivor.returncode == 0 and replacement.returncode == 0, text[b.name][-3000:] + text[d.name][-3000:]
        env.pop("TORCHLOOM_FAULT")
        export_to_store(d, run, env, caches, model, tmp_path)
        assert_the_local_job(setup, s, env, caches, run, tmp_path)
    assert f"prepare: reading {INPUT} from the store" in said, said[-3000:]
    assert "resuming from the latest checkpoint in s3://" in text[d.name], text[d.name][-3000:]
    (on_c,) = rank_hosts(text[c.name])  # one rank on each host, before and after the loss
    assert set(rank_hosts(text[b.name]).values()) == {b.name} and set(rank_hosts(text[d.name]).values()) == {d.name}
    assert f"restart 1: rank {on_c} on host {c.name} stopped answering (lost); resuming" in text[b.name]
    assert "Traceback" not in without_exit_barrier_race(text[b.name])  # the survivor's collective error: one line
    assert any(caches[d.name].rglob("step-5/meta.json"))  # d took the checkpoint from the store
