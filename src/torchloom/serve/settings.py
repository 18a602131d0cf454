"""What `torchloom serve` is told: one dataclass, checked before anything heavy starts."""

from __future__ import annotations

import ipaddress
import os
import re
import socket
from dataclasses import dataclass, field

from torchloom.errors import UserError

ENGINES = ("local", "ray")
RUNTIMES = ("torch", "onnx")
API_KEY_ENV = "TORCHLOOM_API_KEY"
ADMIN_KEY_ENV = "TORCHLOOM_ADMIN_KEY"
LOG_ENV = "TORCHLOOM_LOG"  # --log's store when the flag is left out (a Secret's: a URI with a password)
MODEL_NAME = re.compile(r"^[A-Za-z0-9._-]{1,64}$")  # a served model's name: it goes into headers, labels, paths


def check_model_name(name: str, where: str) -> None:
    """A model's name of letters, digits and `._-` (up to 64), else one line naming it."""
    if not MODEL_NAME.match(name or ""):
        raise UserError(f"{where} {name!r}: a model's name is up to 64 letters, digits, '.', '_' or '-' (it goes into"
                        " response headers, metric labels and logs); rename it, e.g. v2 or reviews-2026")
DEFAULT_MAX_BODY_BYTES = 4_000_000  # 4 MB: about 200 texts of 20,000 ASCII characters
DEFAULT_MAX_CONNECTIONS = 128  # requests served at once (headers in, answer not out); bodies held <= this x 4 MB
DEFAULT_READ_TIMEOUT_S = 10.0  # a request (headers and body) must arrive whole within this of its first byte


@dataclass
class ServeSettings:
    model_dir: str
    host: str = "127.0.0.1"
    port: int = 8000
    serve_with: str = "local"
    replicas: int = 1  # ray only
    max_batch_size: int = 32  # texts per model forward
    max_batch_tokens: int = 8192  # padded tokens (rows x longest) per model forward; 0: no limit
    length_bucket: int = 16  # each forward padded to a multiple of this many tokens; each bucket warmed up
    max_wait_ms: float = 5.0  # how long the oldest queued text waits for a batch to fill
    fixed_wait: bool = False  # wait max_wait_ms even when no other request is in flight (default: adaptive)
    tune: bool = True  # warm-up measures a traced forward and, on 2-3 cores, torch's threads (ServedModel.tune)
    max_queue: int = 1024  # texts accepted and waiting; more -> 429
    max_texts_per_request: int = 256
    max_text_chars: int = 20_000
    api_key: str | None = None  # bearer token for /v1/* (predict, feedback); also read from TORCHLOOM_API_KEY
    admin_key: str | None = None  # bearer token for /v1/admin (no admin route without it); TORCHLOOM_ADMIN_KEY
    model_roots: list[str] = field(default_factory=list)  # --model-root: where the admin route may load models from
    device: str = "auto"
    precision: str = "auto"
    runtime: str = "torch"  # or onnx: the exported model.onnx / model.int8.onnx on ONNX Runtime
    drain_timeout_s: float = 30.0  # after SIGTERM, in-flight requests get this long to finish
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # a larger request body -> 413, refused before it is read whole
    max_connections: int = DEFAULT_MAX_CONNECTIONS  # connections.RequestCap: past it 503 (local only)
    read_timeout_s: float = DEFAULT_READ_TIMEOUT_S  # connections.timed_protocol: past it 408, closed (local only)
    require_api_key: bool = False  # refuse to start without an API key (else: a warning when not on loopback)
    monitor: bool = True  # compare recent texts with the model's reference profile (monitor/live.py), if it has one
    monitor_window: int = 500  # texts in the monitor's window
    monitor_window_s: float = 86400.0  # and none older than this (0: no age limit)
    monitor_stale_s: float = 600.0  # a verdict with no text for this long is stale (said, not dropped)
    monitor_period_s: float = 3600.0  # the history's period: one record each
    outlier_score: bool = False  # each prediction with "outlier" (monitor/outliers.py), where the profile can
    monitor_history: str = ""  # a JSON-lines file each period's record is appended to ("": memory only)
    false_alarm: float | None = None  # the chance a window like the reference is called drift (None: the profile's)
    metrics_dir: str | None = None  # Ray: where the replicas share their metrics (set by run_ray, not a flag)
    models: dict[str, str] | None = None  # --model NAME=DIR, in order (the first is the others' yardstick); None: one
    traffic: str | None = None  # --traffic A=90,B=10 (None: an even split over the models that are not shadows)
    shadow: list[str] = field(default_factory=list)  # --shadow B: sees every text, never answers (serve/fleet.py)
    feedback_size: int = 100_000  # predictions kept for POST /v1/feedback
    min_effect: float = 0.02  # the accuracy difference the verdict is sized to find
    verdict_alpha: float = 0.05  # the chance that two equal models are ever called different
    log: str = "none"  # --log: the durable prediction and feedback log (monitor/predlog.py): a path, sqlite:///, postgresql://
    keep_texts: bool = False  # the log keeps each text (retraining on feedback needs it), else only its hash
    log_max_age_days: float = 30.0  # predictions and feedback older than this leave the log
    fleet_name: str = ""  # the log's rows are this fleet's ("": the first model's own name)

    def __post_init__(self) -> None:
        if self.api_key is None:
            self.api_key = os.environ.get(API_KEY_ENV) or None
        if self.admin_key is None:
            self.admin_key = os.environ.get(ADMIN_KEY_ENV) or None
        if self.log == "none" and os.environ.get(LOG_ENV):
            self.log = os.environ[LOG_ENV]

    @property
    def texts_per_request(self) -> int:
        """A request can never hold more texts than the queue, or it could never be accepted."""
        return min(self.max_texts_per_request, self.max_queue)

    def check(self) -> ServeSettings:
        checks = [
            (self.serve_with in ENGINES, f"--serve-with {self.serve_with}: unknown; use one of {', '.join(ENGINES)}"),
            (self.runtime in RUNTIMES, f"--runtime {self.runtime}: unknown; use one of {', '.join(RUNTIMES)}"),
            (0 <= self.port <= 65535, f"--port {self.port}: must be 0..65535 (0 picks a free port)"),
            (self.replicas >= 1, f"--replicas {self.replicas}: must be at least 1"),
            (self.max_batch_size >= 1, f"--max-batch-size {self.max_batch_size}: must be at least 1"),
            (self.length_bucket >= 1, f"--length-bucket {self.length_bucket}: must be at least 1 (1: no buckets)"),
            (self.max_wait_ms >= 0, f"--max-wait-ms {self.max_wait_ms}: must be 0 or more"),
            (self.max_batch_tokens >= 0, f"--max-batch-tokens {self.max_batch_tokens}: must be 0 (no limit) or more"),
            (self.max_queue >= 1, f"--max-queue {self.max_queue}: must be at least 1"),
            (self.max_texts_per_request >= 1,
             f"--max-texts-per-request {self.max_texts_per_request}: must be at least 1"),
            (self.max_text_chars >= 1, f"--max-text-chars {self.max_text_chars}: must be at least 1"),
            (self.max_body_bytes >= 1, f"--max-body-bytes {self.max_body_bytes}: must be at least 1"),
            (self.max_connections >= 1, f"--max-connections {self.max_connections}: must be at least 1"),
            (self.read_timeout_s > 0, f"--read-timeout {self.read_timeout_s:g}: must be more than 0 seconds"),
            (self.monitor_window >= 2, f"--monitor-window {self.monitor_window}: must be at least 2 texts"),
            (self.monitor_window_s >= 0, f"--monitor-window-s {self.monitor_window_s:g}: must be 0 (no age limit) or"
                                         " more seconds"),
            (self.monitor_stale_s > 0, f"--monitor-stale-s {self.monitor_stale_s:g}: must be more than 0 seconds"),
            (self.monitor_period_s >= 1, f"--monitor-period-s {self.monitor_period_s:g}: must be at least 1 second"),
            (self.false_alarm is None or 0 < self.false_alarm < 1,
             f"--false-alarm {self.false_alarm}: a chance, between 0 and 1 (e.g. 0.01)"),
            (self.feedback_size >= 1, f"--feedback-size {self.feedback_size}: must be at least 1"),
            (0 < self.min_effect < 1, f"--min-effect {self.min_effect}: an accuracy difference between 0 and 1"
                                      " (e.g. 0.02: two points)"),
            (0 < self.verdict_alpha < 0.5, f"--verdict-alpha {self.verdict_alpha}: a chance between 0 and 0.5 (e.g."
                                           " 0.05)"),
            (self.models is not None or (self.traffic is None and not self.shadow),
             "--traffic and --shadow name models: give them with --model NAME=DIR (one flag per model)"),
            (_good_key(self.api_key), "--api-key: use at least 8 printable ASCII characters, no surrounding spaces"
                                       " (a header carries it)"),
            (_good_key(self.admin_key), "--admin-key: use at least 8 printable ASCII characters, no surrounding"
                                         " spaces (a header carries it)"),
            (self.admin_key is None or self.admin_key != self.api_key,
             "--admin-key: must differ from --api-key (a client that may predict must not load models)"),
        ]
        for ok, message in checks:
            if not ok:
                raise UserError(message)
        self._check_log()
        if self.serve_with == "local" and self.replicas != 1:
            raise UserError(f"--replicas {self.replicas}: only --serve-with ray runs replicas; the local engine"
                            " uses one model per process (start more processes behind a load balancer)")
        for name in self.models or {}:
            check_model_name(name, "--model")
        if self.models is not None:
            from torchloom.serve.split import make_plan

            make_plan(list(self.models), self.traffic, self.shadow)
        if self.require_api_key and self.api_key is None:
            raise UserError(f"--require-api-key: no API key is set (--host {self.host}); pass --api-key KEY or set"
                            f" {API_KEY_ENV} (at least 8 characters)")
        return self

    def _check_log(self) -> None:
        """The prediction log's flags (monitor/predlog.py): one line before any model loads."""
        from torchloom.monitor.predlog import log_uri

        uri = log_uri(self.log)
        if self.log_max_age_days <= 0:
            raise UserError(f"--log-max-age-days {self.log_max_age_days:g}: must be more than 0")
        if self.keep_texts and uri is None:
            raise UserError("--keep-texts: keeps texts in the prediction log; give one with --log PATH_OR_URI")

    def exposure_warning(self) -> str | None:
        """The one warning line for a server that anyone on the network may call: bound beyond loopback
        without an API key (None when it binds loopback only, or has a key)."""
        if self.api_key is not None or is_loopback(self.host):
            return None
        return (f"torchloom serve: warning: --host {self.host} is reachable beyond this machine and no API key is set,"
                f" so anyone who reaches it can call /v1/*; set --api-key KEY or {API_KEY_ENV} (--require-api-key"
                " refuses to start without one)")


def _good_key(key: str | None) -> bool:
    return key is None or (key.strip() == key and len(key) >= 8 and key.isascii() and key.isprintable())


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or a name) reaches this machine only; "0.0.0.0", "::" and "" are every
    interface, and a name that does not resolve is taken as not loopback."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)
