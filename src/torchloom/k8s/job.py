"""`torchloom k8s train`: an Indexed Job of one pod per node and the headless Service its rendezvous needs.

Each pod runs the command of docs/engines.md ("torchrun"), the one a user types on each node by hand:

    torchrun --nnodes N --nproc-per-node G --rdzv-backend c10d --rdzv-endpoint <job>-0.<job>:29400 \\
      --rdzv-id <the Job's uid> --max-restarts 0 -m torchloom.engines.torchrun --output.dir s3://... ...

pod 0's stable name (`<job>-0`, in the Service's subdomain) hosts the c10d rendezvous, and pod 0 is told so
(`--rdzv-conf is_host=true` from its JOB_COMPLETION_INDEX): torch would otherwise decide by resolving its own
name, which may not be published yet. The rendezvous id is the
Job's uid, which a pod that replaces another keeps: its ranks count the earlier starts on the store and resume from
the latest checkpoint (engines/worker.py), and a Job made again for the same run starts its count afresh.

Preemption: Kubernetes sends SIGTERM to the container's first process, then SIGKILL after
terminationGracePeriodSeconds. torchrun passes the SIGTERM on to its workers, which write a checkpoint within
train.preemption_grace_s and exit 75; torchrun itself then exits 1 (torch elastic ends on its own SIGTERM with
an exception). So torchrun runs under a shell whose only job is that exit code: on SIGTERM it passes the signal
to torchrun, waits for it, and exits 75, torchloom's code for "preempted, run again" (EX_TEMPFAIL). The Job's
podFailurePolicy ignores that exit code and Kubernetes' own DisruptionTarget condition (a pod preempted,
evicted, or lost with its node), so a preempted pod is replaced without counting against backoffLimit.

Restarts are the Job's, not torchrun's (`--max-restarts 0` in the pods): a peer's preemption ends every pod's ranks
preempted (a checkpoint of the step they agreed on, and the mark), so every pod exits 75 and is replaced, none
counted, and no survivor spends a restart of its own; any other failure ends the pods it reaches with torchrun's
code, counted against backoffLimit (engine.max_restarts rounds of nodes), and the replacements resume from the
latest checkpoint.
"""

from __future__ import annotations

import json
import math
import shlex

from torchloom.config import Config, to_dict, validate
from torchloom.config.engines import engine_of
from torchloom.errors import UserError
from torchloom.k8s import manifests as m
from torchloom.redaction import redact_value

RDZV_PORT = 29400
CONTAINER = "trainer"
EXIT_PREEMPTED = 75  # train/preemption.EXIT_PREEMPTED (tests/test_k8s.py holds them equal)
EXIT_MARGIN_S = 3.0  # train/preemption.EXIT_MARGIN_S: a rank still running this long past its grace ends itself
# torch elastic SIGKILLs its workers this long after it passed a SIGTERM on to them (LocalElasticAgent._shutdown)
TORCHRUN_CLOSE_S = 30.0
STOP_MARGIN_S = 5  # torchrun and the shell leaving once the workers did
UID_ENV = "TORCHLOOM_JOB_UID"
# engines/torchrun.PREEMPTED_MARKER_ENV (tests/test_k8s.py holds them equal), and the file in the pod's /tmp
PREEMPTED_MARKER_ENV = "TORCHLOOM_PREEMPTED_MARKER"
PREEMPTED_MARKER = '"${TMPDIR:-/tmp}/torchloom-preempted"'
PREEMPTED_MARK = "torchloom: preempted"  # engines/torchrun.PREEMPTED_MARK: the file's content
# The config a pod's ranks read, as flags: what `torchloom train` reads, less what the pods do not run (Spark,
# MLflow: the torchrun entry has no driver) and what the Job itself sets (engine.workers from its pods).
POD_KEYS = ("train", "engine", "model", "eval.batch_size", "eval.precision")
SET_BY_JOB = ("engine.name", "engine.workers")


def train_manifests(cfg: Config) -> list[dict]:
    """The headless Service and the Indexed Job of a training run on a store; one line before anything if the
    config cannot run there."""
    k = cfg.k8s
    m.check_image(k)
    m.check_on_store(cfg.output.dir, "output.dir")
    if not engine_of(cfg.engine).k8s_job:
        raise UserError(f"engine.name {cfg.engine.name}: `torchloom k8s train` runs torchrun in the pods; for Ray on"
                        " Kubernetes (KubeRay) or Spark on Kubernetes run `torchloom train` with"
                        " --engine.ray_address or --prepare.spark_master k8s://... (docs/engines.md, On Kubernetes)")
    nproc, world = ranks(cfg)
    grace = termination_grace(cfg.train.preemption_grace_s)
    name = m.object_name(k, cfg.output.dir, "run", reserve=1 + len(str(k.nodes - 1)))
    command = pod_command(name, cfg, nproc, world)
    return [headless_service(name, cfg), indexed_job(name, cfg, command, grace)]


def ranks(cfg: Config) -> tuple[int, int]:
    """Ranks per pod (one per GPU; without GPUs engine.workers / nodes, else 1) and in all, checked against
    engine.workers and the global batch as `torchloom train` checks them."""
    k, e = cfg.k8s, cfg.engine
    if e.device == "cuda" and not k.gpus:
        raise UserError("engine.device cuda: the pods ask for no GPU; give each pod GPUs with --gpus-per-node N")
    if k.gpus:
        nproc = k.gpus
    elif e.workers == "auto":
        nproc = 1
    elif e.workers % k.nodes:
        raise UserError(f"engine.workers {e.workers}: not a multiple of k8s.nodes {k.nodes}; every pod runs as many"
                        " ranks as the others")
    else:
        nproc = e.workers // k.nodes
    world = nproc * k.nodes
    if e.workers not in ("auto", world):
        raise UserError(f"engine.workers {e.workers}: {k.nodes} pods x {nproc} GPUs make {world} ranks; leave"
                        f" engine.workers auto or set it to {world}")
    e.workers = world
    validate(cfg)  # the global batch on this many ranks, a pipeline's stages
    return nproc, world


def termination_grace(grace_s: float) -> int:
    """terminationGracePeriodSeconds: the checkpoint's grace, a rank's margin to leave, torchrun's and the shell's.
    A grace that torchrun would cut short (it SIGKILLs its workers 30 s after passing a SIGTERM on) is refused."""
    if grace_s + EXIT_MARGIN_S > TORCHRUN_CLOSE_S:
        raise UserError(f"train.preemption_grace_s {grace_s:g}: torchrun kills its workers {TORCHRUN_CLOSE_S:g} s"
                        f" after it passes a SIGTERM on, and a rank may take {EXIT_MARGIN_S:g} s more to leave; set"
                        f" --train.preemption_grace_s {TORCHRUN_CLOSE_S - EXIT_MARGIN_S:g} or less")
    return math.ceil(grace_s + EXIT_MARGIN_S) + STOP_MARGIN_S


def flag_value(value) -> str:
    """A config value as `--section.key VALUE` takes it (config/load.py): TOML inline tables for dicts."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        items = (f"{json.dumps(str(k))} = {flag_value(v) if isinstance(v, dict | bool) else json.dumps(v)}"
                 for k, v in value.items())
        return "{" + ", ".join(items) + "}"
    return str(value)


def config_flags(cfg: Config) -> list[str]:
    """`--section.key value` for each key of POD_KEYS that differs from its default. A secret would stand in the
    manifest for anyone who can read the Job: refused, it belongs in the Secret's environment."""
    defaults, now = to_dict(Config()), to_dict(cfg)
    flags = []
    for section, table in now.items():
        for key, value in table.items():
            full = f"{section}.{key}"
            if (section not in POD_KEYS and full not in POD_KEYS) or full in SET_BY_JOB:
                continue
            if value == defaults[section][key]:
                continue
            if redact_value(key, value) != value:
                raise UserError(f"{full}: holds a secret, which would stand in the manifest; give it to the pods"
                                " through the Secret's environment (--secret NAME)")
            flags += [f"--{full}", flag_value(value)]
    return flags


def torchrun_argv(name: str, cfg: Config, nproc: int, world: int) -> tuple[list[str], list[str]]:
    """torchrun's arguments before the rendezvous's is_host (pod 0's, from its index) and after the rendezvous id
    (the Job's uid, from the environment)."""
    before = ["torchrun", "--nnodes", str(cfg.k8s.nodes), "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
              "--rdzv-endpoint", f"{name}-0.{name}:{RDZV_PORT}", "--rdzv-conf"]
    # torchrun restarts nothing in place: the Job replaces the pods (a preemption not counted, a failure counted)
    after = ["--max-restarts", "0", "-m", "torchloom.engines.torchrun",
             "--output.dir", cfg.output.dir, "--engine.workers", str(world), *config_flags(cfg)]
    return before, after


def pod_command(name: str, cfg: Config, nproc: int, world: int) -> list[str]:
    """The container's command: torchrun under a shell that turns a SIGTERM into exit 75 once torchrun is done."""
    before, after = torchrun_argv(name, cfg, nproc, world)
    script = "\n".join([
        "# SIGTERM (preemption, eviction): torchrun passes it on to the ranks, which checkpoint and exit 75;",
        "# torchrun itself exits 1 on it, so the pod says 75 (preempted: the Job replaces it, not counted)",
        f"trap 'kill -TERM \"$pid\" 2>/dev/null; wait \"$pid\"; exit {EXIT_PREEMPTED}' TERM",
        "# pod 0 hosts the rendezvous: told so, not left to find its own name in DNS (which may not be published yet)",
        'is_host=false; [ "$JOB_COMPLETION_INDEX" = 0 ] && is_host=true',
        f"export {PREEMPTED_MARKER_ENV}={PREEMPTED_MARKER}",
        f"mark='{PREEMPTED_MARK}'; marked() {{ [ \"$(cat {PREEMPTED_MARKER} 2>/dev/null)\" = \"$mark\" ]; }}",
        f"marked && rm -f {PREEMPTED_MARKER}  # an earlier attempt's mark: torchloom's, never another file",
        f"{shlex.join(before)} \"is_host=$is_host\" --rdzv-id \"${UID_ENV}\" {shlex.join(after)} &",
        "pid=$!",
        'wait "$pid"; code=$?',
        "# this pod's ranks ended preempted by a peer's notice and torchrun then failed (pod 0 went, and the",
        "# rendezvous with it): preempted too, replaced without counting; the new pods resume from the checkpoint",
        f'[ "$code" != 0 ] && marked && exit {EXIT_PREEMPTED}',
        'exit "$code"',
    ])
    return ["sh", "-c", script + "\n"]


def headless_service(name: str, cfg: Config) -> dict:
    """The pods' DNS names (`<job>-<index>.<job>`), published before they are ready: the rendezvous comes first."""
    return {"apiVersion": "v1", "kind": "Service", "metadata": m.metadata(name, cfg.k8s, "train"),
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                     "selector": m.labels(name, "train"),
                     "ports": [{"name": "rdzv", "port": RDZV_PORT, "targetPort": RDZV_PORT}]}}


def failure_policy() -> dict:
    """A preempted pod is not a failure: Kubernetes' DisruptionTarget, or the shell's exit 75 after a SIGTERM."""
    return {"rules": [
        {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
        {"action": "Ignore", "onExitCodes": {"containerName": CONTAINER, "operator": "In",
                                             "values": [EXIT_PREEMPTED]}},
    ]}


def indexed_job(name: str, cfg: Config, command: list[str], grace: int) -> dict:
    k = cfg.k8s
    spec = {
        "completionMode": "Indexed", "completions": k.nodes, "parallelism": k.nodes,
        # A failure on one pod can fail them all (losing pod 0 loses the rendezvous): max_restarts rounds of nodes.
        "backoffLimit": cfg.engine.max_restarts * k.nodes,
        "podFailurePolicy": failure_policy(),
        "podReplacementPolicy": "Failed",  # a replacement starts once the pod it replaces is gone: one <job>-0
        **({"activeDeadlineSeconds": k.active_deadline_s} if k.active_deadline_s else {}),
        **({"ttlSecondsAfterFinished": k.ttl_after_finished_s} if k.ttl_after_finished_s else {}),
        "template": {"metadata": m.template_metadata(name, k, "train"), "spec": pod_spec(name, cfg, command, grace)},
    }
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": m.metadata(name, k, "train"), "spec": spec}


def pod_spec(name: str, cfg: Config, command: list[str], grace: int) -> dict:
    k = cfg.k8s
    cache, cache_mount = m.cache_volume()
    env = [{"name": "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "value": "1"},  # docs/engines.md, "torchrun"
           *m.base_env(),
           {"name": UID_ENV, "valueFrom": {"fieldRef": {
               "fieldPath": "metadata.labels['batch.kubernetes.io/controller-uid']"}}}]
    writable, writable_mounts = m.writable_volumes()
    container = {"name": CONTAINER, "image": k.image, "command": command, "env": env,
                 **({"envFrom": m.env_from(k)} if k.env_from else {}),
                 "ports": [{"name": "rdzv", "containerPort": RDZV_PORT}],
                 **({"resources": m.resources(k)} if m.resources(k) else {}),
                 **m.container_security(),
                 "volumeMounts": [cache_mount, {"name": "dshm", "mountPath": "/dev/shm"}, *writable_mounts]}
    return {"restartPolicy": "Never",  # the Job replaces a failed pod; podFailurePolicy needs Never
            "subdomain": name, "terminationGracePeriodSeconds": grace, **m.placement(k), **m.pod_extras(k),
            "containers": [container],
            # NCCL and the data loader's workers share memory through /dev/shm: 64 MB by default in a container
            "volumes": [cache, {"name": "dshm", "emptyDir": {"medium": "Memory"}}, *writable]}
