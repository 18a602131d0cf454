"""`torchloom k8s loop -- LOOP FLAGS`: the loop's controller (torchloom.loop) as a Deployment of one pod, beside the
`torchloom k8s serve` Deployment it watches.

- One pod, `Recreate`: two loops of one fleet would act on the same state (controller.py), so an update stops the
  old pod before the new one starts.
- Its state is the prediction log's events, in the PostgreSQL every serve pod writes to: TORCHLOOM_LOG from the
  Secret (the URI holds a password: never in the manifest), and the admin key TORCHLOOM_ADMIN_KEY from it too.
- Its work (snapshots, the candidates' runs) is on a PersistentVolumeClaim mounted at WORK_DIR, so a restarted pod
  takes up the cycle where the events say; the champion's run (the recipe: its config.toml and prepared data) is
  read from there too (`--recipe /loop/champion`, copied or trained there). The candidate trains in the pod with
  the recipe's engine (a Spark or Ray cluster's, where the recipe names one; else the pod's CPUs or GPUs:
  --cpu, --memory, --gpus-per-node size it).
- SIGTERM stops it between steps, a candidate's training with it; the grace period lets that finish.
- With --webhook-port, a Service in front of it for Alertmanager (the pod listens on every address).
- With `--train-on k8s --store s3://...` after --, the candidate trains as the Indexed Job `torchloom k8s train`
  writes (loop/candidate_job.py), created by the loop's pod: --nodes, --gpus-per-node, --cpu and --memory size
  the Job's pods (the loop's own pod asks for the CPU and memory, never a GPU), the image, namespace, Secret and
  placement are theirs too ($TORCHLOOM_TRAIN_K8S). The loop's pod is then the one pod that mounts an API token:
  its service account (--service-account, else one of its own) is bound to a Role that may create, read and
  delete Jobs and Services in its namespace, nothing more; the Job's pods mount none.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from torchloom.config.schema import K8sConfig
from torchloom.errors import OneLineArgs, UserError
from torchloom.k8s import manifests as m

WORK_DIR = "/loop"
CONTAINER = "loop"
ADMIN_KEY_ENV, LOG_ENV = "TORCHLOOM_ADMIN_KEY", "TORCHLOOM_LOG"  # serve/settings.py's, loop/server.py's
GRACE_S = 120
TRAIN_K8S_ENV = "TORCHLOOM_TRAIN_K8S"  # loop/candidate_job.K8S_ENV (tests/test_k8s.py holds them equal)
JOB_KEYS = ("image", "namespace", "nodes", "gpus", "cpu", "memory", "node_selector", "tolerations", "env_from",
            "service_account", "image_pull_secrets", "labels", "annotations", "priority_class", "scheduler",
            "active_deadline_s", "ttl_after_finished_s", "run_as_user")
OWN_FLAGS = {"--work": f"the work volume is mounted at {WORK_DIR}: the manifest sets --work",
             "--log": f"the log's URI comes from the Secret ({LOG_ENV}), never the manifest",
             "--once": "the Deployment runs the loop until it is stopped", "--admin-key-env": "the Secret's"
             f" {ADMIN_KEY_ENV} is the admin key", "--webhook-host": "the pod listens on every address"}


def loop_flags(flags: list[str]) -> argparse.Namespace:
    """The flags as `torchloom loop` reads them (no abbreviations); one line naming what is wrong."""
    from torchloom.loop.arguments import add_loop_arguments, check_where

    for flag in flags:
        reason = OWN_FLAGS.get(flag.split("=", 1)[0])
        if reason:
            raise UserError(f"{flag.split('=', 1)[0]}: not a flag to pass on to torchloom loop here; {reason}")
    if "--fleet" not in [f.split("=", 1)[0] for f in flags]:
        raise UserError("k8s loop: give the loop's flags after --, at least --url http://SERVICE --fleet NAME"
                        f" --recipe {WORK_DIR}/champion")
    parser = OneLineArgs(prog="torchloom loop", allow_abbrev=False, exit_on_error=False, add_help=False)
    add_loop_arguments(parser)
    known = {o for a in parser._actions for o in a.option_strings}
    unknown = [f.split("=", 1)[0] for f in flags if f.startswith("-") and f.split("=", 1)[0] not in known]
    if unknown:
        raise UserError(f"{', '.join(unknown[:3])}: not a flag of torchloom loop; see torchloom loop --help")
    try:
        args, unknown = parser.parse_known_args(flags)
    except argparse.ArgumentError as e:
        raise UserError(f"{e.argument_name or 'torchloom loop'}: {e.message.split(':')[0]}; see torchloom loop"
                        " --help") from None
    if unknown:
        raise UserError(f"{', '.join(unknown[:3])}: not a flag of torchloom loop; see torchloom loop --help")
    check_where(args)
    if args.action != "run":
        raise UserError(f"k8s loop: {args.action} is run by hand (kubectl exec), not as the Deployment")
    for flag, value in (("--url", args.url), ("--recipe", args.recipe)):
        if not value:
            raise UserError(f"k8s loop: {flag} is missing after --; the Service of torchloom k8s serve (e.g. --url"
                            f" http://topics-model) and the champion's run on the work volume (--recipe"
                            f" {WORK_DIR}/champion)")
    if not args.recipe.startswith(WORK_DIR + "/"):
        raise UserError(f"--recipe {args.recipe}: the pod reads the champion's run from its work volume; copy it"
                        f" under {WORK_DIR}/ and give that path")
    return args


def loop_manifests(k: K8sConfig, flags: list[str]) -> list[dict]:
    """The PersistentVolumeClaim, the Deployment, and with a webhook its Service."""
    m.check_image(k)
    if not k.env_from:
        raise UserError(f"k8s.env_from: the loop's admin key and log come from a Secret; create one with the keys"
                        f" {ADMIN_KEY_ENV} and {LOG_ENV} (postgresql://..., the serve pods' --log) and pass --secret"
                        " NAME")
    if not m.QUANTITY.match(k.volume_size or ""):
        raise UserError(f"k8s.volume_size {k.volume_size!r}: not a Kubernetes quantity; write e.g. 50Gi")
    args = loop_flags(list(flags))
    name = m.object_name(k, args.fleet, "loop", reserve=5)
    name = name if name.endswith("-loop") else f"{name}-loop"
    hook = ["--webhook-host", "0.0.0.0"] if args.webhook_port else []
    command = ["torchloom", "loop", "--work", f"{WORK_DIR}/work", *hook, *flags]
    jobs = args.train_on == "k8s"
    access = job_access(name, k) if jobs else []
    objects = [*access, claim(name, k), deployment(name, k, command, args.webhook_port, jobs)]
    if args.webhook_port:
        objects.append({"apiVersion": "v1", "kind": "Service", "metadata": m.metadata(name, k, "loop"),
                        "spec": {"selector": m.labels(name, "loop"),
                                 "ports": [{"name": "webhook", "port": 80, "targetPort": "webhook"}]}})
    return objects


def claim(name: str, k: K8sConfig) -> dict:
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": m.metadata(name, k, "loop"),
            "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": k.volume_size}}}}


def job_access(name: str, k: K8sConfig) -> list[dict]:
    """The loop pod's identity and what it may do: Jobs and Services in its namespace, created, read, deleted."""
    rules = [{"apiGroups": ["batch"], "resources": ["jobs"], "verbs": ["create", "get", "delete"]},
             {"apiGroups": [""], "resources": ["services"], "verbs": ["create", "get", "delete"]}]
    account = k.service_account or name
    own = [] if k.service_account else [{"apiVersion": "v1", "kind": "ServiceAccount",
                                          "metadata": m.metadata(name, k, "loop")}]
    rbac = "rbac.authorization.k8s.io"
    return [*own,
            {"apiVersion": f"{rbac}/v1", "kind": "Role", "metadata": m.metadata(name, k, "loop"), "rules": rules},
            {"apiVersion": f"{rbac}/v1", "kind": "RoleBinding", "metadata": m.metadata(name, k, "loop"),
             "roleRef": {"apiGroup": rbac, "kind": "Role", "name": name},
             "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": k.namespace}]}]


def deployment(name: str, k: K8sConfig, command: list[str], webhook_port: int, jobs: bool = False) -> dict:
    cache, cache_mount = m.cache_volume()
    secret = [{"name": key, "valueFrom": {"secretKeyRef": {"name": k.env_from, "key": key}}}
              for key in (ADMIN_KEY_ENV, LOG_ENV)]
    train = [{"name": TRAIN_K8S_ENV, "value": json.dumps({key: getattr(k, key) for key in JOB_KEYS})}] if jobs else []
    # the Job's pods get the GPUs and the placement (GPU nodes); the loop's own pod runs anywhere
    own = dataclasses.replace(k, gpus=0, node_selector={}, tolerations={}) if jobs else k
    container = {"name": CONTAINER, "image": k.image, "command": command, "env": [*m.base_env(), *secret, *train],
                 "envFrom": m.env_from(k),
                 **({"ports": [{"name": "webhook", "containerPort": webhook_port}]} if webhook_port else {}),
                 **({"resources": m.resources(own)} if m.resources(own) else {}), **m.container_security(),
                 "volumeMounts": [cache_mount, {"name": "work", "mountPath": WORK_DIR}, *m.writable_volumes()[1]]}
    extras = m.pod_extras(k)
    if jobs:  # the one pod with an API token: it creates the training Jobs (job_access)
        extras.update(serviceAccountName=k.service_account or name, automountServiceAccountToken=True)
    pod = {"terminationGracePeriodSeconds": GRACE_S, **m.placement(own), **extras, "containers": [container],
           "volumes": [cache, {"name": "work", "persistentVolumeClaim": {"claimName": name}},
                       *m.writable_volumes()[0]]}
    spec = {"replicas": 1, "selector": {"matchLabels": m.labels(name, "loop")},
            "strategy": {"type": "Recreate"},  # never two loops of one fleet at once
            "template": {"metadata": m.template_metadata(name, k, "loop"), "spec": pod}}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": m.metadata(name, k, "loop"), "spec": spec}
