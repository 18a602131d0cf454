"""`torchloom serve --serve-with ray`: the same HTTP API as a Ray Serve deployment with `@serve.batch`.

Each replica loads the model once and batches texts from concurrent requests with `@serve.batch`
(one call per text, so a batch counts texts, as in the local server). Ray's proxy routes requests over
`--replicas` replicas. The driver starts a local Ray instance (loopback only, token auth on, a temp dir of its own) and
blocks until SIGTERM/SIGINT, then shuts Serve down, which lets replicas finish their requests.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import socket
import tempfile
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from torchloom.errors import UserError, missing_extra
from torchloom.machine import gpu_names, usable_cores
from torchloom.ray_instance import start_local_ray
from torchloom.serve.batcher import ModelFailed, Overloaded
from torchloom.serve.settings import ServeSettings

log = logging.getLogger("torchloom.serve")
APP_NAME = "torchloom"


class _Failed:
    """Stands in for one text's result when the model failed on it (serve.batch wants one result per item)."""

    def __init__(self, error_id: str) -> None:
        self.error_id = error_id


class _Item:
    """One text on its way through @serve.batch. A request whose client went away marks the texts no batch
    has taken yet `dropped`; a batch skips them (Ray drops a cancelled call only before its batch forms)."""

    __slots__ = ("text", "taken", "dropped")

    def __init__(self, text: str) -> None:
        self.text = text
        self.taken = False
        self.dropped = False


class RayBackend:
    """The replica side: the model, a one-thread executor, and the batched call. Built inside the replica."""

    def __init__(self, settings: ServeSettings, threads: int, metrics=None) -> None:
        """metrics: the replica's, where several models share it (serve/fleet.py)."""
        from torchloom.model.served import ServedModel
        from torchloom.serve.metrics import ServeMetrics

        self.settings = settings
        self.model = ServedModel(settings.model_dir, device=settings.device, precision=settings.precision,
                                 batch_size=settings.max_batch_size, threads=threads, runtime=settings.runtime,
                                 length_bucket=settings.length_bucket)
        self.identity = self.model.identity
        self._pending = 0
        self._ready = False
        from torchloom.monitor.live import load_monitor

        self.monitor, self.monitor_off, line = load_monitor(settings, settings.model_dir, self.model.labels,
                                                             self.identity.name, self.model.predictor)
        self.model.signals = self.monitor is not None
        from torchloom.monitor.live import outlier_scorer

        self.outliers = outlier_scorer(settings, self.monitor, self.identity.name)
        log.info("%s", line)  # each replica watches the texts it answers
        self.metrics = metrics or ServeMetrics(queue_depth=lambda: self._pending,
                                               monitor=lambda: [((self.identity.name, self.identity.version),
                                                                 self.monitor_report())],
                                               queue_capacity=settings.max_queue, shared_dir=settings.metrics_dir)
        if self.monitor is not None and metrics is None:
            self.monitor.on_report = self.metrics.publish_monitor
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torchloom-model")
        self._batched_one = None  # the deployment's @serve.batch method, one text per call

    def monitor_report(self) -> dict[str, Any]:
        return self.monitor.current() if self.monitor is not None else self.monitor_off

    fleet = None  # one model (api_common.Backend)

    @property
    def queued(self) -> int:
        """Texts this model's queue holds now."""
        return self._pending

    def room(self) -> int:
        """Texts the replica's queue takes now."""
        return self.settings.max_queue - self._pending

    def attach(self, batched_one) -> None:
        self._batched_one = batched_one

    @property
    def ready(self) -> bool:
        return self._ready

    async def start(self) -> None:
        """The app's lifespan start, which Ray runs before the replica takes traffic: a warm-up through
        the path every request takes (@serve.batch, the model thread, predict), a short batch and one
        full-length text, then one batch at every length bucket on the model thread, as the local server
        does (ServedModel.warm_up_buckets; no token limit: @serve.batch counts texts, and the Predictor cuts a
        batch into the forwards it runs). A replica whose warm-up fails does not start, and says why."""
        if self.monitor is not None:
            self.monitor.start()
            self.monitor.evaluate()  # its gauges in the shared files from the start (warming up), whoever scrapes
        await self.predict(["warm up"] * min(self.settings.max_batch_size, self.settings.max_queue, 8))
        await self.predict(["warm up " * self.model.max_length])
        if self.settings.tune:  # the traced forward where it is as fast; threads are the replica's CPUs, as Ray gave
            for line in await asyncio.get_running_loop().run_in_executor(
                    self._executor, self.model.tune, self.settings.max_batch_size, self.settings.max_batch_tokens, 1):
                log.info("warm-up: %s", line)
        lengths = await asyncio.get_running_loop().run_in_executor(
            self._executor, self.model.warm_up_buckets, self.settings.max_batch_size, 0)
        for length in lengths:
            self.metrics.warm_up_batches.inc(str(length))
        self._ready = True
        log.info("ready: %s %s", self.identity.name, self.identity.version)

    async def stop(self) -> None:
        self._ready = False
        self._executor.shutdown(wait=True)
        self.metrics.process_gone()

    async def predict(self, texts: list[str]) -> list[dict[str, Any]]:
        if self._pending + len(texts) > self.settings.max_queue:
            raise Overloaded(self._pending, self.settings.max_queue)
        self._pending += len(texts)
        self.metrics.queue_changed()
        items = [_Item(t) for t in texts]
        try:
            results = await asyncio.gather(*(self._batched_one(item) for item in items))
        except asyncio.CancelledError:  # the client went away (Ray cancels the request)
            waiting = [item for item in items if not item.taken]
            for item in waiting:
                item.dropped = True
            if waiting:
                self.metrics.dropped.inc(amount=len(waiting))
            raise
        finally:
            self._pending -= len(texts)
            self.metrics.queue_changed()
        for result in results:
            if isinstance(result, _Failed):
                raise ModelFailed(result.error_id)
        if self.monitor is not None and self._ready:  # not the warm-up's texts
            self.monitor.observe(results)
        if self.outliers is not None:
            from torchloom.monitor.outliers import score_answers

            score_answers(self.outliers, results)
        return results

    async def predict_batch(self, items: list[_Item]) -> list[Any]:
        """The body of the @serve.batch method: the model on a thread; on failure each text alone."""
        live = [i for i, item in enumerate(items) if not item.dropped]
        out: list[Any] = [None] * len(items)  # a dropped text's slot: nobody awaits it
        if not live:
            return out
        for i in live:
            items[i].taken = True
        texts = [items[i].text for i in live]
        self.metrics.batch_size.observe(len(texts))
        loop = asyncio.get_running_loop()
        try:
            results = await loop.run_in_executor(self._executor, self.model.predict, texts)
            self.metrics.texts.inc(amount=len(texts))
        except Exception:
            results = [self._failed(texts[0])] if len(texts) == 1 else [await self._alone(t) for t in texts]
        for i, result in zip(live, results):
            out[i] = result
        return out

    async def _alone(self, text: str) -> Any:
        try:
            result = (await asyncio.get_running_loop().run_in_executor(self._executor, self.model.predict,
                                                                       [text]))[0]
        except Exception:
            return self._failed(text)
        self.metrics.texts.inc()
        return result

    def _failed(self, text: str) -> _Failed:
        error_id = uuid.uuid4().hex[:12]
        self.metrics.model_errors.inc()
        log.exception("model error %s on text %r", error_id, text[:80])
        return _Failed(error_id)


def replica_grpc_on_loopback() -> None:
    """In a replica, before Ray Serve starts its inter-deployment gRPC server: bind it to 127.0.0.1.

    Ray Serve (2.60) binds that server to [::]:0, every interface, whatever the node's address, and without
    Ray's token check; torchloom's own instance is one loopback node, where nothing from outside may reach a
    replica (the HTTP proxy is the one door, on --host). The proxy reaches replicas by actor calls unless
    RAY_SERVE_USE_GRPC_BY_DEFAULT is on, and then at the node's address, 127.0.0.1, as well."""
    try:
        from ray.serve._private import replica as replica_module
    except ImportError:  # another Ray layout: tests/test_serve.py would see the open port
        return
    bind = getattr(replica_module, "add_port_to_grpc_server", None)
    if bind is None or getattr(bind, "loopback", False):
        return

    def on_loopback(server, address: str):
        return bind(server, address.replace("[::]:", "127.0.0.1:", 1))

    on_loopback.loopback = True
    replica_module.add_port_to_grpc_server = on_loopback


def replica_gpus(device: str, replicas: int, gpus: int) -> float:
    """The GPUs Ray gives each replica. --device auto or cuda on a machine with GPUs: the replicas share them, one
    each while they fit, else an equal fraction, so Ray sets each replica's CUDA_VISIBLE_DEVICES and the replicas
    spread over the GPUs (without it every one of them took cuda:0). cpu, or a pinned cuda:N: none."""
    if device not in ("auto", "cuda") or gpus <= 0:
        return 0.0
    return 1.0 if replicas <= gpus else int(100 * gpus / replicas) / 100


def build_deployment(settings: ServeSettings, cpus_per_replica: float, gpus_per_replica: float = 0.0):
    """The Ray Serve deployment class with `settings` baked in (batch size and wait are set per replica)."""
    from ray import serve

    @serve.deployment(
        name="torchloom",
        num_replicas=settings.replicas,
        ray_actor_options={"num_cpus": cpus_per_replica,
                           **({"num_gpus": gpus_per_replica} if gpus_per_replica else {})},
        # Ray's default (5 requests per replica) would cap every batch at 5; the replica's own text queue
        # (max_queue) bounds the work instead, and the proxy refuses past max_queued_requests with 503.
        max_ongoing_requests=settings.max_queue,
        max_queued_requests=settings.max_queue,
        graceful_shutdown_timeout_s=settings.drain_timeout_s,
    )
    @serve.ingress()
    class TorchloomDeployment:
        def __init__(self, settings_dict: dict[str, Any]) -> None:
            replica_grpc_on_loopback()
            settings_dict = dict(settings_dict)
            key_files = {k: settings_dict.pop(f"{k}_file", None) for k in SECRET_FIELDS}
            replica_settings = ServeSettings(**settings_dict)
            for field_name, key_file in key_files.items():  # the keys never travel in these init args (replica_fields)
                if key_file:
                    with open(key_file, encoding="utf-8") as f:
                        setattr(replica_settings, field_name, f.read())
            self.settings = replica_settings
            self.backend = replica_fleet(replica_settings, max(1, int(cpus_per_replica)))

        def __serve_build_asgi_app__(self):
            from torchloom.serve.app import create_app

            s = self.settings
            return create_app(self.backend, s.texts_per_request, s.max_text_chars, s.api_key, "ray",
                              max_body_bytes=s.max_body_bytes, admin_key=s.admin_key, model_roots=s.model_roots)

    return TorchloomDeployment


def ray_member(name: str | None, path: str, settings: ServeSettings, threads: int, metrics):
    """One model of a replica: a RayBackend of its own, with its own @serve.batch queue."""
    from dataclasses import replace

    from ray import serve

    from torchloom.serve.fleet import Member

    backend = RayBackend(replace(settings, model_dir=path), threads, metrics)

    @serve.batch(max_batch_size=settings.max_batch_size, batch_wait_timeout_s=settings.max_wait_ms / 1000)
    async def predict_one(items: list[_Item]) -> list[Any]:
        return await backend.predict_batch(items)

    backend.attach(predict_one)
    return Member(name or backend.identity.name, path, backend)


def replica_fleet(settings: ServeSettings, threads: int):
    """The replica's models behind one Fleet (serve/fleet.py), as the local server's. Without a prediction log,
    feedback and the admin route keep their state in the replica: with one replica they work as locally; with
    several, a prediction's id is known to its replica alone and a change would reach one replica, so both answer
    501. With a log (--log: each replica writes to it and reads it back), feedback, the verdict and the admin's
    changes are the fleet's on any number of replicas (a change made on one, the others follow it:
    serve/fleet_sync.py)."""
    from torchloom.serve.fleet import Fleet
    from torchloom.serve.metrics import ServeMetrics, fleet_families
    from torchloom.serve.server import deployment, open_log
    from torchloom.serve.split import Plan, make_plan

    models = settings.models or {None: settings.model_dir}
    holder: list[Fleet] = []
    metrics = ServeMetrics(queue_depth=lambda: sum(m.backend.queued for m in holder[0].members.values()),
                           monitor=lambda: holder[0].monitor_reports(),
                           queue_capacity=settings.max_queue, shared_dir=settings.metrics_dir)
    members = [ray_member(name, path, settings, threads, metrics) for name, path in models.items()]
    plan = (make_plan(list(models), settings.traffic, settings.shadow) if settings.models else
        Plan({members[0].name: 100.0}))

    async def load(name: str, path: str):
        member = await asyncio.to_thread(ray_member, name, path, settings, threads, metrics)
        await member.backend.start()
        return member

    shared = open_log(settings, members[0].identity.name)
    fleet = Fleet(members, plan, metrics, settings.feedback_size, settings.verdict_alpha, settings.min_effect,
                  load=load if settings.replicas == 1 or shared is not None else None, log=shared)
    deployment(fleet, settings, models)
    if settings.replicas > 1 and shared is None:  # with a log, the replicas follow each other's changes
        fleet.refused = (f"with {settings.replicas} Ray Serve replicas each keeps its own split and predictions; the"
                         " admin route and feedback need a prediction log they share (--log), or --replicas 1")
    for m in members:
        if m.backend.monitor is not None:
            m.backend.monitor.on_report = metrics.publish_monitor
    holder.append(fleet)
    metrics.extra = fleet_families(fleet)
    return fleet


def start_ray(temp_dir: str) -> None:
    """The server's own Ray instance, as training starts one (ray_instance): loopback only, token auth on.
    Only Serve's HTTP proxy listens on --host."""
    from torchloom.model.env import model_env

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    start_local_ray(temp_dir, num_cpus=max(2, usable_cores()), env_vars=model_env(), include_dashboard=None,
                    configure_logging=True, log_to_driver=True,
                    fix="retry when it has room, or serve without Ray (--serve-with local)")


SECRET_FIELDS = ("api_key", "admin_key")


def replica_fields(settings: ServeSettings, temp_dir: str) -> dict[str, Any]:
    """The settings the replicas are built with, which Ray keeps in its GCS: the keys are not among them. Each
    goes to a file of mode 0600 in the instance's private temp dir, and the fields name that file."""
    fields = {k: v for k, v in vars(settings).items() if k not in SECRET_FIELDS}
    for name in SECRET_FIELDS:
        key = getattr(settings, name)
        if key is not None:
            path = os.path.join(temp_dir, name)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(key)
            fields[f"{name}_file"] = path
    return fields


def run_ray(settings: ServeSettings) -> int:
    """Start Ray and Serve, deploy, and block until SIGTERM/SIGINT; returns the exit code."""
    try:
        import ray
        from ray import serve
    except ImportError:
        raise missing_extra("ray[serve]", "serve") from None
    from torchloom.serve.server import configure_logging

    configure_logging()
    settings.model_dir = os.path.abspath(settings.model_dir)
    if settings.port == 0:  # Ray's proxy needs a number: take one the OS says is free now
        with socket.socket() as probe:
            probe.bind((settings.host, 0))
            settings.port = probe.getsockname()[1]
    cpus = usable_cores()
    # The proxy and controller need a little CPU too; replicas share the rest.
    cpus_per_replica = max(0.01, (cpus - 0.2) / settings.replicas)
    temp_dir = tempfile.mkdtemp(prefix="torchloom-ray-")  # mode 0700
    settings.metrics_dir = os.path.join(temp_dir, "metrics")  # the replicas' shared metrics (serve/metrics.py)
    os.mkdir(settings.metrics_dir)
    stop = threading.Event()
    previous: dict[int, Any] = {}
    try:
        start_ray(temp_dir)
        # After ray.init, which installs its own handlers (a SIGTERM would kill the driver mid-request).
        previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
        serve.start(http_options={"host": settings.host, "port": settings.port})
        gpus = replica_gpus(settings.device, settings.replicas, len(gpu_names()))
        deployment = build_deployment(settings, cpus_per_replica, gpus)
        fields = replica_fields(settings, temp_dir)
        try:
            serve.run(deployment.bind(fields), name=APP_NAME, route_prefix="/", blocking=False)
        except Exception as e:  # a replica that cannot start: show its reason in one line
            last = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            raise UserError(f"serve --serve-with ray: the deployment did not start ({last})") from None
        print(f"torchloom serve: listening on http://{settings.host}:{settings.port} (Ray Serve,"
              f" {settings.replicas} replica(s){f', {gpus:g} GPU each' if gpus else ''},"
              f" max batch {settings.max_batch_size}, max wait {settings.max_wait_ms:g} ms)", flush=True)
        while not stop.wait(0.5):
            pass
        print("torchloom serve: stopping Ray Serve", flush=True)
        serve.shutdown()
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if ray.is_initialized():
            ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
