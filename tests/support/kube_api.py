"""A stateful fake of the Kubernetes API on 127.0.0.1, for `torchloom k8s ... --apply` (tests/test_k8s.py).

Namespaced objects live in memory by (API path, namespace, resource, name): a POST creates one (404 without its
namespace, 409 when it exists), a GET reads one or lists them. Namespaces and Secrets are seeded by the test.
Only what the kubernetes client sends for read and create; every request is kept in `requests`.
"""

from __future__ import annotations

import base64
import contextlib
import json
import re
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PATH = re.compile(r"^/(api/v1|apis/[a-z.]+/v1)/namespaces/([^/]+)(?:/([a-z]+)(?:/([^/]+))?)?$")


class FakeKube:
    def __init__(self) -> None:
        self.namespaces: set[str] = set()
        self.objects: dict[tuple[str, str, str], dict[str, dict]] = {}
        self.requests: list[tuple[str, str]] = []
        self.lock = threading.Lock()

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
                return 201, created
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
