"""Debian's real Prometheus (apt-get installed where missing), scraping one target every second with given rules,
on a free port of 127.0.0.1; started and stopped by the test that uses it."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

from support.debian import ensure
from support.net import free_port


class Prometheus:
    def __init__(self, target: str, rules: Path, root: Path) -> None:
        binary = ensure("prometheus", "prometheus")
        self.port = free_port()
        config = root / "prometheus.yml"
        config.write_text(json.dumps({  # YAML is a superset of JSON
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(rules)],
            "scrape_configs": [{"job_name": "torchloom", "static_configs": [{"targets": [target]}]}]}))
        self.log = root / "prometheus.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={root / 'data'}",
                                          f"--web.listen-address=127.0.0.1:{self.port}"],
                                         stdout=log, stderr=subprocess.STDOUT)
        import httpx

        self.client = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=10)
        self.wait(lambda: self._ready(), 60, "Prometheus never became ready")

    def _ready(self) -> bool:
        import httpx

        assert self.proc.poll() is None, self.log.read_text()[-3000:]
        try:
            return self.client.get("/-/ready").status_code == 200
        except httpx.TransportError:
            return False

    def wait(self, condition, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert time.monotonic() < deadline, f"{what}:\n{self.log.read_text()[-2000:]}"
            time.sleep(0.25)

    def query(self, expr: str) -> list[dict]:
        body = self.client.get("/api/v1/query", params={"query": expr}).json()
        assert body["status"] == "success", body
        return body["data"]["result"]

    def alert_state(self, name: str) -> str:
        """The alert's state as Prometheus' rule manager has it: inactive, pending or firing."""
        for group in self.client.get("/api/v1/rules").json()["data"]["groups"]:
            for rule in group["rules"]:
                if rule.get("name") == name:
                    return rule["state"]
        raise AssertionError(f"no rule {name} loaded")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
