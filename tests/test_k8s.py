"""`torchloom k8s train|serve` (src/torchloom/k8s/): the manifests validate against the Kubernetes API schemas
offline (kubernetes-validate, strict) and hold what a run on the cluster needs, field by field; `--apply` creates
exactly the objects written on a stateful fake API server and refuses, in one line, what would not start; the
serve manifest's probes are routes the real server answers; the pod's shell turns a SIGTERM into exit 75.

No real cluster here: the scheduler, the device plugin, DNS and the Job controller are not exercised.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from support.kube_api import fake_kube
from support.net import free_port

from torchloom.k8s import job
from torchloom.k8s.command import main
from torchloom.k8s.manifests import MIN_KUBERNETES

kv = pytest.importorskip("kubernetes_validate", reason="needs the dev extra: kubernetes-validate")

# every Kubernetes the manifests are for: from the stated minimum (manifests.MIN_KUBERNETES) to the newest whose
# schemas kubernetes-validate ships
VERSIONS = tuple(sorted({v for v in kv.utils.all_versions()
                         if tuple(map(int, v.split(".")[:2])) >= tuple(map(int, MIN_KUBERNETES.split(".")))},
                        key=lambda v: tuple(map(int, v.split(".")))))
TRAIN = ["train", "--image", "registry.example/torchloom:0.1", "--nodes", "2", "--gpus-per-node", "8",
         "--output.dir", "s3://bucket/runs/tickets", "--secret", "store-credentials", "--cpu", "16", "--memory",
         "128Gi", "--node-selector", "cloud.google.com/gke-accelerator=nvidia-h100-80gb",
         "--toleration", "nvidia.com/gpu:NoSchedule", "--toleration", "spot=true:NoExecute",
         "--train.lr", "3e-5", "--train.batch_size", "32", "--engine.max_restarts", "3",
         "--prepare.spark_master", "local[2]"]
SERVE = ["serve", "s3://bucket/runs/tickets/model", "--image", "registry.example/torchloom:0.1",
         "--secret", "serve-secrets", "--replicas", "2", "--cpu", "2", "--memory", "4Gi"]


def run_main(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def manifests(capsys, *argv: str) -> dict[str, dict]:
    code, out, err = run_main(capsys, *argv)
    assert code == 0, err
    docs = [d for d in yaml.safe_load_all(out) if d]
    for version in VERSIONS:
        for d in docs:
            kv.validate(d, version, strict=True)  # raises with the failing field
    return {d["kind"]: d for d in docs}


def script_of(container: dict) -> str:
    assert container["command"][:2] == ["sh", "-c"]
    return container["command"][2]


def torchrun_argv(container: dict) -> list[str]:
    """The torchrun line of the pod's script, split as the shell splits it (the Job's uid put in)."""
    line = next(x for x in script_of(container).splitlines() if x.startswith("torchrun "))
    return shlex.split(line.replace(f'"${job.UID_ENV}"', "JOB-UID").rstrip(" &"))


def test_train_manifests_validate_and_hold_what_a_torchrun_job_needs(capsys):
    objs = manifests(capsys, *TRAIN)
    assert set(objs) == {"Service", "Job"}
    svc, jb = objs["Service"], objs["Job"]
    name = jb["metadata"]["name"]
    assert name == "tickets" and svc["metadata"]["name"] == name
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    spec = jb["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == 2
    pod = spec["template"]["spec"]
    assert svc["spec"]["selector"].items() <= spec["template"]["metadata"]["labels"].items()
    assert pod["subdomain"] == name and pod["restartPolicy"] == "Never"
    (c,) = pod["containers"]
    assert c["image"] == "registry.example/torchloom:0.1"
    assert c["resources"] == {"requests": {"cpu": "16", "memory": "128Gi"},
                              "limits": {"memory": "128Gi", "nvidia.com/gpu": 8}}
    assert pod["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
                                  {"key": "spot", "operator": "Equal", "value": "true", "effect": "NoExecute"}]
    assert c["envFrom"] == [{"secretRef": {"name": "store-credentials"}}]
    env = {e["name"]: e for e in c["env"]}
    assert env["HF_HUB_OFFLINE"]["value"] == "1" and env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"]["value"] == "1"
    assert not any(n.startswith(("AWS_", "GOOGLE_", "AZURE_")) for n in env)  # credentials only by the Secret's name
    assert env[job.UID_ENV]["valueFrom"]["fieldRef"]["fieldPath"].endswith("['batch.kubernetes.io/controller-uid']")
    # a few seconds above the checkpoint's grace, within what torchrun gives its workers
    assert 25 + 3 < pod["terminationGracePeriodSeconds"] <= 25 + 10
    assert spec["backoffLimit"] == 3 * 2 and spec["podReplacementPolicy"] == "Failed"


def test_the_pods_run_torchruns_own_command_with_the_config_of_torchloom_train(capsys):
    """The torchrun line is parsed by torch's own torchrun parser, and the worker's flags by torchloom's config."""
    from torch.distributed.run import get_args_parser

    from torchloom.config import build

    (c,) = manifests(capsys, *TRAIN)["Job"]["spec"]["template"]["spec"]["containers"]
    argv = torchrun_argv(c)
    assert argv[0] == "torchrun"
    a = get_args_parser().parse_args(argv[1:])
    assert (a.nnodes, a.nproc_per_node, a.rdzv_backend) == ("2", "8", "c10d")
    assert a.rdzv_endpoint == "tickets-0.tickets:29400" and a.rdzv_id == "JOB-UID"
    assert a.max_restarts == 0  # the Job replaces the pods: a survivor spends no restart of its own
    assert a.module and a.training_script == "torchloom.engines.torchrun"
    worker = build(None, a.training_script_args)  # what engines/torchrun.py builds from them
    assert worker.output.dir == "s3://bucket/runs/tickets" and worker.engine.workers == 16
    assert worker.train.lr == 3e-5 and worker.train.batch_size == 32 and worker.engine.max_restarts == 3
    assert not any(f.startswith(("--prepare.", "--k8s.", "--engine.name")) for f in a.training_script_args)


def test_a_preempted_pod_is_not_counted_against_backoff(capsys):
    from torchloom.engines import torchrun
    from torchloom.train import preemption

    assert (job.PREEMPTED_MARKER_ENV, job.PREEMPTED_MARK) == (torchrun.PREEMPTED_MARKER_ENV, torchrun.PREEMPTED_MARK)

    jb = manifests(capsys, *TRAIN)["Job"]
    rules = jb["spec"]["podFailurePolicy"]["rules"]
    assert {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]} in rules
    assert {"action": "Ignore", "onExitCodes": {"containerName": "trainer", "operator": "In",
                                                "values": [preemption.EXIT_PREEMPTED]}} in rules
    assert job.EXIT_PREEMPTED == preemption.EXIT_PREEMPTED == 75 and job.EXIT_MARGIN_S == preemption.EXIT_MARGIN_S


def stub_torchrun(tmp_path: Path, exit_code: int) -> Path:
    """A `torchrun` that, like torch elastic's, exits 1 on its own SIGTERM, and otherwise `exit_code`."""
    bin_dir = tmp_path / f"bin{exit_code}"
    bin_dir.mkdir()
    stub = bin_dir / "torchrun"
    stub.write_text(f"#!{sys.executable}\nimport signal, sys, time, pathlib\n"
                    f"pathlib.Path({str(tmp_path / 'argv')!r}).write_text(' '.join(sys.argv[1:]))\n"
                    "signal.signal(signal.SIGTERM, lambda *_: (time.sleep(0.2), sys.exit(1)))\n"
                    f"time.sleep(float(sys.argv[sys.argv.index('--rdzv-id') + 1].split('-')[1]))\n"
                    f"sys.exit({exit_code})\n")
    stub.chmod(0o755)
    return bin_dir


@pytest.mark.parametrize("sigterm", [True, False])
def test_the_pods_shell_exits_75_on_sigterm_and_torchruns_code_otherwise(capsys, tmp_path, sigterm):
    (c,) = manifests(capsys, *TRAIN)["Job"]["spec"]["template"]["spec"]["containers"]
    bin_dir = stub_torchrun(tmp_path, exit_code=3)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", job.UID_ENV: "uid-30" if sigterm else "uid-0"}
    proc = subprocess.Popen(c["command"], env=env)
    if sigterm:
        deadline = time.monotonic() + 10
        while not (tmp_path / "argv").exists():  # torchrun started
            assert time.monotonic() < deadline
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == (75 if sigterm else 3)
    assert "--rdzv-id uid-" in (tmp_path / "argv").read_text()


@pytest.mark.parametrize("marked, code", [(True, 75), (False, 1)])
def test_a_pod_whose_ranks_ended_preempted_exits_75_when_torchrun_then_fails(capsys, tmp_path, marked, code):
    # pod 0 preempted takes the rendezvous with it: the other pods' ranks end preempted (75, a peer's notice), then
    # their torchrun fails (1); the pod says 75, not counted. Without the ranks' mark, torchrun's 1 stands.
    (c,) = manifests(capsys, *TRAIN)["Job"]["spec"]["template"]["spec"]["containers"]
    marker = tmp_path / "preempted"
    script = script_of(c).replace(job.PREEMPTED_MARKER, str(marker))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stub = bin_dir / "torchrun"
    stub.write_text("#!/bin/sh\n" + (f'printf "{job.PREEMPTED_MARK}" > "${job.PREEMPTED_MARKER_ENV}"\n' if marked
                                     else "") + "exit 1\n")
    stub.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", job.UID_ENV: "uid-0"}
    marker.write_text(job.PREEMPTED_MARK)  # an earlier attempt's mark is not this one's: the script clears it first
    assert subprocess.run(["sh", "-c", script], env=env, timeout=20).returncode == code


def test_a_file_at_the_marks_path_that_is_not_torchloom_s_is_neither_deleted_nor_counted(capsys, tmp_path):
    from torchloom.engines import torchrun

    (c,) = manifests(capsys, *TRAIN)["Job"]["spec"]["template"]["spec"]["containers"]
    marker = tmp_path / "preempted"
    marker.write_text("someone's notes")
    script = script_of(c).replace(job.PREEMPTED_MARKER, str(marker))
    stub = tmp_path / "bin" / "torchrun"
    stub.parent.mkdir()
    stub.write_text("#!/bin/sh\nexit 1\n")
    stub.chmod(0o755)
    env = {**os.environ, "PATH": f"{stub.parent}:{os.environ['PATH']}", job.UID_ENV: "uid-0"}
    assert subprocess.run(["sh", "-c", script], env=env, timeout=20).returncode == 1  # a failure, counted
    assert marker.read_text() == "someone's notes"
    torchrun.clear_mark(str(marker))  # nor by a rank at its start: it clears only torchloom's own mark
    assert marker.read_text() == "someone's notes"
    marker.write_text(torchrun.PREEMPTED_MARK)
    torchrun.clear_mark(str(marker))
    assert not marker.exists()


@pytest.mark.parametrize("index, host", [("0", "true"), ("1", "false")])
def test_pod_0_is_told_it_hosts_the_rendezvous(capsys, tmp_path, index, host):
    (c,) = manifests(capsys, *TRAIN)["Job"]["spec"]["template"]["spec"]["containers"]
    env = {**os.environ, "PATH": f"{stub_torchrun(tmp_path, 0)}:{os.environ['PATH']}", job.UID_ENV: "uid-0",
           "JOB_COMPLETION_INDEX": index}  # set by the Indexed Job in each pod
    assert subprocess.run(c["command"], env=env, timeout=20).returncode == 0
    assert f"--rdzv-conf is_host={host} --rdzv-id uid-0" in (tmp_path / "argv").read_text()


def pods(objs: dict) -> list[dict]:
    return [objs[kind]["spec"]["template"] for kind in ("Job", "Deployment") if kind in objs]


@pytest.mark.parametrize("argv", [TRAIN, SERVE])
def test_the_pods_are_hardened_by_default(capsys, argv):
    objs = manifests(capsys, *argv)
    (template,) = pods(objs)
    pod = template["spec"]
    assert pod["automountServiceAccountToken"] is False and "serviceAccountName" not in pod
    assert pod["securityContext"] == {"runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001,
                                      "fsGroup": 10001, "seccompProfile": {"type": "RuntimeDefault"}}
    (c,) = pod["containers"]
    assert c["imagePullPolicy"] == "Always"
    assert c["securityContext"] == {"allowPrivilegeEscalation": False, "privileged": False,
                                    "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}
    # what torchloom writes goes to volumes: the cache, /tmp (also $HOME), and a training pod's /dev/shm
    mounts = {v["mountPath"]: v["name"] for v in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert {"/var/cache/torchloom", "/tmp"} <= set(mounts) and all("emptyDir" in volumes[n] for n in mounts.values())
    assert {"name": "HOME", "value": "/tmp"} in c["env"]


@pytest.mark.parametrize("argv", [TRAIN, SERVE])
def test_a_platform_teams_options_reach_every_object_and_pod(capsys, argv):
    objs = manifests(capsys, *argv, "--service-account", "trainer-identity", "--image-pull-secret", "regcred,mirror",
                     "--label", "kueue.x-k8s.io/queue-name=gpu-queue", "--label", "team=nlp",
                     "--annotation", "example.com/owner=ml platform", "--priority-class", "batch-high",
                     "--scheduler", "volcano", "--k8s.active_deadline_s", "86400",
                     "--k8s.ttl_after_finished_s", "3600", "--k8s.run_as_user", "2000")
    for obj in objs.values():
        assert obj["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "gpu-queue"
        assert obj["metadata"]["annotations"] == {"example.com/owner": "ml platform"}
    (template,) = pods(objs)
    assert template["metadata"]["labels"]["team"] == "nlp"
    pod = template["spec"]
    # workload identity brings its own projected token: the API's is never mounted
    assert pod["serviceAccountName"] == "trainer-identity" and pod["automountServiceAccountToken"] is False
    assert pod["imagePullSecrets"] == [{"name": "regcred"}, {"name": "mirror"}]
    assert (pod["priorityClassName"], pod["schedulerName"]) == ("batch-high", "volcano")
    assert pod["securityContext"]["runAsUser"] == 2000
    if "Job" in objs:
        assert objs["Job"]["spec"]["activeDeadlineSeconds"] == 86400
        assert objs["Job"]["spec"]["ttlSecondsAfterFinished"] == 3600
    # the selectors still match: the user's labels are beside torchloom's, never instead of them
    selector = (objs.get("Deployment") or {}).get("spec", {}).get("selector", {}).get("matchLabels", {})
    assert selector.items() <= template["metadata"]["labels"].items()


@pytest.mark.parametrize("args, says", [
    (["--namespace", "My NS: $(x)"], "k8s.namespace 'My NS: $(x)': not a name Kubernetes takes"),
    (["--label", "team=a b"], "a label's value is at most 63"),
    (["--label=-bad=x"], "k8s.labels '-bad': not a key Kubernetes takes"),
    (["--label", "app.kubernetes.io/name=x"], "torchloom sets the app.kubernetes.io/ labels itself"),
    (["--annotation", "Example.com/x=1"], "k8s.annotations 'Example.com/x': not a key"),
    (["--image-pull-secret", "reg cred"], "k8s.image_pull_secrets 'reg cred'"),
    (["--service-account", "Trainer"], "k8s.service_account 'Trainer'"),
])
def test_names_labels_and_keys_are_checked_as_kubernetes_would(capsys, tmp_path, args, says):
    out = tmp_path / "out"
    code, stdout, err = run_main(capsys, *SERVE, *args, "--out", str(out))
    assert code == 2 and stdout == "" and not out.exists()
    assert err.count("\n") == 1 and says in err, err


@pytest.mark.parametrize("args, says", [
    (["--output.dir", "runs/local"], "output.dir runs/local: a path on this machine"),
    (["--output.dir", "file+store:///tmp/x"], "a directory on this machine used as a store"),
    (["--output.dir", "s3://key:pw@bucket/run"], "credentials or a query in the URI"),
    (["--engine.name", "ray"], "engine.name ray: `torchloom k8s train` runs torchrun"),
    (["--train.preemption_grace_s", "28"], "set --train.preemption_grace_s 27 or less"),
    (["--engine.workers", "4"], "engine.workers 4: 2 pods x 8 GPUs make 16 ranks"),
    (["--image", ""], "k8s.image: the pods need a container image"),
    (["--name", "Tickets_1"], "k8s.name 'Tickets_1': not a name Kubernetes takes"),
    (["--engine.ray_address", "ray://u:secretpw@head:10001"], "engine.ray_address: holds a secret"),
    (["--toleration", "gpu:Sometimes"], "effect 'Sometimes' is not one of"),
])
def test_what_cannot_run_there_is_one_line_before_anything_is_written(capsys, tmp_path, args, says):
    out = tmp_path / "out"
    code, stdout, err = run_main(capsys, *TRAIN, *args, "--out", str(out))
    assert code == 2 and stdout == "" and not out.exists()
    assert err.count("\n") == 1 and err.startswith("torchloom: error: ") and says in err, err
    assert "secretpw" not in err


def test_serve_manifests_validate_and_hold_probes_secret_and_a_draining_stop(capsys):
    from torchloom.serve.settings import ServeSettings

    objs = manifests(capsys, *SERVE, "--", "--max-batch-size", "64")
    assert set(objs) == {"Deployment", "Service"}
    dep, svc = objs["Deployment"], objs["Service"]
    assert dep["metadata"]["name"] == svc["metadata"]["name"] == "tickets-model"
    assert dep["spec"]["replicas"] == 2
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["command"][:3] == ["torchloom", "serve", "s3://bucket/runs/tickets/model"]
    assert "--require-api-key" in c["command"] and c["command"][-2:] == ["--max-batch-size", "64"]
    assert {"name": "TORCHLOOM_API_KEY", "valueFrom": {"secretKeyRef": {"name": "serve-secrets",
                                                                         "key": "TORCHLOOM_API_KEY"}}} in c["env"]
    assert c["envFrom"] == [{"secretRef": {"name": "serve-secrets"}}]
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz" and c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["resources"] == {"requests": {"cpu": "2", "memory": "4Gi"}, "limits": {"memory": "4Gi"}}
    pause = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["terminationGracePeriodSeconds"] > pause + ServeSettings.drain_timeout_s


def test_serve_manifests_of_several_models_keep_a_client_on_one_pod(capsys):
    flags = ["--model", "v1=s3://bucket/runs/a/model", "--model", "v2=s3://bucket/runs/b/model", "--traffic",
             "v1=90,v2=10"]
    objs = manifests(capsys, *[a for a in SERVE if a != SERVE[1]], "--", *flags)
    (c,) = objs["Deployment"]["spec"]["template"]["spec"]["containers"]
    assert c["command"][:3] == ["torchloom", "serve", "--host"] and c["command"][-len(flags):] == flags
    assert objs["Service"]["spec"]["sessionAffinity"] == "ClientIP"  # feedback reaches the pod that answered
    assert "sessionAffinity" not in manifests(capsys, *SERVE)["Service"]["spec"]
    for extra, says in [(["--traffic", "v1=90,v2=20"], "add up to 110"), (["--shadow", "v3"], "no model is named"),
                        (["--model", "v3=/models/c"], "--model v3 /models/c: a path on this machine")]:
        code, stdout, err = run_main(capsys, *[a for a in SERVE if a != SERVE[1]], "--", *flags[:4], *extra)
        assert code == 2 and stdout == "" and says in err and err.count("\n") == 1, err
    code, _, err = run_main(capsys, *SERVE, "--", *flags)
    assert code == 2 and "MODEL_URI s3://bucket/runs/tickets/model and --model flags" in err, err


@pytest.mark.parametrize("args, says", [
    (["--secret", ""], "k8s.env_from: the server's API key comes from a Secret"),
    (["--", "--api-key", "abc12345"], "--api-key: not a flag to pass on"),
    # serve's own parser would take `--api` for --api-key: no abbreviation reaches a manifest, nor the secret a line
    (["--", "--api", "abc12345"], "--api: not a flag of torchloom serve (flags are spelled out whole here)"),
    (["--", "--max-batch", "8"], "--max-batch: not a flag of torchloom serve"),
    (["--", "--max-batch-size", "lots"], "--max-batch-size: invalid int value"),
    (["--", "--log", "postgresql://u:abc12345@db/log"], "--log: its URI holds a password, which would be written"),
])
def test_serve_refusals_are_one_line(capsys, args, says):
    code, stdout, err = run_main(capsys, *SERVE, *args)
    assert code == 2 and stdout == "" and says in err and err.count("\n") == 1, err
    assert "abc12345" not in err
    code, _, err = run_main(capsys, "serve", "/models/local", "--image", "x", "--secret", "s")
    assert code == 2 and "MODEL_URI /models/local: a path on this machine" in err


def test_apply_creates_exactly_the_objects_written_and_refuses_what_would_not_start(capsys, tmp_path, monkeypatch):
    with fake_kube(tmp_path) as (fake, kubeconfig):
        monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
        code, _, err = run_main(capsys, *TRAIN, "--apply")
        assert code == 2 and err.count("\n") == 1 and "namespace default: not on the cluster" in err, err
        fake.namespaces.add("default")
        code, _, err = run_main(capsys, *TRAIN, "--apply")
        assert code == 2 and "secret store-credentials: not in namespace default" in err, err
        assert fake.created() == []  # nothing created by a refusal
        fake.add_secret("default", "store-credentials", {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"})
        code, out, err = run_main(capsys, *TRAIN, "--apply", "--out", str(tmp_path / "written"))
        assert code == 0, err
        assert out.splitlines() == ["torchloom k8s: created service/tickets in namespace default",
                                    "torchloom k8s: created job/tickets in namespace default"]
        written = [yaml.safe_load(p.read_text()) for p in sorted((tmp_path / "written").iterdir())]
        created = fake.created()
        assert len(created) == len(written) == 2
        for obj in created:
            obj["metadata"] = {k: v for k, v in obj["metadata"].items() if k not in ("uid", "creationTimestamp")}
        assert sorted(created, key=lambda o: o["kind"]) == sorted(written, key=lambda o: o["kind"])
        code, _, err = run_main(capsys, *TRAIN, "--apply")
        assert code == 2 and "service tickets: already in namespace default; delete it" in err, err
        assert len(fake.created()) == 2
        fake.add_secret("default", "serve-secrets", {"AWS_ACCESS_KEY_ID": "k"})
        code, _, err = run_main(capsys, *SERVE, "--apply")
        assert code == 2 and "secret serve-secrets in namespace default: has no key TORCHLOOM_API_KEY" in err, err
        fake.add_secret("default", "serve-secrets", {"TORCHLOOM_API_KEY": "a-long-key"})
        code, out, err = run_main(capsys, *SERVE, "--apply")
        assert code == 0 and "created deployment/tickets-model" in out, err
        assert {o["kind"] for o in fake.created()} == {"Service", "Job", "Deployment"}


def test_apply_without_the_kubernetes_client_says_what_to_install(capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "kubernetes", None)  # `import kubernetes` raises ImportError
    out = tmp_path / "out"
    code, stdout, err = run_main(capsys, *TRAIN, "--apply", "--out", str(out))
    assert code == 2 and err.count("\n") == 1 and "pip install 'kubernetes>=" in err, err
    assert not out.exists()
    code, stdout, _ = run_main(capsys, *TRAIN)  # writing YAML needs no client
    assert code == 0 and "kind: Job" in stdout


def test_the_k8s_command_loads_no_torch_and_helps():
    code = ("import sys; from torchloom.cli import main; rc = main(['k8s', 'train', '--image', 'i',"
            " '--output.dir', 's3://b/r']); print(sorted(m for m in ('torch', 'transformers', 'ray', 'pyspark')"
            " if m in sys.modules), file=sys.stderr); sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stderr.strip() == "[]", proc.stderr
    from support.command import torchloom

    helped = torchloom("k8s", "--help", timeout=60)
    assert helped.returncode == 0 and "--gpus-per-node" in helped.stdout


# --- the serve manifest's command, run for real ---------------------------------------------------------------


@pytest.fixture(scope="module")
def exported_model(tiny_model_dir, tmp_path_factory) -> str:
    from torchloom.model.build import build_classifier
    from torchloom.model.export import export_model

    model = build_classifier(tiny_model_dir, ["sport", "money"]).eval()
    return export_model(model, tiny_model_dir, ["sport", "money"], str(tmp_path_factory.mktemp("k8s") / "model"),
                        extra_info={"max_length": 32})


def test_the_serve_pods_command_fetches_the_model_and_answers_its_probes(capsys, tmp_path, exported_model):
    """The container's command as written (the host and port aside: this test listens on 127.0.0.1), with the
    environment the pod gets (the Secret's keys included), a model on a real S3 server: the startup, liveness and
    readiness probes' paths answer 200, and SIGTERM ends it with 0 within the pod's grace period."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    from support.s3 import s3_server

    from torchloom.store import storage

    creds = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1"}
    with s3_server(tmp_path, "models", creds):
        storage.push_tree(exported_model, "s3://models/shop/model")
        objs = manifests(capsys, *SERVE[:1], "s3://models/shop/model", *SERVE[2:])
        pod = objs["Deployment"]["spec"]["template"]["spec"]
        (c,) = pod["containers"]
        port = free_port()
        command = [sys.executable, "-m", "torchloom", *c["command"][1:]]
        command[command.index("--host") + 1], command[command.index("--port") + 1] = "127.0.0.1", str(port)
        env = {**os.environ, **{e["name"]: e["value"] for e in c["env"] if "value" in e},
               "TORCHLOOM_API_KEY": "k8s-test-key-0123", "TORCHLOOM_CACHE": str(tmp_path / "cache")}
        log = open(tmp_path / "server.log", "wb")
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10)
            probes = {k: c[k]["httpGet"]["path"] for k in ("startupProbe", "livenessProbe", "readinessProbe")}
            deadline = time.monotonic() + 120
            while True:
                try:
                    if client.get(probes["readinessProbe"]).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "server.log").read_text()
                time.sleep(0.2)
            for kind, path in probes.items():
                assert client.get(path).status_code == 200, kind
            assert client.post("/v1/predict", json={"texts": ["x"]}).status_code == 401  # the key is required
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=pod["terminationGracePeriodSeconds"]) == 0
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            log.close()
        assert "stopped on SIGTERM after draining" in (tmp_path / "server.log").read_text()


def test_out_replaces_only_manifests_torchloom_wrote(capsys, tmp_path):
    """--out DIR again: its own files are replaced; a same-named file of someone else's is refused, nothing written."""
    out = tmp_path / "out"
    code, _, err = run_main(capsys, *TRAIN, "--out", str(out))
    assert code == 0, err
    written = sorted(out.iterdir())
    code, _, err = run_main(capsys, *TRAIN, "--out", str(out))  # again: replaced
    assert code == 0 and sorted(out.iterdir()) == written, err
    mine = written[0]
    mine.write_text("apiVersion: v1\nkind: ConfigMap  # mine\n")
    before = {p.name: p.read_text() for p in written}
    code, _, err = run_main(capsys, *TRAIN, "--out", str(out))
    assert code == 2 and f"{mine.name} is there and torchloom k8s did not write it; nothing written" in err, err
    assert {p.name: p.read_text() for p in written} == before


LOOP = ["loop", "--image", "registry.example/torchloom:0.1", "--secret", "loop-secrets", "--cpu", "8", "--memory",
        "32Gi", "--k8s.volume_size", "80Gi", "--", "--url", "http://topics-model", "--fleet", "topics", "--recipe",
        "/loop/champion", "--on-labels", "1000"]


def test_loop_manifests_run_one_controller_with_its_secret_and_its_work_volume(capsys):
    objs = manifests(capsys, *LOOP)
    assert set(objs) == {"Deployment", "PersistentVolumeClaim"}
    dep, pvc = objs["Deployment"], objs["PersistentVolumeClaim"]
    assert dep["metadata"]["name"] == pvc["metadata"]["name"] == "topics-loop"
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"] == {"type": "Recreate"}  # never two loops
    assert pvc["spec"]["resources"]["requests"]["storage"] == "80Gi"
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["command"] == ["torchloom", "loop", "--work", "/loop/work", "--url", "http://topics-model", "--fleet",
                            "topics", "--recipe", "/loop/champion", "--on-labels", "1000"]
    for key in ("TORCHLOOM_ADMIN_KEY", "TORCHLOOM_LOG"):  # from the Secret, never in the manifest
        assert {"name": key, "valueFrom": {"secretKeyRef": {"name": "loop-secrets", "key": key}}} in c["env"]
    assert {"name": "work", "mountPath": "/loop"} in c["volumeMounts"]
    assert {"name": "work", "persistentVolumeClaim": {"claimName": "topics-loop"}} in pod["volumes"]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    hooked = manifests(capsys, *LOOP, "--webhook-port", "9095")
    assert hooked["Service"]["spec"]["ports"][0]["targetPort"] == "webhook"
    assert hooked["Deployment"]["spec"]["template"]["spec"]["containers"][0]["command"][4:6] == ["--webhook-host",
                                                                                             "0.0.0.0"]


@pytest.mark.parametrize("args, says", [
    (LOOP + ["--log", "postgresql://u:pw@db/log"], "--log: not a flag to pass on to torchloom loop here; the log's URI"
                                                   " comes from the Secret"),
    (LOOP + ["--once"], "--once: not a flag to pass on"),
    (LOOP[:5] + ["--", "--url", "http://x", "--fleet", "x", "--recipe", "/elsewhere/run"],
     "--recipe /elsewhere/run: the pod reads the champion's run from its work volume"),
    (LOOP[:5] + ["--", "--fleet", "x"], "k8s loop: --url is missing after --"),
    (LOOP[:5], "k8s loop: give the loop's flags after --"),
    (LOOP + ["--on-labelz", "3"], "--on-labelz: not a flag of torchloom loop"),
    (["loop", "--image", "registry.example/torchloom:0.1", "--", "--url", "u", "--fleet", "x"],
     "k8s.env_from: the loop's admin key and log come from a Secret"),
], ids=["log", "once", "recipe", "url", "nothing", "unknown", "secret"])
def test_loop_refusals_are_one_line(capsys, args, says):
    code, out, err = run_main(capsys, *args)
    assert code == 2 and out == "" and err.count("\n") == 1 and says in err, err
    assert "pw" not in err


def test_apply_creates_the_loop_s_claim_and_deployment(capsys, tmp_path, monkeypatch):
    with fake_kube(tmp_path) as (fake, kubeconfig):
        monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
        fake.namespaces.add("default")
        fake.add_secret("default", "loop-secrets", {"TORCHLOOM_ADMIN_KEY": "k"})
        code, _, err = run_main(capsys, "--apply", *LOOP)
        assert code == 2 and "has no key TORCHLOOM_LOG" in err, err
        fake.add_secret("default", "loop-secrets", {"TORCHLOOM_ADMIN_KEY": "k", "TORCHLOOM_LOG": "postgresql://x"})
        code, out, err = run_main(capsys, "--apply", *LOOP)
        assert code == 0, err
        assert out.splitlines() == ["torchloom k8s: created persistentvolumeclaim/topics-loop in namespace default",
                                    "torchloom k8s: created deployment/topics-loop in namespace default"]


JOB_LOOP = [*LOOP[:5], "--nodes", "2", "--gpus-per-node", "4", "--node-selector", "pool=gpu", *LOOP[5:], "--train-on",
            "k8s", "--store", "s3://bucket/loop"]


def test_a_loop_that_trains_on_k8s_may_create_jobs_and_services_and_hands_its_pods_sizes_to_them(capsys):
    import json as jsonlib

    from torchloom.k8s.loop import TRAIN_K8S_ENV
    from torchloom.loop.candidate_job import K8S_ENV

    assert TRAIN_K8S_ENV == K8S_ENV
    objs = manifests(capsys, *JOB_LOOP)
    assert set(objs) == {"ServiceAccount", "Role", "RoleBinding", "PersistentVolumeClaim", "Deployment"}
    rules = {(r["apiGroups"][0], r["resources"][0]): set(r["verbs"]) for r in objs["Role"]["rules"]}
    assert rules == {("batch", "jobs"): {"create", "get", "delete"}, ("", "services"): {"create", "get", "delete"}}
    assert objs["RoleBinding"]["subjects"] == [{"kind": "ServiceAccount", "name": "topics-loop",
                                                "namespace": "default"}]
    pod = objs["Deployment"]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "topics-loop" and pod["automountServiceAccountToken"] is True
    assert "nodeSelector" not in pod  # the loop's pod runs anywhere; the Job's pods go to the GPU pool
    (c,) = pod["containers"]
    assert "nvidia.com/gpu" not in str(c["resources"]) and c["resources"]["requests"]["cpu"] == "8"
    given = jsonlib.loads(next(e["value"] for e in c["env"] if e["name"] == K8S_ENV))
    assert given["nodes"] == 2 and given["gpus"] == 4 and given["node_selector"] == {"pool": "gpu"}
    assert given["image"] == "registry.example/torchloom:0.1" and given["env_from"] == "loop-secrets"
    # the user's own service account (workload identity for the store) is the one bound; none is made
    objs = manifests(capsys, *JOB_LOOP[:5], "--service-account", "ml-s3", *JOB_LOOP[5:])
    assert "ServiceAccount" not in objs and objs["RoleBinding"]["subjects"][0]["name"] == "ml-s3"
    assert objs["Deployment"]["spec"]["template"]["spec"]["serviceAccountName"] == "ml-s3"
    # without --train-on k8s no pod mounts a token
    assert manifests(capsys, *LOOP)["Deployment"]["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
    code, _, err = run_main(capsys, *LOOP, "--train-on", "k8s")
    assert code == 2 and "--store (none): --train-on k8s trains the candidate in pods" in err, err


def test_the_loops_training_job_is_created_adopted_after_a_restart_refused_when_not_its_own_and_deleted(
        tmp_path, monkeypatch):
    """k8s/jobs.py against the fake API server with a kubelet that runs the pods' commands here."""
    import threading

    from support.kube_api import run_pods, set_status

    from torchloom.errors import UserError
    from torchloom.k8s.jobs import JobRun

    def objects(script: str, name: str = "topics-r1") -> list[dict]:
        service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name}, "spec": {}}
        pod = {"containers": [{"name": "trainer", "command": ["sh", "-c", script],
                               "env": [{"name": "HOME", "value": "/tmp"}]}]}
        job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name},
               "spec": {"completions": 2, "parallelism": 2, "template": {"spec": pod}}}
        return [service, job]

    said: list[str] = []
    with fake_kube(tmp_path) as (fake, kubeconfig):
        monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
        fake.namespaces.add("ml")
        started = tmp_path / "started"
        fake.kubelet = lambda f, ns, job: run_pods(f, ns, job, tmp_path)
        first = JobRun(objects(f"touch {started}-$JOB_COMPLETION_INDEX; sleep 1"), "ml", tmp_path / "j.json",
                       said.append)
        assert first.submit() == "created"
        posts = [r for r in fake.requests if r[0] == "POST"]
        # the loop restarted: the same journal adopts what it created, creates nothing more
        again = JobRun(objects("exit 0"), "ml", tmp_path / "j.json", said.append)
        assert again.submit() == "adopted" and [r for r in fake.requests if r[0] == "POST"] == posts
        # another loop (a journal of its own) never takes it over
        with pytest.raises(UserError, match="service topics-r1 in namespace ml: already there and not this loop's"):
            JobRun(objects("exit 0"), "ml", tmp_path / "other.json", said.append).submit()
        counts = again.wait(poll_s=0.2)
        assert counts["succeeded"] == 2 and {p.name for p in tmp_path.glob("started-*")} == {"started-0",
                                                                                            "started-1"}
        assert any("2 pods running" in line for line in said) and "complete (2 pods succeeded)" in said[-1]
        # a Job made again under the name by someone else is not deleted by the recorded uid
        job_uid = again.recorded()["Job"]
        store = fake.objects[("apis/batch/v1", "ml", "jobs")]
        store["topics-r1"]["metadata"]["uid"] = "someone-elses"
        with pytest.raises(UserError, match="deleting job topics-r1: the cluster answered 409"):
            again.delete()
        store["topics-r1"]["metadata"]["uid"] = job_uid
        assert again.delete() == ["job/topics-r1", "service/topics-r1"]
        assert {(r, n) for r, n, _ in fake.deleted} == {("jobs", "topics-r1"), ("services", "topics-r1")}
        assert again.delete() == []  # gone: nothing to do
        # a failed Job: one line naming the logs' command; the Job kept for a person
        failing = JobRun(objects("echo no data >&2; exit 3"), "ml", tmp_path / "f.json", said.append)
        failing.submit()
        with pytest.raises(UserError, match=r"failed \(BackoffLimitExceeded: pods exited \[3, 3\]\); its pods' logs:"
                                            r" kubectl -n ml logs -l job-name=topics-r1 --prefix; the Job is kept"):
            failing.wait(poll_s=0.2)
        assert "topics-r1" in store and "no data" in (tmp_path / "topics-r1-0.log").read_text()
        # a Job a queue holds (Kueue suspends it until admitted): said, and waited for
        fake.kubelet = None
        held = JobRun(objects("exit 0", "topics-r2"), "ml", tmp_path / "h.json", said.append)
        held.submit()
        set_status(fake, "ml", "topics-r2", {"conditions": [{"type": "Suspended", "status": "True",
                                                              "reason": "JobSuspended"}]})
        admitted = threading.Timer(0.6, set_status, (fake, "ml", "topics-r2", {
            "succeeded": 2, "conditions": [{"type": "Complete", "status": "True"}]}))
        admitted.start()
        assert held.wait(poll_s=0.1)["succeeded"] == 2
        assert any(line.endswith("0 failed, suspended (JobSuspended)") for line in said), said


def test_apply_creates_the_loop_s_identity_and_role_before_its_deployment(capsys, tmp_path, monkeypatch):
    with fake_kube(tmp_path) as (fake, kubeconfig):
        monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
        fake.namespaces.add("default")
        fake.add_secret("default", "loop-secrets", {"TORCHLOOM_ADMIN_KEY": "k", "TORCHLOOM_LOG": "postgresql://x"})
        code, out, err = run_main(capsys, "--apply", *JOB_LOOP)
        assert code == 0, err
        assert [line.split()[3] for line in out.splitlines()] == [
            "serviceaccount/topics-loop", "role/topics-loop", "rolebinding/topics-loop",
            "persistentvolumeclaim/topics-loop", "deployment/topics-loop"]
        assert ("POST", "/apis/rbac.authorization.k8s.io/v1/namespaces/default/roles") in fake.requests
