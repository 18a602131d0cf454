"""A real MLflow tracking server on 127.0.0.1 (`mlflow server`, one worker), started and stopped by the test that
uses it: a store of its own with proxied artifacts, or an existing SQLite store (the same registry a test wrote
through sqlite://, now behind HTTP, so it can go down)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from support.net import free_port

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


class MlflowServer:
    def __init__(self, root: Path, backend: str | None = None) -> None:
        """root: its own store (mlflow.db, artifacts/) unless `backend` names one (sqlite:///...)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        root.mkdir(parents=True, exist_ok=True)
        own = ["--artifacts-destination", str(root / "artifacts")] if backend is None else []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port),
             "--backend-store-uri", backend or f"sqlite:///{root / 'mlflow.db'}", *own, "--workers", "1"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV, start_new_session=True)
        deadline = time.monotonic() + 90
        while True:
            try:
                urllib.request.urlopen(f"{self.url}/health", timeout=2).read()
                return
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    raise AssertionError("the MLflow server did not start") from None
                time.sleep(0.5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
        self.proc.wait(30)
