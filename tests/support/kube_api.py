"""A stateful fake of the Kubernetes API on 127.0.0.1, for `torchloom k8s ... --apply` (tests/test_k8s.py).

Namespaced objects live in memory by (API path, namespace, resource, name): a POST creates one (404 without its
namespace, 409 when it exists), a GET reads one or lists them. Namespaces and Secrets are seeded by the test.
Only what the kubernetes client sends for read, create and delete (a delete's uid precondition honoured, 409
otherwise); every request is kept in `requests`. With a `kubelet` (run_pods below), a Job created runs: its pods'
container command as processes of this machine, the Job's status following them.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

PATH = re.compile(r"^/(api/v1|apis/[a-z0-9.]+/v1)/namespaces/([^/]+)(?:/([a-z]+)(?:/([^/]+))?)?$")


class FakeKube:
    def __init__(self) -> None:
        self.namespaces: set[str] = set()
        self.objects: dict[tuple[str, str, str], dict[str, dict]] = {}
        self.requests: list[tuple[str, str]] = []
        self.lock = threading.Lock()
        self.kubelet = None  # called with (self, namespace, job) in a thread of its own for each Job created
        self.deleted: list[tuple[str, str, str]] = []  # (resource, name, uid)

    def add_secret(self, namespace: str, name: str, data: dict[str, str]) -> None:
        encoded = {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}
        self.objects.setdefault(("api/v1", namespace, "secrets"), {})[name] = {
            "apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": namespace},
            "data": encoded}

    def created(self) -> list[dict]:
        """Every object created through the API (Secrets are seeded), in the order of creation."""
        return [o for (api, _, resource), objs in self.objects.items() for o in objs.values()
                if resource != "secrets"]

    def handle(self, method: str, path: str, body: dict | None) -> tuple[int, dict]:
        self.requests.append((method, path))
        m = PATH.match(path.split("?", 1)[0])
        if not m:
            return 404, status(404, "NotFound", f"no route {path}")
        api, ns, resource, name = m.groups()
        with self.lock:
            if ns not in self.namespaces:
                return 404, status(404, "NotFound", f'namespaces "{ns}" not found')
            if resource is None:
                return 200, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns},
                             "status": {"phase": "Active"}}
            store = self.objects.setdefault((api, ns, resource), {})
            if method == "GET" and name:
                return (200, store[name]) if name in store else (404, status(404, "NotFound", f"{name} not found"))
            if method == "GET":
                return 200, {"kind": "List", "apiVersion": "v1", "metadata": {}, "items": list(store.values())}
            if method == "POST" and not name and body is not None:
                key = body["metadata"]["name"]
                if key in store:
                    return 409, status(409, "AlreadyExists", f"{key} already exists")
                created = json.loads(json.dumps(body))
                created["metadata"].update(uid=str(uuid.uuid4()), namespace=ns,
                                           creationTimestamp="2026-01-01T00:00:00Z")
                store[key] = created
                if resource == "jobs" and self.kubelet is not None:
                    threading.Thread(target=self.kubelet, args=(self, ns, created), daemon=True).start()
                return 201, created
            if method == "DELETE" and name:
                if name not in store:
                    return 404, status(404, "NotFound", f"{name} not found")
                wanted = ((body or {}).get("preconditions") or {}).get("uid")
                if wanted and wanted != store[name]["metadata"]["uid"]:
                    return 409, status(409, "Conflict", f"Precondition failed: UID in precondition: {wanted}")
                gone = store.pop(name)
                self.deleted.append((resource, name, gone["metadata"]["uid"]))
                return 200, {"kind": "Status", "apiVersion": "v1", "status": "Success"}
        return 405, status(405, "MethodNotAllowed", f"{method} {path}")


def status(code: int, reason: str, message: str) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message, "reason": reason,
            "code": code}


@contextlib.contextmanager
def fake_kube(tmp_path):
    """Yields (the fake, the path of a kubeconfig whose current context is it)."""
    fake = FakeKube()

    class Handler(BaseHTTPRequestHandler):
        def _serve(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length)) if length else None
            code, answer = fake.handle(self.command, self.path, body)
            data = json.dumps(answer).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _serve

        def log_message(self, *args) -> None:  # quiet
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": f"http://127.0.0.1:{server.server_address[1]}"}}],
        "users": [{"name": "tester", "user": {"token": "not-a-secret"}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "tester"}}]}))
    try:
        yield fake, kubeconfig
    finally:
        server.shutdown()
        server.server_close()


def run_pods(fake: FakeKube, namespace: str, job: dict, logs: Path) -> None:
    """A kubelet for an Indexed Job: each pod's container command run here, its environment as the API server and
    the kubelet would make it (the downward API's controller uid, the Secret's keys, JOB_COMPLETION_INDEX), each
    emptyDir a directory of its own, in a mount namespace of its own whose /etc/hosts names pod 0 as
    `<job>-0.<job>` (the headless Service's DNS) at 127.0.0.1. Its output goes to logs/<job>-<index>.log."""
    spec, name = job["spec"], job["metadata"]["name"]
    pod = spec["template"]["spec"]
    container = pod["containers"][0]
    emptydirs = {v["name"] for v in pod.get("volumes", []) if "emptyDir" in v}
    work = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=logs))
    hosts = work / "hosts"
    hosts.write_text(Path("/etc/hosts").read_text() + f"\n127.0.0.1 {name}-0.{name} {name}-0.{name}.{namespace}.svc\n")
    secrets = fake.objects.get(("api/v1", namespace, "secrets"), {})

    def secret(name: str) -> dict[str, str]:
        data = secrets.get(name, {}).get("data", {})
        return {k: base64.b64decode(v).decode() for k, v in data.items()}

    procs = []
    for index in range(spec["completions"]):
        mounts = {}
        for mount in container.get("volumeMounts", []):
            if mount["name"] in emptydirs:
                mounts[mount["mountPath"]] = str(work / f"pod-{index}-{mount['name']}")
                os.makedirs(mounts[mount["mountPath"]], exist_ok=True)
        # the image's programs: this interpreter's (torchrun beside it), as the image's PATH has them
        env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}
        for source in container.get("envFrom", []):
            env.update(secret(source["secretRef"]["name"]))
        for item in container.get("env", []):
            if "value" in item:
                env[item["name"]] = mounts.get(item["value"], item["value"])
            elif "fieldRef" in item["valueFrom"]:
                env[item["name"]] = job["metadata"]["uid"]  # the one field the Job's pods read: its controller uid
            else:
                ref = item["valueFrom"]["secretKeyRef"]
                env[item["name"]] = secret(ref["name"])[ref["key"]]
        env["JOB_COMPLETION_INDEX"] = str(index)
        wrapped = ["unshare", "--mount", "sh", "-c", 'mount --bind "$0" /etc/hosts && exec "$@"', str(hosts),
                   *container["command"]]
        log = open(logs / f"{name}-{index}.log", "w")  # noqa: SIM115 - closed when the pod ends
        procs.append((subprocess.Popen(wrapped, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    set_status(fake, namespace, name, {"active": len(procs)})
    codes = []
    for proc, log in procs:
        codes.append(proc.wait())
        log.close()
    ok = all(code == 0 for code in codes)
    condition = {"type": "Complete" if ok else "Failed", "status": "True",
                 **({} if ok else {"reason": "BackoffLimitExceeded", "message": f"pods exited {codes}"})}
    set_status(fake, namespace, name, {"succeeded": codes.count(0), "failed": len(codes) - codes.count(0),
                                       "conditions": [condition]})


def set_status(fake: FakeKube, namespace: str, name: str, status: dict) -> None:
    with fake.lock:
        job = fake.objects.get(("apis/batch/v1", namespace, "jobs"), {}).get(name)
        if job is not None:
            job["status"] = status
