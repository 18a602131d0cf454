"""`--apply`: the manifests created through the Kubernetes API with the `kubernetes` client (the k8s extra).

Before anything is created: the namespace exists, the Secret the pods read exists (with the keys they need), and
none of the objects does. Each refusal is one line that says what to create or delete. The cluster is the one
of the kubeconfig (KUBECONFIG, ~/.kube/config, its current context), or the pod's own service account inside one.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from torchloom.config.schema import K8sConfig
from torchloom.errors import UserError, missing_extra

TIMEOUT_S = 15  # per API request


def client_module():
    try:
        import kubernetes
    except ImportError:
        raise missing_extra("kubernetes", "k8s") from None
    return kubernetes


def api_client(kubernetes):
    """An ApiClient for the kubeconfig's current context, else the pod's service account."""
    from kubernetes import client, config

    configuration = client.Configuration()
    try:
        # $KUBECONFIG read now (the client reads it once, when first imported)
        config.load_kube_config(config_file=os.environ.get("KUBECONFIG") or None, client_configuration=configuration)
    except Exception as kubeconfig_error:  # no file, no context, a malformed file: ConfigException or OSError
        try:
            config.load_incluster_config(client_configuration=configuration)
        except config.ConfigException:
            raise UserError(f"--apply: no cluster to submit to: no usable kubeconfig ({kubeconfig_error}) and not"
                            " inside a pod; set KUBECONFIG or write the manifests (--out DIR) and"
                            " `kubectl apply -f DIR`") from None
    configuration.retries = 1
    return client.ApiClient(configuration)


def call(what: str, fn: Callable, *args, missing_ok: bool = False, who: str = "--apply", **kwargs):
    """One API request; None for a 404 where `missing_ok`; any other failure one line naming `what` (after `who`)."""
    from kubernetes.client.exceptions import ApiException

    try:
        return fn(*args, _request_timeout=TIMEOUT_S, **kwargs)
    except ApiException as e:
        if e.status == 404 and missing_ok:
            return None
        raise UserError(f"{who}: {what}: the cluster answered {e.status} {e.reason}") from None
    except Exception as e:  # urllib3's connection errors and the like
        host = getattr(getattr(fn, "__self__", None), "api_client", None)
        where = host.configuration.host if host is not None else "the cluster"
        raise UserError(f"{who}: {what}: cannot reach {where} ({type(e).__name__})") from None


def check_secret(core, namespace: str, name: str, keys: tuple[str, ...]) -> None:
    secret = call(f"reading secret {name}", core.read_namespaced_secret, name, namespace, missing_ok=True)
    if secret is None:
        raise UserError(f"secret {name}: not in namespace {namespace}; create it first (kubectl -n {namespace} create"
                        f" secret generic {name} --from-env-file=FILE) or pass --secret with another")
    missing = [key for key in keys if key not in (secret.data or {}) and key not in (secret.string_data or {})]
    if missing:
        raise UserError(f"secret {name} in namespace {namespace}: has no key {', '.join(missing)}; add it (kubectl -n"
                        f" {namespace} edit secret {name})")


def apply(objects: list[dict], k: K8sConfig, secret_keys: tuple[str, ...] = ()) -> list[str]:
    """Create `objects` in k.namespace once the checks pass; the lines that say what was created."""
    kubernetes = client_module()
    api = api_client(kubernetes)
    core = kubernetes.client.CoreV1Api(api)
    calls = {"Service": (core.read_namespaced_service, core.create_namespaced_service),
             "Job": (kubernetes.client.BatchV1Api(api).read_namespaced_job,
                     kubernetes.client.BatchV1Api(api).create_namespaced_job),
             "Deployment": (kubernetes.client.AppsV1Api(api).read_namespaced_deployment,
                            kubernetes.client.AppsV1Api(api).create_namespaced_deployment),
             "PersistentVolumeClaim": (core.read_namespaced_persistent_volume_claim,
                                       core.create_namespaced_persistent_volume_claim)}
    rbac = kubernetes.client.RbacAuthorizationV1Api(api)
    calls.update({"ServiceAccount": (core.read_namespaced_service_account, core.create_namespaced_service_account),
                  "Role": (rbac.read_namespaced_role, rbac.create_namespaced_role),
                  "RoleBinding": (rbac.read_namespaced_role_binding, rbac.create_namespaced_role_binding)})
    ns = k.namespace
    if call(f"reading namespace {ns}", core.read_namespace, ns, missing_ok=True) is None:
        raise UserError(f"namespace {ns}: not on the cluster; create it (kubectl create namespace {ns}) or pass"
                        " --namespace with another")
    if k.env_from:
        check_secret(core, ns, k.env_from, secret_keys)
    for o in objects:
        kind, name = o["kind"], o["metadata"]["name"]
        if call(f"reading {kind.lower()} {name}", calls[kind][0], name, ns, missing_ok=True) is not None:
            raise UserError(f"{kind.lower()} {name}: already in namespace {ns}; delete it (kubectl -n {ns} delete"
                            f" {kind.lower()} {name}) or pass --name with another")
    done: list[str] = []
    for o in objects:
        kind, name = o["kind"], o["metadata"]["name"]
        what = f"creating {kind.lower()} {name}" + (f" (after {', '.join(done)})" if done else "")
        call(what, calls[kind][1], ns, o)
        done.append(f"{kind.lower()}/{name}")
    return [f"created {d} in namespace {ns}" for d in done]
