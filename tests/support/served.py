"""A real `torchloom serve` in a subprocess for the tests, and the tiny exported model it serves."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def export_tiny(base: str, out: Path, labels: list[str], texts: list[str], seed: int = 0) -> str:
    """The tiny random BERT exported as a classifier of `labels` whose head tells `texts` apart."""
    import torch
    from transformers import AutoTokenizer

    from torchloom.model.build import build_classifier
    from torchloom.model.export import export_model

    torch.manual_seed(seed)
    model = build_classifier(base, labels).eval()
    # A random BERT's pooled output barely changes from text to text, so a random head gives every text the
    # same label. Centre and scale the head on sample texts so the labels differ (comparisons mean more).
    batch = AutoTokenizer.from_pretrained(base)(texts, padding=True, truncation=True, max_length=16,
                                                return_tensors="pt")
    with torch.no_grad():
        pooled = model.bert(**batch).pooler_output
        spread = pooled.std(0).clamp_min(1e-6)
        model.classifier.weight.div_(spread).mul_(3)
        model.classifier.bias.copy_(-model.classifier.weight @ pooled.mean(0))
    return export_model(model, base, labels, str(out), extra_info={"max_length": 64})


class Server:
    """`python -m torchloom serve MODEL --port 0 ...`; the URL comes from its 'listening on' line."""

    def __init__(self, model: str, *args: str, log_dir: Path, ready_timeout: float = 120,
                 local_url: bool = False, env: dict[str, str] | None = None) -> None:
        self.stdout_path, self.stderr_path = log_dir / "stdout.txt", log_dir / "stderr.txt"
        port = [] if "--port" in args else ["--port", "0"]
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            model_args = [model] if model else []  # "": the models come as --model flags
            self.proc = subprocess.Popen([sys.executable, "-m", "torchloom", "serve", *model_args, *port, *args],
                                         stdout=out, stderr=err, env={**ENV, **(env or {})},
                                         start_new_session=True)
        deadline = time.monotonic() + ready_timeout
        self.url = ""
        while not self.url:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"server did not start:\n{self.stdout()}\n{self.stderr()[-3000:]}")
            for line in self.stdout().splitlines():
                if "listening on " in line:
                    self.url = line.split("listening on ", 1)[1].split()[0]
                    if local_url:  # bound to 0.0.0.0: the test still talks to 127.0.0.1 only
                        self.url = self.url.replace("://0.0.0.0:", "://127.0.0.1:")
            time.sleep(0.1)
        import httpx

        self.client = httpx.Client(base_url=self.url, timeout=60)
        while True:
            try:
                if self.client.get("/readyz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or "warm-up failed" in self.stderr():
                self.kill()
                raise AssertionError(f"server never became ready:\n{self.stderr()[-3000:]}")
            time.sleep(0.1)

    def stdout(self) -> str:
        return self.stdout_path.read_text(errors="replace")

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def metrics(self) -> dict:
        from prometheus_client.parser import text_string_to_metric_families

        return {f.name: f for f in text_string_to_metric_families(self.client.get("/metrics").text)}

    def terminate(self, timeout: float = 60) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def sample_value(families: dict, family: str, sample: str, **labels: str) -> float:
    for s in families[family].samples:
        if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    return 0.0


def wait_for(condition, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)
