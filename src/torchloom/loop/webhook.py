"""An Alertmanager webhook for the loop (`--webhook-port`): each firing alert POSTed to it becomes an event in the
prediction log (kind "alert"), which the loop's alert trigger takes: a platform's own Prometheus rules can start a
retrain, and the alert is on record whether or not the loop was running when it came. A bearer key is asked for
where $TORCHLOOM_LOOP_WEBHOOK_KEY is set (Alertmanager's http_config authorization)."""

from __future__ import annotations

import hmac
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

KEY_ENV = "TORCHLOOM_LOOP_WEBHOOK_KEY"
MAX_BODY = 1024 * 1024


def firing(body: bytes) -> list[str]:
    """The names of the firing alerts in an Alertmanager webhook body (a ValueError for what is not one)."""
    payload = json.loads(body)
    alerts = payload.get("alerts") if isinstance(payload, dict) else None
    if not isinstance(alerts, list):
        raise ValueError('not an Alertmanager webhook body (no "alerts" list)')
    return [str((a.get("labels") or {}).get("alertname", "alert")) for a in alerts
            if isinstance(a, dict) and a.get("status", "firing") == "firing"]


def listen(log, host: str, port: int) -> ThreadingHTTPServer:
    """Serve the webhook on host:port in a thread; the server (its server_address has the port bound)."""
    key = os.environ.get(KEY_ENV, "")

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            if key and not hmac.compare_digest(self.headers.get("Authorization", ""), f"Bearer {key}"):
                return self._answer(401, "missing or wrong bearer key")
            length = int(self.headers.get("Content-Length") or 0)
            if length > MAX_BODY:
                return self._answer(413, "body too large")
            try:
                names = firing(self.rfile.read(length))
            except ValueError as e:
                return self._answer(400, str(e)[:200])
            for name in names:
                log.event("alert", "alertmanager", alert=name)
            return self._answer(200, f"{len(names)} firing alerts recorded")

        def _answer(self, code: int, message: str) -> None:
            data = json.dumps({"message": message}).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, name="loop-webhook", daemon=True).start()
    return server
