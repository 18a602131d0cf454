"""`torchloom k8s serve MODEL_URI`: a Deployment of `torchloom serve` and the Service in front of it.

What the pod relies on in the server (serve/server.py, serve/app.py):
- the model is fetched from the store at start (model_cache.py) into the pod's cache, then loaded, then warmed up;
  the HTTP server listens only once the model is loaded, so /healthz answers from then on (the startupProbe gives
  the fetch and load up to STARTUP_S), and /readyz turns 200 once the warm-up batch came back;
- GET /healthz (alive) and GET /readyz (ready, else 503) are open, and not counted in --max-connections;
- SIGTERM: the server stops accepting connections and drains what is in flight for up to
  ServeSettings.drain_timeout_s, then exits 0. Kubernetes takes a pod out of the Service's endpoints at the
  same time as it sends the SIGTERM, not before, so a preStop pause (PRESTOP_S) lets the endpoints catch up
  before the server stops listening; terminationGracePeriodSeconds covers the pause, the drain and a margin.
"""

from __future__ import annotations

import math

from torchloom.config.schema import K8sConfig
from torchloom.errors import UserError
from torchloom.k8s import manifests as m
from torchloom.serve.arguments import check_serve_flags
from torchloom.serve.settings import LOG_ENV, ServeSettings
from torchloom.uri import has_credentials, has_scheme

PORT = 8000
CONTAINER = "server"
PRESTOP_S = 5
STOP_MARGIN_S = 5
STARTUP_S = 600  # fetch, load and warm-up of a model before the liveness probe counts
HEALTH, READY = "/healthz", "/readyz"  # serve/app.py health_router
# Flags the manifest sets itself, or that would put a secret in it.
OWN_FLAGS = {"--host": "the pod listens on every address", "--port": "use --port of torchloom k8s serve",
             "--api-key": "the key comes from the Secret (TORCHLOOM_API_KEY), never the manifest",
             "--serve-with": "one server per pod; scale with --replicas", "--engine": "one server per pod"}


def flag_values(flags: list[str], name: str) -> list[str]:
    """Every value given to `name` (`--name V` or `--name=V`)."""
    out = []
    for i, flag in enumerate(flags):
        if flag == name and i + 1 < len(flags):
            out.append(flags[i + 1])
        elif flag.startswith(name + "="):
            out.append(flag.split("=", 1)[1])
    return out


def serve_manifests(model_uri: str | None, k: K8sConfig, port: int = PORT, serve_flags: list[str] | None = None
                    ) -> list[dict]:
    """The Deployment and its Service; one line before anything if the model or the settings cannot serve there.
    Several models (`-- --model A=URI --model B=URI --traffic A=90,B=10`): each on the store; the Service keeps a
    client on one pod (sessionAffinity ClientIP), where its predictions' ids are kept for its feedback."""
    m.check_image(k)
    models = flag_values(list(serve_flags or []), "--model")
    if models and model_uri:
        raise UserError(f"k8s serve: MODEL_URI {model_uri} and --model flags after --; give one model as MODEL_URI"
                        " or several as --model NAME=URI")
    if not models and not model_uri:
        raise UserError("k8s serve: give the exported model's URI on the store, e.g. s3://bucket/runs/x/model")
    names = []
    for given in models:
        name, sep, uri = given.partition("=")
        if not sep or has_scheme(name) or not name:
            raise UserError(f"--model {given}: name each model here: --model NAME=URI")
        m.check_on_store(uri, f"--model {name}")
        names.append(name)
    if models:
        from torchloom.serve.split import make_plan

        traffic = flag_values(list(serve_flags or []), "--traffic")
        shadows = [s for v in flag_values(list(serve_flags or []), "--shadow") for s in v.split(",") if s]
        make_plan(names, traffic[-1] if traffic else None, shadows)
    if model_uri:
        m.check_on_store(model_uri, "MODEL_URI")
    if not k.env_from:
        raise UserError(f"k8s.env_from: the server's API key comes from a Secret; create one with the key"
                        f" {m.API_KEY_ENV} (and the store's credentials) and pass --secret NAME")
    flags = list(serve_flags or [])
    check_serve_flags(flags)  # serve's own parser, no abbreviations (`--api KEY` would be --api-key's)
    if any(has_credentials(v) for v in flag_values(flags, "--log")):
        raise UserError(f"--log: its URI holds a password, which would be written in the manifest; put the URI in"
                        f" the Secret as {LOG_ENV} and leave --log out")
    for flag in flags:
        reason = OWN_FLAGS.get(flag.split("=", 1)[0])
        if reason:
            raise UserError(f"{flag.split('=', 1)[0]}: not a flag to pass on to torchloom serve here; {reason}")
    if not 0 < port < 65536:
        raise UserError(f"--port {port}: must be between 1 and 65535")
    source = model_uri or models[0].partition("=")[2]
    name = m.object_name(k, source, "serve")
    head = ["torchloom", "serve", *([model_uri] if model_uri else [])]
    command = [*head, "--host", "0.0.0.0", "--port", str(port), "--require-api-key",
               *(["--device", "cuda" if k.gpus else "cpu"] if not any(f.startswith("--device") for f in flags) else []),
               *flags]
    return [deployment(name, k, command, port), service(name, k, sticky=bool(models))]


def termination_grace() -> int:
    return PRESTOP_S + math.ceil(ServeSettings.drain_timeout_s) + STOP_MARGIN_S


def probes() -> dict:
    def get(path: str) -> dict:
        return {"httpGet": {"path": path, "port": "http"}}

    return {"startupProbe": {**get(HEALTH), "periodSeconds": 5, "failureThreshold": STARTUP_S // 5},
            "livenessProbe": {**get(HEALTH), "periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 3},
            "readinessProbe": {**get(READY), "periodSeconds": 5, "timeoutSeconds": 3, "failureThreshold": 2}}


def container(k: K8sConfig, command: list[str], port: int) -> dict:
    cache, cache_mount = m.cache_volume()
    api_key = {"name": m.API_KEY_ENV, "valueFrom": {"secretKeyRef": {"name": k.env_from, "key": m.API_KEY_ENV}}}
    return {"name": CONTAINER, "image": k.image, "command": command,
            "env": [*m.base_env(), api_key], "envFrom": m.env_from(k),
            "ports": [{"name": "http", "containerPort": port}],
            **({"resources": m.resources(k)} if m.resources(k) else {}),
            **probes(),
            "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_S}}},  # Kubernetes 1.30 (m.MIN_KUBERNETES)
            **m.container_security(),
            "volumeMounts": [cache_mount, *m.writable_volumes()[1]]}


def deployment(name: str, k: K8sConfig, command: list[str], port: int) -> dict:
    cache, _ = m.cache_volume()
    pod = {"terminationGracePeriodSeconds": termination_grace(), **m.placement(k), **m.pod_extras(k),
           "containers": [container(k, command, port)], "volumes": [cache, *m.writable_volumes()[0]]}
    spec = {"replicas": k.replicas, "selector": {"matchLabels": m.labels(name, "serve")},
            # a new pod is ready before an old one goes: no moment without a server
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "template": {"metadata": m.template_metadata(name, k, "serve"), "spec": pod}}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": m.metadata(name, k, "serve"), "spec": spec}


def service(name: str, k: K8sConfig, sticky: bool = False) -> dict:
    """sticky: a client's requests reach one pod (several models: its feedback finds the pod that answered)."""
    affinity = {"sessionAffinity": "ClientIP"} if sticky else {}
    return {"apiVersion": "v1", "kind": "Service", "metadata": m.metadata(name, k, "serve"),
            "spec": {"selector": m.labels(name, "serve"), **affinity,
                     "ports": [{"name": "http", "port": 80, "targetPort": "http"}]}}
