"""The pods of `torchloom k8s train`, their own commands run for real (issue 47): each pod's container command from
the generated Job, on a host of its own (a network namespace) with the environment Kubernetes would give it (the
manifest's env, the Job's uid, JOB_COMPLETION_INDEX, the Secret's keys) and the headless Service's names
(`<job>-<index>.<job>`) resolving to the hosts; the run on an S3 server on a third host. SIGTERM to one pod's
first process (as Kubernetes sends it) mid-run: the pod exits 75 after a checkpoint of the step the ranks agreed
on; the pod started again with the same index (an empty cache, as a new pod's emptyDir) resumes from the store and
both pods finish.

Not Kubernetes: no scheduler, no Job controller (the test starts the replacement), no cluster DNS (/etc/hosts).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import yaml
from support.engine_reference import COMMON

from cluster.netns import NETNS_ETC, Cluster, skip_without_namespaces
from cluster.s3_scripts import with_bucket
from cluster.test_multihost import clean_env, wait_for

BUCKET = "tl-k8s"
RUN = f"s3://{BUCKET}/runs/pods"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "pods-key", "AWS_SECRET_ACCESS_KEY": "pods-secret",
               "AWS_DEFAULT_REGION": "us-east-1"}
pytestmark = pytest.mark.cluster  # see tests/support/schedule.py
pytest.importorskip("moto")
skip_without_namespaces()

# On the store's host: the bucket, then a prepared run's data/ (manifest.json last, as prepare uploads it).
UPLOAD = with_bucket('storage.push_tree(sys.argv[3], sys.argv[4], last=("manifest.json",))')
LIST = """
import sys
from torchloom.store import storage
print("\\n".join(sorted(storage.list_files(sys.argv[1]))))
"""


def the_job(capsys, model: str) -> dict:
    from torchloom.k8s.command import main

    assert main(["train", "--image", "unused", "--nodes", "2", "--output.dir", RUN, "--model.path", model,
                 "--secret", "store", *COMMON, "--train.log_every", "1"]) == 0
    return next(d for d in yaml.safe_load_all(capsys.readouterr().out) if d and d["kind"] == "Job")


def pod_env(container: dict, env: dict, index: int, cache: Path) -> dict:
    """What Kubernetes gives the container: the manifest's values, the Job's uid (the downward API), the index; the
    pod's own cache and /tmp (emptyDirs: a new pod's are empty)."""
    values = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    (cache / "tmp").mkdir(parents=True, exist_ok=True)
    return {**env, **values, "TORCHLOOM_CACHE": str(cache), "TMPDIR": str(cache / "tmp"), "HOME": str(cache / "tmp"),
            "TORCHLOOM_JOB_UID": "3f2c-job-uid", "JOB_COMPLETION_INDEX": str(index),
            "PATH": f"{Path(sys.executable).parent}:{env['PATH']}"}


# pod 0's preemption in CI; pod 1's (the same outcome, the other way round) under -m soak
@pytest.mark.parametrize("preempted", [0, pytest.param(1, marks=pytest.mark.soak)])
def test_the_jobs_pods_resume_from_the_store_after_one_is_preempted(capsys, tmp_path, tiny_model_dir, preempted):
    # SIGTERM to pod `preempted` at a random moment after the step-5 checkpoint: it exits 75; the other pod's ranks
    # end preempted on its notice (the checkpoint of the same step) and, torchrun restarting nothing in place, that
    # pod exits 75 too (not counted, no restart of its own spent). The Job replaces both; every pod exits 0 or 75,
    # never a failure, and the run finishes from the store.
    import random

    from torchloom.data.synthetic import write_synthetic_dataset

    job = the_job(capsys, tiny_model_dir)
    name = job["metadata"]["name"]
    (container,) = job["spec"]["template"]["spec"]["containers"]
    data = tmp_path / "data"
    write_synthetic_dataset(data, rows={"train": 103, "val": 21, "test": 19})
    with Cluster(["s", "p0", "p1"]) as hosts:
        s, pods = hosts["s"], [hosts["p0"], hosts["p1"]]
        for h in hosts.hosts.values():  # the headless Service's names, as the cluster's DNS gives them
            with open(NETNS_ETC / h.ns / "hosts", "a") as f:
                f.writelines(f"{p.address} {name}-{i}.{name}\n" for i, p in enumerate(pods))
        endpoint = f"http://{s.address}:5000"
        env = clean_env(TMPDIR=str(tmp_path), AWS_ENDPOINT_URL=endpoint, **CREDENTIALS)  # the Secret's keys
        s.popen([sys.executable, "-m", "moto.server", "-H", s.address, "-p", "5000"], log=tmp_path / "s3.log", env=env)
        deadline = time.monotonic() + 60
        while (up := s.run([sys.executable, "-c", UPLOAD, endpoint, BUCKET, str(data), f"{RUN}/data"], env=env,
                           timeout=60)).returncode:
            assert time.monotonic() < deadline, up.stderr[-2000:]
            time.sleep(0.5)
        logs = [tmp_path / "p0.log", tmp_path / "p1.log"]
        slow = {"TORCHLOOM_FAULT": f"host={pods[1].name},step=1,kind=slow,sleep=0.3"}  # time to send the SIGTERM
        # each pod's own /tmp (an emptyDir): the preempted mark lives there
        procs = [p.popen(container["command"], log=logs[i], env={**pod_env(container, env, i, tmp_path / f"c{i}"),
                                                                  **slow}) for i, p in enumerate(pods)]
        wait_for("the step-5 checkpoint", lambda: any(any((tmp_path / f"c{i}").rglob("step-5/meta.json"))
                                                      for i in (0, 1)), 240, logs)
        time.sleep(random.uniform(0, 1.0))
        procs[preempted].send_signal(15)  # SIGTERM to the pod's first process, as Kubernetes sends it
        assert procs[preempted].wait(timeout=60) == 75, logs[preempted].read_text(errors="replace")[-3000:]
        other = 1 - preempted  # its ranks ended preempted on the notice, and its torchrun restarts nothing
        assert procs[other].wait(timeout=120) == 75, logs[other].read_text(errors="replace")[-3000:]
        replaced = [0, 1]
        first = "".join(p.read_text(errors="replace") for p in logs)
        again = {i: tmp_path / f"p{i}-again.log" for i in replaced}
        for i in replaced:  # the pods the Job starts in their place: same index, empty cache and /tmp
            procs[i] = pods[i].popen(container["command"], log=again[i],
                                     env=pod_env(container, env, i, tmp_path / f"c{i}-again"))
        for p in procs:
            p.wait(timeout=240)
        text = "".join(p.read_text(errors="replace") for p in [*again.values(), *(logs[i] for i in (0, 1)
                                                                                   if i not in replaced)])
        assert [p.returncode for p in procs] == [0, 0], text[-4000:]
        on_store = s.run([sys.executable, "-c", LIST, f"{RUN}/checkpoints"], env=env, timeout=60).stdout.split()
    said = [x for x in (first + text).splitlines() if "torchloom: train: preempted at step" in x]
    assert said and "notice: SIGTERM" in said[0], (first + text)[-3000:]
    stopped_at = int(said[0].split("preempted at step ")[1].split()[0])
    assert f"step-{stopped_at}/meta.json" in on_store and "step-13/meta.json" in on_store
    assert "resuming from the latest checkpoint in s3://" in text, text[-3000:]
