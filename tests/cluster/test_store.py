"""Hosts that share nothing but an S3 store (issue 28): Ray (head + 2 nodes), Spark standalone (2 worker
hosts) and torchrun (2 nodes, one of them lost and replaced), the run on s3:// served by a real S3 server
(moto's) on a host of its own. No host sees another's files: each has a private cache (its staging copy of
the run), the others' are hidden, and so are the prepared data and the reference run. Every job must end at
the local engine's weights, bit for bit, read back from the store.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import pytest
from engine_reference import LAST, assert_same_weights, reference

from cluster.netns import Cluster, unavailable
from cluster.test_multihost import COMMON, clean_env, torchloom, torchrun_argv

pytest.importorskip("moto")
reason = unavailable()
if reason:
    pytest.skip(f"multi-host tests need network namespaces: {reason}", allow_module_level=True)

BUCKET = "tl-cluster"
RUN = f"s3://{BUCKET}/runs/torchrun"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "cluster-key", "AWS_SECRET_ACCESS_KEY": "cluster-secret",
               "AWS_DEFAULT_REGION": "us-east-1"}

# Run on the store's host: make the bucket, upload the prepared data (manifest.json last).
UPLOAD = """
import sys
from pyarrow import fs
from torchloom import storage
fs.S3FileSystem(endpoint_override=sys.argv[1], scheme="http", allow_bucket_creation=True,
                region="us-east-1").create_dir(sys.argv[2])
storage.push_tree(sys.argv[3], sys.argv[4], last=("manifest.json",))
"""
DOWNLOAD = """
import sys
from torchloom import storage
storage.pull_tree(sys.argv[1], sys.argv[2])
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return reference(tmp_path_factory.mktemp("store"))


def store_hosts(hosts, setup, tmp_path: Path, workers: list, run: str) -> tuple[dict, dict, Path]:
    """The S3 server on host s with the prepared data uploaded; each host a private cache, the others' and the
    reference hidden from the workers. Returns (env for all, caches by host, the model dir every host has)."""
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
        up = s.run([sys.executable, "-c", UPLOAD, endpoint, BUCKET, str(setup["data"]), f"{run}/data"],
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


def weights_from_store(s, env: dict, caches: dict, run: str, tmp_path: Path) -> Path:
    return from_store(s, env, caches, f"{run}/checkpoints/{LAST}", tmp_path / "back")


def placement_hosts(logs: Path) -> set[str]:
    """The hosts the ranks ran on, from the placement files they uploaded."""
    return {json.loads(p.read_text())["host"] for p in logs.glob("placement-*.json")}


def test_ray_head_and_two_nodes_sharing_only_an_s3_store_train_the_local_weights(setup, tmp_path):
    import secrets
    import tempfile

    with Cluster(["s", "a", "b", "c"]) as hosts:
        s, a, b, c = (hosts[n] for n in "sabc")
        env, caches, model = store_hosts(hosts, setup, tmp_path, [a, b, c], f"{RUN}-ray")
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32), RAY_USAGE_STATS_ENABLED="0",
                   PATH=f"{Path(sys.executable).parent}:{env['PATH']}")
        temps = {h.name: tempfile.mkdtemp(prefix="tlray") for h in (a, b, c)}
        try:
            for h in (a, b, c):  # each node's workers inherit its environment: its own cache
                start = ["ray", "start", "--node-ip-address", h.address, "--temp-dir", temps[h.name]]
                start += (["--head", "--port", "6379", "--num-cpus", "0", "--disable-usage-stats"] if h is a
                          else ["--address", f"{a.address}:6379", "--num-cpus", "1"])
                out = h.run(start, env={**env, "TORCHLOOM_CACHE": str(caches[h.name])}, timeout=120)
                assert out.returncode == 0, out.stderr[-3000:]
            proc = torchloom(a, ["train", "--output.dir", f"{RUN}-ray", "--engine.name", "ray",
                                 "--engine.ray_address", f"{a.address}:6379", "--engine.cpus_per_worker", "1",
                                 "--model.path", str(model), *COMMON],
                             {**env, "TORCHLOOM_CACHE": str(caches[a.name])}, 420, tmp_path / "driver.log")
            back = weights_from_store(s, env, caches, f"{RUN}-ray", tmp_path)
            logs = from_store(s, env, caches, f"{RUN}-ray/logs", tmp_path / "logs")
        finally:
            for t in temps.values():
                shutil.rmtree(t, ignore_errors=True)
    # the driver on a read rank 0's result (on b or c) from the store, and the weights are the local engine's
    assert "train: 13 steps" in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-3000:]
    assert placement_hosts(logs) == {b.name, c.name}  # the head has no CPUs: the ranks ran on b and c
    assert_same_weights(setup["ref"] / "checkpoints" / LAST, back)


def test_spark_standalone_workers_sharing_only_an_s3_store_train_the_local_weights(setup, tmp_path):
    from cluster.test_multihost import spark_class, wait_for

    with Cluster(["s", "a", "b", "c"]) as hosts:
        s, a, b, c = (hosts[n] for n in "sabc")
        env, caches, model = store_hosts(hosts, setup, tmp_path, [a, b, c], f"{RUN}-spark")
        env.update(SPARK_LOG_DIR=str(tmp_path), SPARK_NO_DAEMONIZE="1")
        master_log = tmp_path / "master.log"
        a.popen([spark_class(), "org.apache.spark.deploy.master.Master", "--host", a.name, "--port", "7077",
                 "--webui-port", "8080"], log=master_log, env=env)
        worker_logs = []
        for h in (b, c):  # executors inherit their worker's environment: its own cache
            worker_logs.append(tmp_path / f"worker-{h.name}.log")
            h.popen([spark_class(), "org.apache.spark.deploy.worker.Worker", f"spark://{a.name}:7077",
                     "--host", h.name, "--cores", "1", "--memory", "1500m", "--webui-port", "8081",
                     "--work-dir", str(tmp_path / f"work-{h.name}")], log=worker_logs[-1],
                    env={**env, "TORCHLOOM_CACHE": str(caches[h.name])})
        wait_for("two Spark workers registered with the master",
                 lambda: master_log.is_file() and master_log.read_text().count("Registering worker") >= 2,
                 120, [master_log, *worker_logs])
        proc = torchloom(a, ["train", "--output.dir", f"{RUN}-spark", "--engine.name", "spark",
                             "--prepare.spark_master", f"spark://{a.name}:7077", "--model.path", str(model), *COMMON],
                         {**env, "TORCHLOOM_CACHE": str(caches[a.name])}, 420, tmp_path / "driver.log")
        back = weights_from_store(s, env, caches, f"{RUN}-spark", tmp_path)
        logs = from_store(s, env, caches, f"{RUN}-spark/logs", tmp_path / "logs")
    assert placement_hosts(logs) == {b.name, c.name}, proc.stderr[-3000:]  # one rank per executor host
    assert {p.name for p in logs.glob("rank-*.log")} == {"rank-0.log", "rank-1.log"}  # their output reached the store
    assert "train: 13 steps" in proc.stdout + proc.stderr
    assert_same_weights(setup["ref"] / "checkpoints" / LAST, back)


def test_torchrun_on_the_store_survives_the_loss_of_a_host_and_resumes_from_the_store(setup, tmp_path):
    # As tests/cluster/test_multihost.py's torchrun loss, with no shared directory: the rank on c stops
    # answering at step 8 (after the step-5 checkpoint reached the store), c goes, a replacement node on d (an
    # empty cache) joins; d's rank takes the step-5 checkpoint and the data from the store.
    from cluster.test_multihost import wait_for

    with Cluster(["s", "b", "c", "d"]) as hosts:
        s, b, c, d = (hosts[n] for n in "sbcd")
        run = f"{RUN}-loss"
        env, caches, model = store_hosts(hosts, setup, tmp_path, [b, c, d], run)
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
        back = weights_from_store(s, env, caches, run, tmp_path)
    assert "resuming from the latest checkpoint in s3://" in text[d.name], text[d.name][-3000:]
    assert any(caches[d.name].rglob("step-5/meta.json"))  # d took the checkpoint from the store
    assert_same_weights(setup["ref"] / "checkpoints" / LAST, back)
