"""`torchloom serve --serve-with local`: one process, uvicorn, the micro-batcher, one model thread.

SIGTERM (or Ctrl+C): uvicorn stops accepting connections and waits up to `drain_timeout_s` for the
requests in flight; then the batcher finishes what is queued and the process exits 0.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import socket
import sys
from typing import Any

from torchloom.errors import UserError, missing_extra
from torchloom.machine import usable_cores
from torchloom.model.served import ServedModel
from torchloom.serve.batcher import MicroBatcher
from torchloom.serve.metrics import ServeMetrics, fleet_families
from torchloom.serve.settings import ServeSettings

log = logging.getLogger("torchloom.serve")


class LocalBackend:
    """The model behind a MicroBatcher; ready once the warm-up has run."""

    def __init__(self, model: ServedModel, settings: ServeSettings, metrics: ServeMetrics | None = None,
                 nice: int = 0) -> None:
        """metrics: the server's, where several models share it (serve/fleet.py); nice: the model thread's."""
        from torchloom.monitor.live import load_monitor, outlier_scorer

        self.model = model
        self.identity = model.identity
        # against this model's own profile: a fleet's models each have theirs
        self.monitor, self.monitor_off, self.monitor_line = load_monitor(settings, model.model_dir, model.labels,
                                                                          model.identity.name, model.predictor)
        model.signals = self.monitor is not None
        self.outliers = outlier_scorer(settings, self.monitor, model.identity.name)
        self.metrics = metrics or ServeMetrics(queue_depth=lambda: self.batcher.queue_depth,
                                               monitor=lambda: [((self.identity.name, self.identity.version),
                                                                 self.monitor_report())],
                                               queue_capacity=settings.max_queue)
        self.batcher = MicroBatcher(model.predict_encoded, settings.max_batch_size, settings.max_wait_ms,
                                    settings.max_queue, self.metrics, adaptive_wait=not settings.fixed_wait,
                                    encode=model.encode, cost=model.cost, max_batch_tokens=settings.max_batch_tokens,
                                    encode_workers=usable_cores(), nice=nice)
        self.tune = settings.tune
        self._ready = False
        self._warm_up_task: asyncio.Task | None = None

    @property
    def ready(self) -> bool:
        return self._ready

    def monitor_report(self) -> dict[str, Any]:
        return self.monitor.current() if self.monitor is not None else self.monitor_off

    async def start(self) -> None:
        await self.batcher.start()
        if self.monitor is not None:
            self.monitor.start()
        # Warm up after the socket listens: /healthz answers at once, /readyz once this is done.
        self._warm_up_task = asyncio.get_running_loop().create_task(self._warm_up())

    async def _warm_up(self) -> None:
        try:
            # Through the path every request takes (the batcher, its model thread, predict): a short batch
            # and one full-length text, so neither the first client nor the first long text pays for lazy
            # initialisation. /readyz turns 200 only after both came back.
            await self.batcher.submit(["warm up"] * min(self.batcher.max_batch_size, self.batcher.max_queue, 8))
            await self.batcher.submit(["warm up " * self.model.max_length])
            # then every length bucket once, at the most rows a batch of that length holds, on the model thread
            if self.tune:
                for line in await self.batcher.run_in_worker(self.model.tune, self.batcher.max_batch_size,
                                                             self.batcher.max_batch_tokens, usable_cores()):
                    log.info("warm-up: %s", line)
            lengths = await self.batcher.run_in_worker(self.model.warm_up_buckets, self.batcher.max_batch_size,
                                                       self.batcher.max_batch_tokens)
            for length in lengths:
                self.metrics.warm_up_batches.inc(str(length))
        except Exception:
            log.exception("warm-up failed; /readyz stays 503")
            return
        # Everything loaded so far (torch, transformers, the model: millions of objects) lives as long as the
        # process: out of the collector's sight, a collection walks only what requests make (full collections
        # over the whole heap were 1/5 of the event loop's time, and its p99, with the tiny model at c=64)
        gc.collect()
        gc.freeze()
        self._ready = True
        log.info("ready: %s %s", self.identity.name, self.identity.version)

    async def stop(self) -> None:
        self._ready = False
        await self.batcher.close()

    fleet = None  # one model (api_common.Backend)

    @property
    def queued(self) -> int:
        """Texts this model's queue holds now."""
        return self.batcher.queue_depth

    def room(self) -> int:
        """Texts the queue takes now."""
        return self.batcher.max_queue - self.batcher.queue_depth

    async def warmed(self) -> bool:
        """Wait for the warm-up; whether it succeeded."""
        if self._warm_up_task is not None:
            await self._warm_up_task
        return self._ready

    async def predict(self, texts: list[str], items: list[Any] | None = None,
                      on_items: Any = None) -> list[dict[str, Any]]:
        """items, on_items: MicroBatcher.submit's (a shadow tokenized once)."""
        answers = await self.batcher.submit(texts, items, on_items)
        if self.monitor is not None and self._ready:  # not the warm-up's texts
            self.monitor.observe(answers)
        if self.outliers is not None:
            from torchloom.monitor.outliers import score_answers

            score_answers(self.outliers, answers)
        return answers


def configure_logging() -> None:
    logger = logging.getLogger("torchloom.serve")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


def listen(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (port 0: a free one), or a UserError that says why not."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise UserError(f"--host {host}: cannot resolve it ({e.strerror})") from None
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise UserError(f"--port {port}: cannot listen on {host}:{port} ({e.strerror}); pick another --port"
                        " (0 picks a free one)") from None
    sock.listen(2048)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def uvicorn_config(app: Any, settings: ServeSettings) -> Any:
    """The uvicorn config of the local server (benchmarks/serve_front.py serves its bare endpoint with it too)."""
    import uvicorn

    from torchloom.serve.connections import timed_protocol

    # Not uvicorn's limit_concurrency: it counts half-sent and idle connections, which a slow client can hold
    # for ever (connections.py). The app caps the requests it serves; the protocol drops what arrives too slowly.
    return uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on", server_header=False,
                          timeout_graceful_shutdown=settings.drain_timeout_s,
                          http=timed_protocol(settings.read_timeout_s))


def model_threads(device: str, cores: int) -> int:
    """torch's threads for the model thread: on a CPU of 4 cores or more all but one, which the event loop and the
    tokenizers need (with every core, torch's spinning workers and the front end took turns: with the tiny model at
    c=64 on 2 shared cores, 96 to 854 requests/s against 800 with one thread, docs/benchmarks.md). With 2 or 3
    cores the model gets them all here, and the warm-up measures whether one fewer serves more (ServedModel.tune:
    MiniLM keeps both of 2 cores, the tiny model gets 1). On a GPU the cores are the front end's anyway."""
    return max(1, cores - 1) if device == "cpu" and cores >= 4 else cores


SHADOW_NICE = 10  # a shadow's model thread: the cores go first to the model whose answers clients wait for


def local_member(name: str | None, path: str, settings: ServeSettings, threads: int, metrics: ServeMetrics | None,
                 nice: int = 0):
    """One model of the server: loaded, behind its own batcher (not started); named `name`, else its own name."""
    from torchloom.serve.fleet import Member

    model = ServedModel(path, device=settings.device, precision=settings.precision,
                        batch_size=settings.max_batch_size, threads=threads, runtime=settings.runtime,
                        length_bucket=settings.length_bucket)
    if model.warning:
        print(f"torchloom serve: warning: {model.warning}", file=sys.stderr, flush=True)
    backend = LocalBackend(model, settings, metrics, nice)
    label = name or model.identity.name
    print(f"torchloom serve: {'' if name is None else f'{name}: '}{backend.monitor_line}", file=sys.stderr, flush=True)
    return Member(label, path, backend, model.encoding_key())


def local_fleet(settings: ServeSettings, threads: int):
    """The server's models behind one Fleet (serve/fleet.py), sharing one ServeMetrics; the admin route loads
    more with local_member, warmed up before they take traffic."""
    from torchloom.serve.fleet import Fleet
    from torchloom.serve.split import make_plan

    models = settings.models or {None: settings.model_dir}
    plan = make_plan(list(models), settings.traffic, settings.shadow) if settings.models else None
    holder: list[Fleet] = []
    metrics = ServeMetrics(queue_depth=lambda: holder[0].queued,
                           monitor=lambda: holder[0].monitor_reports(), queue_capacity=settings.max_queue)
    members = [local_member(name, path, settings, threads, metrics,
                            SHADOW_NICE if plan and name in plan.shadows else 0) for name, path in models.items()]
    if plan is None:
        from torchloom.serve.split import Plan

        plan = Plan({members[0].name: 100.0})

    async def load(name: str, path: str):
        import asyncio

        member = await asyncio.to_thread(local_member, name, path, settings, threads, metrics)
        await member.backend.start()
        if not await member.backend.warmed():
            await member.backend.stop()
            raise UserError(f"model {name} ({path}): its warm-up failed; the server log has why")
        return member

    fleet = Fleet(members, plan, metrics, settings.feedback_size, settings.verdict_alpha, settings.min_effect,
                  load=load, log=open_log(settings, members[0].identity.name))
    deployment(fleet, settings, models)
    holder.append(fleet)
    metrics.extra = fleet_families(fleet)
    return fleet


def deployment(fleet, settings: ServeSettings, models: dict) -> None:
    """The start-up models' sources (where another server reads them: a store's or registry's URI) and, with a log,
    the deployment the fleet's other servers share (serve/fleet_sync.py)."""
    from torchloom.serve.fleet_sync import epoch
    from torchloom.uri import is_uri, redact

    for name, path in models.items():
        member = fleet.members.get(name) if name is not None else fleet.members[fleet.order[0]]
        if member is not None and not member.source and (is_uri(path) or str(path).startswith("models:/")):
            member.source = redact(str(path))
    if fleet.log is not None:
        fleet.epoch = epoch(models, settings.traffic, settings.shadow)


def open_log(settings: ServeSettings, first_name: str):
    """The fleet's durable log (monitor/predlog.py) as --log gives it, or None."""
    from torchloom.monitor.predlog import PredictionLog, log_uri

    uri = log_uri(settings.log)
    if uri is None:
        return None
    log = PredictionLog(uri, settings.fleet_name or first_name, settings.keep_texts,
                        settings.log_max_age_days * 86400.0)
    print(f"torchloom serve: prediction log {log.where} (fleet {log.fleet}, texts"
          f" {'kept' if settings.keep_texts else 'hashed'}, {settings.log_max_age_days:g} days)", file=sys.stderr,
          flush=True)
    return log


def run_local(settings: ServeSettings) -> int:
    """Serve until SIGTERM/SIGINT; returns the exit code."""
    try:
        import uvicorn

        from torchloom.serve.app import body_limit_for, create_app
    except ImportError as e:
        raise missing_extra(e.name or "fastapi", "serve") from None

    configure_logging()
    sock = listen(settings.host, settings.port)  # first: a taken port fails in a second, not after the load
    try:
        from torchloom.model.device import resolve_device

        fleet = local_fleet(settings, model_threads(resolve_device(settings.device), usable_cores()))
    except BaseException:
        sock.close()
        raise
    app = create_app(fleet, settings.texts_per_request, settings.max_text_chars, settings.api_key, "local",
                     max_body_bytes=settings.max_body_bytes, max_connections=settings.max_connections,
                     admin_key=settings.admin_key, model_roots=settings.model_roots)
    model = fleet.members[fleet.order[0]].backend.model
    names = "" if settings.models is None else f"models {', '.join(fleet.order)}: {fleet.plan.line()}; "
    identity = model.identity
    # One line on stdout that scripts (and the tests) can wait for; the socket already queues connections.
    print(f"torchloom serve: listening on {url_of(sock)} ({names}model {identity.name} {identity.version},"
          f" device {model.device}, runtime {model.runtime}, precision {model.precision} ({model.precision_reason}),"
          f" max batch {settings.max_batch_size}, max wait {settings.max_wait_ms:g} ms,"
          f" max body {body_limit_for(settings.texts_per_request, settings.max_text_chars, settings.max_body_bytes)}"
          f" bytes, max connections {settings.max_connections}, read timeout {settings.read_timeout_s:g} s)",
          flush=True)

    stop_signal: list[int] = []
    # uvicorn re-raises the signal it stopped on once it has drained; this handler turns that into exit 0.
    previous = {sig: signal.signal(sig, lambda s, _f: stop_signal.append(s)) for sig in (signal.SIGTERM,
                                                                                          signal.SIGINT)}
    server = uvicorn.Server(uvicorn_config(app, settings))
    try:
        server.run(sockets=[sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        sock.close()
    if not server.started:
        return 1
    name = signal.Signals(stop_signal[0]).name if stop_signal else "shutdown"
    print(f"torchloom serve: stopped on {name} after draining in-flight requests", flush=True)
    return 0
