"""What every pod of `torchloom k8s` shares: its names, resources, placement, environment and volumes; the
checks made before anything is written; and the YAML (one document per object, or one file per object)."""

from __future__ import annotations

import re
from pathlib import Path

from torchloom.config.schema import K8sConfig
from torchloom.errors import UserError
from torchloom.uri import is_uri, redact

# RFC 1035 labels: a Service's name must be one, and the Job's pods take `<name>-<index>` as their host name.
DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
# RFC 1123 labels (a namespace) and subdomains (a service account's, a Secret's, a PriorityClass's name)
RFC1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
# a label's or an annotation's key is [prefix/]name; a label's value is a name or empty
QUALIFIED_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
MIN_KUBERNETES = "1.30"  # the oldest Kubernetes the manifests are valid for (preStop sleep; tests/test_k8s.py)
WRITABLE = {"tmp": "/tmp"}  # emptyDirs beside the cache: the root filesystem is read-only
# A Kubernetes quantity as users write them: 8, 0.5, 7500m, 64Gi, 1e3.
QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei|[eE][0-9]+)?$")
EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
GPU = "nvidia.com/gpu"  # what the NVIDIA device plugin hands out
CACHE_DIR = "/var/cache/torchloom"  # TORCHLOOM_CACHE in the pods: the staged run, the fetched model (emptyDir)
API_KEY_ENV = "TORCHLOOM_API_KEY"  # serve/settings.py reads it


def check_image(k: K8sConfig) -> None:
    """The image, and every name the manifests will carry (check_names): one line before anything is written."""
    check_names(k)
    if not k.image.strip():
        raise UserError("k8s.image: the pods need a container image with torchloom installed (the same version) and"
                        " torchrun on its PATH; pass --image REPO:TAG")


def check_on_store(uri: str, what: str) -> None:
    """Pods share no disk: what they read and write must be on an object store, named without credentials."""
    from torchloom.store import storage

    if not is_uri(uri):
        raise UserError(f"{what} {uri}: a path on this machine, which the pods do not see (they share no disk); put"
                        " it on an object store: s3://bucket/prefix, gs://..., abfs://...")
    if storage.scheme(uri) == storage.LOCAL_STORE:
        raise UserError(f"{what} {uri}: a directory on this machine used as a store, which the pods do not see;"
                        " use an object store: s3://bucket/prefix, gs://..., abfs://...")
    if redact(uri) != uri:
        raise UserError(f"{what} {redact(uri)}: credentials or a query in the URI would be written into the"
                        " manifest; give the pods the store's credentials through a Secret (--secret NAME)")


def object_name(k: K8sConfig, source: str, kind: str, reserve: int = 0) -> str:
    """k8s.name checked, or a name made of `source`'s last part (a run's, a model's): an RFC 1035 label of at most
    63 - `reserve` characters (an Indexed Job's pods append `-<index>`)."""
    limit = 63 - reserve
    if k.name:
        if not DNS_LABEL.match(k.name) or len(k.name) > limit:
            raise UserError(f"k8s.name {k.name!r}: not a name Kubernetes takes here; use at most {limit} lowercase"
                            " letters, digits and '-', starting with a letter and ending with a letter or digit")
        return k.name
    parts = [p for p in redact(source).split("://", 1)[-1].split("/") if p]
    last = "-".join(parts[-2:]) if len(parts) > 1 and parts[-1] == "model" else (parts[-1] if parts else "")
    name = re.sub(r"[^a-z0-9]+", "-", last.lower()).strip("-")
    if not name or not name[0].isalpha():
        name = f"{kind}-{name}".strip("-")
    return name[:limit].rstrip("-")


def labels(name: str, component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "torchloom", "app.kubernetes.io/instance": name,
            "app.kubernetes.io/component": component}


def metadata(name: str, k: K8sConfig, component: str) -> dict:
    """An object's metadata: its name, namespace, torchloom's labels and the user's (k8s.labels, k8s.annotations)."""
    return {"name": name, "namespace": k.namespace, "labels": {**user_labels(k), **labels(name, component)},
            **({"annotations": {str(a): str(v) for a, v in k.annotations.items()}} if k.annotations else {})}


def template_metadata(name: str, k: K8sConfig, component: str) -> dict:
    """A pod template's metadata: the labels the selector matches, and the user's labels and annotations."""
    meta = metadata(name, k, component)
    return {key: meta[key] for key in ("labels", "annotations") if key in meta}


def user_labels(k: K8sConfig) -> dict[str, str]:
    return {str(key): str(value) for key, value in k.labels.items()}


def check_names(k: K8sConfig) -> None:
    """The names the manifests carry, checked as the API server would, each a one-line refusal."""
    def fail(key: str, value: str, rule: str) -> None:
        raise UserError(f"k8s.{key} {value!r}: not a name Kubernetes takes; {rule}")

    lower = "lowercase letters, digits and '-', starting and ending with a letter or digit"
    if not RFC1123_LABEL.match(k.namespace) or len(k.namespace) > 63:
        fail("namespace", k.namespace, f"use at most 63 {lower}")
    for key in ("service_account", "priority_class"):
        value = getattr(k, key)
        if value and (not SUBDOMAIN.match(value) or len(value) > 253):
            fail(key, value, f"use at most 253 {lower} (and '.')")
    for secret in pull_secrets(k):
        if not SUBDOMAIN.match(secret) or len(secret) > 253:
            fail("image_pull_secrets", secret, f"each a Secret's name: {lower} (and '.'), comma-separated")
    if k.scheduler and (not SUBDOMAIN.match(k.scheduler) or len(k.scheduler) > 253):
        fail("scheduler", k.scheduler, f"use at most 253 {lower} (and '.')")
    for key, value in k.labels.items():
        check_key("labels", str(key))
        if str(value) and (not QUALIFIED_NAME.match(str(value)) or len(str(value)) > 63):
            fail("labels", f"{key}={value}", "a label's value is at most 63 letters, digits, '-', '_' and '.',"
                 " starting and ending with a letter or digit, or empty")
        if str(key).startswith("app.kubernetes.io/"):
            fail("labels", str(key), "torchloom sets the app.kubernetes.io/ labels itself; use another key")
    for key in k.annotations:
        check_key("annotations", str(key))


def check_key(what: str, key: str) -> None:
    """A label's or an annotation's key: [prefix/]name, the prefix a DNS subdomain, the name at most 63 characters."""
    prefix, slash, name = key.rpartition("/")
    if ((slash and (not SUBDOMAIN.match(prefix) or len(prefix) > 253)) or not QUALIFIED_NAME.match(name)
            or len(name) > 63):
        raise UserError(f"k8s.{what} {key!r}: not a key Kubernetes takes; write [prefix/]name: the name at most 63"
                        " letters, digits, '-', '_' and '.', starting and ending with a letter or digit; the prefix"
                        " a DNS subdomain (example.com)")


def pull_secrets(k: K8sConfig) -> list[str]:
    return [s.strip() for s in k.image_pull_secrets.split(",") if s.strip()]


def pod_extras(k: K8sConfig) -> dict:
    """What every pod spec takes from [k8s] beyond placement: identity, registry, priority, scheduler, and a
    restrictive securityContext (never root unless k8s.run_as_user is 0, a RuntimeDefault seccomp profile). No
    Kubernetes API token in any pod."""
    uid = k.run_as_user
    security = {"runAsNonRoot": uid != 0, "runAsUser": uid, "runAsGroup": uid, "fsGroup": uid,
                "seccompProfile": {"type": "RuntimeDefault"}}
    return {**({"serviceAccountName": k.service_account} if k.service_account else {}),
            # never the API's token: workload identity (GKE's metadata server, EKS's and AKS's webhooks) brings its
            # own projected token for the store; the one pod that calls the API is the loop's (k8s/loop.py)
            "automountServiceAccountToken": False,
            **({"imagePullSecrets": [{"name": s} for s in pull_secrets(k)]} if pull_secrets(k) else {}),
            **({"priorityClassName": k.priority_class} if k.priority_class else {}),
            **({"schedulerName": k.scheduler} if k.scheduler else {}),
            "securityContext": security}


def container_security() -> dict:
    """No privilege, no escalation, no capability, a read-only root filesystem (the cache, /tmp and /dev/shm are
    the writable volumes); the image pulled with the registry's credentials checked each time (its layers stay
    cached: only a digest is compared)."""
    return {"imagePullPolicy": "Always", "securityContext": {"allowPrivilegeEscalation": False, "privileged": False,
                                "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}}


def writable_volumes() -> tuple[list[dict], list[dict]]:
    """The emptyDirs beside the cache that a read-only root filesystem needs (Python, torch and matplotlib write
    under /tmp and $HOME, which is /tmp in the pods)."""
    return ([{"name": name, "emptyDir": {}} for name in WRITABLE],
            [{"name": name, "mountPath": path} for name, path in WRITABLE.items()])


def resources(k: K8sConfig) -> dict:
    """Requests for CPU and memory (memory also its limit: a pod over it is killed, not its neighbours), and
    the GPUs as a limit (an extended resource's request is its limit)."""
    for key in ("cpu", "memory"):
        value = getattr(k, key)
        if value and not QUANTITY.match(value):
            raise UserError(f"k8s.{key} {value!r}: not a Kubernetes quantity; write e.g. 8, 7500m, 64Gi")
    requests = {key: getattr(k, key) for key in ("cpu", "memory") if getattr(k, key)}
    limits = {**({"memory": k.memory} if k.memory else {}), **({GPU: k.gpus} if k.gpus else {})}
    return {**({"requests": requests} if requests else {}), **({"limits": limits} if limits else {})}


def tolerations(k: K8sConfig) -> list[dict]:
    """k8s.tolerations, key -> "Effect" or "value:Effect" ("" effect: every effect), as the pod spec's list."""
    out = []
    for key, spec in k.tolerations.items():
        value, _, effect = str(spec).rpartition(":")
        if effect and effect not in EFFECTS:
            raise UserError(f"k8s.tolerations {key}: effect {effect!r} is not one of {', '.join(EFFECTS)};"
                            " write KEY=Effect or KEY=value:Effect")
        toleration = {"key": key, "operator": "Equal" if value else "Exists"}
        out.append({**toleration, **({"value": value} if value else {}), **({"effect": effect} if effect else {})})
    return out


def placement(k: K8sConfig) -> dict:
    """The pod spec's nodeSelector and tolerations, where the config has any."""
    selector = {str(key): str(value) for key, value in k.node_selector.items()}
    toleration_list = tolerations(k)
    return {**({"nodeSelector": selector} if selector else {}), **({"tolerations": toleration_list}
                                                                 if toleration_list else {})}


def env_from(k: K8sConfig) -> list[dict]:
    """The Secret's keys as the container's environment: credentials by name, never their values."""
    return [{"secretRef": {"name": k.env_from}}] if k.env_from else []


def base_env() -> list[dict]:
    return [{"name": "HF_HUB_OFFLINE", "value": "1"},  # models come from the image or the store, never the hub
            {"name": "TORCHLOOM_CACHE", "value": CACHE_DIR},
            {"name": "HOME", "value": WRITABLE["tmp"]},  # a read-only root filesystem: caches under $HOME go here
            {"name": "PYTHONUNBUFFERED", "value": "1"}]  # lines reach `kubectl logs` as they are printed


def cache_volume() -> tuple[dict, dict]:
    """The volume and mount of torchloom's cache: a run staged from the store, a model fetched from it."""
    return {"name": "cache", "emptyDir": {}}, {"name": "cache", "mountPath": CACHE_DIR}


# --- YAML ----------------------------------------------------------------------------------------------------


def to_yaml(objects: list[dict]) -> str:
    """The objects as one YAML stream (`kubectl apply -f -` reads it); a multi-line string as a block."""
    import yaml

    class Dumper(yaml.SafeDumper):
        pass

    def text(dumper: yaml.SafeDumper, value: str):
        style = "|" if "\n" in value else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)

    Dumper.add_representer(str, text)
    return "".join("---\n" + yaml.dump(o, Dumper=Dumper, sort_keys=False, width=120) for o in objects)


HEADER = "# written by torchloom k8s; kubectl apply -f this directory (a file without this line is left alone)\n"


def write_files(objects: list[dict], out_dir: str) -> list[Path]:
    """One file per object, `<name>-<kind>.yaml`, in `out_dir` (`kubectl apply -f DIR` takes them all); a file of
    that name that torchloom did not write (no HEADER) is refused in one line before anything is written."""
    from torchloom.jsonio import write_atomic

    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out_dir}: a file, not a directory; name a directory to write the manifests into")
    paths = [out / f"{o['metadata']['name']}-{o['kind'].lower()}.yaml" for o in objects]
    for path in paths:
        if path.is_symlink() or (path.exists() and not _ours(path)):
            raise UserError(f"--out {out_dir}: {path.name} is there and torchloom k8s did not write it; nothing"
                            " written; move it away or pass another --out")
    out.mkdir(parents=True, exist_ok=True)
    for o, path in zip(objects, paths):
        write_atomic(path, HEADER + to_yaml([o]))
    return paths


def _ours(path: Path) -> bool:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.readline() == HEADER
    except OSError:
        return False
