"""The serving front end with a tiny model (issue 48 item 5): `torchloom serve` against the offline rate and
against the ceiling of HTTP itself, on the same cores.

    flock /tmp/torchloom-bench.lock .venv/bin/python benchmarks/serve_front.py [--rounds 3] [--seconds 4]
        [--no-write] [--server-args '--max-batch-size 64'] [--only ceiling,app,serve]

Model: the tiny random BERT (model/tiny.py: 2 layers, 32 wide) with a fresh 5-label head, exported like
benchmarks/serve.py's (max_length 128), so the model costs almost nothing and what is measured is the work
around it, as on a GPU. Texts: serve.load_texts (BBC headline + lede, <= 400 characters).

The sides:
- offline: Predictor.predict (clean, tokenize, forward; no HTTP) on lists of B texts (16, 32, 64), on 1 thread
  and on all, eager and traced (model/traced.py, where the graph is as fast): the best of these.
- ceiling: a bare endpoint on the same server stack (uvicorn with torchloom serve's own config: uvloop,
  httptools, the read-timeout protocol) that reads the body and answers a fixed prediction body of the same
  shape and size: what HTTP alone allows here.
- torchloom app, fixed answer: torchloom's own app (create_app: middleware, key check, parsing, the answer)
  over a backend that answers at once, without batcher or model: what the app costs.
- torchloom serve with its defaults.
Each server at c = 1, 8, 64 connections, with 1 and with 16 texts per request. All servers start first; then
each round measures every side once (offline first), and the table gives each level's median over the rounds
and the ratio to min(ceiling, offline) of each round: other jobs on these cores come in bursts, which then move
one round of every side rather than all of one side. The load generator is a lean raw-socket HTTP/1.1
keep-alive client on uvloop in this process (an aiohttp client costs several times more CPU per request, CPU
taken from the server on these shared cores); the same generator drives every server. Besides the rates it
reports the CPU each side spent per request (the server process's from /proc, the generator's own): where the
time goes when a target is missed.

Writes the section '## Serving with a tiny model: the front end (issue 48 item 5, 2026-11-28)' of
docs/benchmarks.md unless --no-write.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import LABELS, Process, export_benchmark_model, load_texts, wait_ready, write_doc  # noqa: E402

CONCURRENCY = (1, 8, 64)
TEXTS_PER_REQUEST = (1, 16)
OFFLINE_BATCHES = (16, 32, 64)
NAMES = {"ceiling": "ceiling", "app": "torchloom app, fixed answer", "serve": "torchloom serve"}
SECTION = "Serving with a tiny model: the front end (issue 48 item 5, 2026-11-28)"
_CONTENT_LENGTH = re.compile(rb"\r\ncontent-length:[ \t]*(\d+)", re.I)


# --- the bare endpoint: HTTP alone --------------------------------------------------------------------------


def fixed_answer(texts: int) -> bytes:
    """A /v1/predict answer for `texts` texts, the shape and size torchloom serve sends."""
    probs = {label: round(1 / len(LABELS), 6) for label in LABELS}
    one = {"label": LABELS[0], "score": probs[LABELS[0]], "probabilities": probs}
    body = {"model": {"name": "tiny", "version": "2026-11-28T00:00:00+00:00"}, "predictions": [one] * texts}
    return json.dumps(body, separators=(",", ":")).encode()


def bare_app():
    """A raw ASGI app: /readyz 200; any other path reads the body whole and answers a fixed prediction per
    text (texts counted by their separators, no JSON parsing)."""
    answers: dict[int, bytes] = {}
    headers = [(b"content-type", b"application/json")]

    async def app(scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        if scope["path"] != "/readyz":
            more = True
            while more:
                message = await receive()
                body += message.get("body", b"")
                more = message.get("more_body", False)
        n = body.count(b'","') + 1
        answer = answers.get(n) or answers.setdefault(n, fixed_answer(n))
        await send({"type": "http.response.start", "status": 200,
                    "headers": headers + [(b"content-length", str(len(answer)).encode())]})
        await send({"type": "http.response.body", "body": answer})

    return app


class FixedBackend:
    """torchloom's Backend with the model replaced by a fixed answer: what the app costs without batcher or model."""

    def __init__(self) -> None:
        from torchloom.model.served import ModelIdentity
        from torchloom.serve.metrics import ServeMetrics

        self.identity = ModelIdentity("tiny", "2026-11-28T00:00:00+00:00", tuple(LABELS))
        self.metrics, self.ready, self.queued = ServeMetrics(), True, 0
        self.fleet = None  # one model (serve/api_common.Backend)
        self.answer = json.loads(fixed_answer(1))["predictions"][0]

    def monitor_report(self) -> dict:
        return {"state": "off", "reason": "a benchmark's fixed answer", "drift": False}

    async def start(self) -> None:
        gc.collect()
        gc.freeze()  # as LocalBackend does once warmed up

    async def stop(self) -> None:
        pass

    async def predict(self, texts: list[str]) -> list[dict]:
        return [self.answer] * len(texts)


def run_bare_server(kind: str) -> None:
    """kind "http": the bare ASGI endpoint; "app": torchloom's app (create_app) over FixedBackend."""
    import uvicorn

    from torchloom.serve.app import create_app
    from torchloom.serve.server import listen, url_of, uvicorn_config
    from torchloom.serve.settings import ServeSettings

    settings = ServeSettings(model_dir="-")
    app = bare_app() if kind == "http" else create_app(
        FixedBackend(), settings.texts_per_request, settings.max_text_chars, max_body_bytes=settings.max_body_bytes,
        max_connections=settings.max_connections)
    sock = listen("127.0.0.1", 0)
    print(f"{kind} server: listening on {url_of(sock)}", flush=True)
    uvicorn.Server(uvicorn_config(app, settings)).run(sockets=[sock])


# --- the load generator ---------------------------------------------------------------------------------------


class _Connection(asyncio.Protocol):
    """One keep-alive connection: sends a request, reads its answer (Content-Length framed), sends the next."""

    def __init__(self, run: _Load) -> None:
        self.run, self.buffer, self.need, self.status, self.started = run, b"", 0, 0, 0.0

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.send()

    def send(self) -> None:
        if self.run.stopped:
            self.transport.close()
            return
        self.started = time.perf_counter()
        self.transport.write(self.run.next_request())

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if not self.need:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            length = _CONTENT_LENGTH.search(self.buffer, 0, end + 2)
            self.status = int(self.buffer[9:12])
            self.need = end + 4 + int(length.group(1) if length else 0)
        if len(self.buffer) < self.need:
            return
        self.buffer, self.need = self.buffer[self.need:], 0
        self.run.answered(self.status, time.perf_counter() - self.started)
        self.send()

    def connection_lost(self, exc) -> None:
        self.run.lost += 0 if self.run.stopped else 1


class _Load:
    def __init__(self, requests: list[bytes]) -> None:
        self.requests, self.sent, self.stopped, self.lost = requests, 0, False, 0
        self.measuring, self.latencies, self.errors = False, [], 0

    def next_request(self) -> bytes:
        self.sent += 1
        return self.requests[self.sent % len(self.requests)]

    def answered(self, status: int, seconds: float) -> None:
        if self.measuring:
            if status == 200:
                self.latencies.append(seconds)
            else:
                self.errors += 1


def request_bytes(host: str, port: int, texts: list[str], per_request: int) -> list[bytes]:
    out = []
    for i in range(0, len(texts), per_request):
        body = json.dumps({"texts": (texts * 2)[i:i + per_request]}).encode()
        out.append(b"POST /v1/predict HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n"
                   b"Content-Length: %d\r\n\r\n%s" % (host.encode(), port, len(body), body))
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _drive(url: str, pid: int, requests: list[bytes], concurrency: int, warm_up: float,
                 seconds: float) -> dict:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    run = _Load(requests)
    loop = asyncio.get_running_loop()
    for _ in range(concurrency):
        await loop.create_connection(lambda: _Connection(run), host, int(port))
    await asyncio.sleep(warm_up)
    run.measuring, started, cpu, server_cpu = True, time.perf_counter(), time.process_time(), cpu_seconds(pid)
    await asyncio.sleep(seconds)
    run.measuring, run.stopped = False, True
    elapsed, cpu, server_cpu = time.perf_counter() - started, time.process_time() - cpu, cpu_seconds(pid) - server_cpu
    await asyncio.sleep(0.5)  # the answers in flight come back; each connection then closes
    lat = sorted(run.latencies)

    def pct(p: float) -> float:
        return lat[min(len(lat) - 1, int(p / 100 * len(lat)))] * 1000 if lat else float("nan")

    done = len(lat)
    return {"requests": done, "errors": run.errors + run.lost, "seconds": elapsed, "rps": done / elapsed,
            "p50": pct(50), "p99": pct(99), "client_cpu_us": cpu / max(1, done) * 1e6,
            "server_cpu_us": server_cpu / max(1, done) * 1e6}


def drive(url: str, pid: int, requests: list[bytes], concurrency: int, per_request: int, warm_up: float,
          seconds: float) -> dict:
    """Keep `concurrency` requests in flight for `seconds` (after `warm_up`); rates, latency and CPU per request."""
    import uvloop

    row = uvloop.run(_drive(url, pid, requests, concurrency, warm_up, seconds))
    row["texts_s"] = row["rps"] * per_request
    row.update(concurrency=concurrency, per_request=per_request)
    return row


# --- the run ----------------------------------------------------------------------------------------------------


class Offline:
    """The offline rate: Predictor.predict (clean, tokenize, forward; no HTTP) on lists of B texts, best B."""

    def __init__(self, model: str, texts: list[str]) -> None:
        import torch

        from torchloom.machine import usable_cores
        from torchloom.model.predict import Predictor, pad_batch
        from torchloom.model.traced import TracedForward

        self.texts, self.torch = texts, torch
        # eager, and traced where the graph is at least as fast (what torchloom serve's warm-up chooses)
        self.predictors = {(b, trace): Predictor(model, batch_size=b) for b in OFFLINE_BATCHES for trace in (0, 1)}
        for (b, trace), predictor in self.predictors.items():
            if trace:
                predictor.traced = TracedForward(predictor.model)
                rows = [f for windows in predictor.encode_windows(texts[:b]) for f in windows]
                with torch.inference_mode():
                    predictor.traced.choose(pad_batch(rows, predictor.tokenizer, 64))
            predictor.predict(texts[:b])  # warm-up
        # torch on all cores, and on one: with other jobs on the cores, all of them can be far slower
        self.threads = sorted({1, usable_cores()})

    def rate(self, seconds: float) -> float:
        best, done = 0.0, 0
        for ((b, _), predictor), threads in itertools.product(self.predictors.items(), self.threads):
            self.torch.set_num_threads(threads)
            n, started, cpu = 0, time.perf_counter(), time.process_time()
            while time.perf_counter() - started < seconds / len(self.predictors) / len(self.threads):
                batch = self.texts[done % len(self.texts):done % len(self.texts) + b]
                predictor.predict(batch)
                done, n = done + len(batch), n + len(batch)
            rate = n / (time.perf_counter() - started)
            if rate > best:
                best, self.cpu_us = rate, (time.process_time() - cpu) / n * 1e6
                traced = "traced" if predictor.traced is not None and predictor.traced.traced else "eager"
                self.best = f"batch {b}, {self.torch.get_num_threads()} thread(s), {traced}"
        return best


def one_round(servers: dict[str, Process], offline: Offline, texts: list[str], a: argparse.Namespace) -> list[dict]:
    """Every level once, the offline rate first: rounds interleave the sides, so a burst of load from other jobs
    on these cores moves one round of every side rather than all of one side."""
    rows = [{"server": "offline", "per_request": 0, "concurrency": 0, "texts_s": offline.rate(a.offline_seconds),
             "server_cpu_us": offline.cpu_us}]
    print(f"offline: {rows[0]['texts_s']:.0f} texts/s ({offline.best}), {offline.cpu_us:.0f} us CPU per text",
          flush=True)
    for key, server in servers.items():
        host, port = server.url.removeprefix("http://").rsplit(":", 1)
        for per_request in TEXTS_PER_REQUEST:
            requests = request_bytes(host, int(port), texts, per_request)
            for c in CONCURRENCY:
                row = drive(server.url, server.proc.pid, requests, c, per_request, a.warm_up, a.seconds)
                settle(server.proc.pid)
                row["server"] = NAMES[key]
                rows.append(row)
                print(f"{NAMES[key]:28} {per_request:2} texts/request c={c:3}: {row['rps']:7.1f} req/s"
                      f" {row['texts_s']:8.1f} texts/s  p50 {row['p50']:6.1f} ms  p99 {row['p99']:6.1f} ms  server"
                      f" CPU {row['server_cpu_us']:5.0f} us/req  client CPU {row['client_cpu_us']:4.0f} us/req"
                      f"  ({row['requests']} answers, {row['errors']} errors)", flush=True)
    return rows


def settle(pid: int, timeout: float = 5.0) -> None:
    """Wait until server `pid` has finished the requests its clients left behind (it spends < 5 % of a core)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        before = cpu_seconds(pid)
        time.sleep(0.2)
        if cpu_seconds(pid) - before < 0.01:
            return


def medians(rounds: list[list[dict]]) -> list[dict]:
    """Each level's median over the rounds (errors: the sum); `ratios`: its per-round x min(ceiling, offline)."""
    out = []
    for i, first in enumerate(rounds[0]):
        same = [r[i] for r in rounds]
        row = {k: statistics.median(x[k] for x in same) if isinstance(v, float) else v for k, v in first.items()}
        row["errors"] = sum(x.get("errors", 0) for x in same)
        row["ratios"] = [x["texts_s"] / bound(r, x) for r, x in zip(rounds, same) if x["server"] != "offline"]
        out.append(row)
    return out


def bound(rows: list[dict], row: dict) -> float:
    """min(the ceiling at this row's level, the offline rate), from the same round."""
    ceiling = next((r["texts_s"] for r in rows if r["server"] == "ceiling" and r["per_request"] == row["per_request"]
                    and r["concurrency"] == row["concurrency"]), float("inf"))
    return min(ceiling, next(r["texts_s"] for r in rows if r["server"] == "offline"))


def cpu_name() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    name, family = fields.get("Model name", "?").strip(), fields.get("CPU family", "?").strip()
    return f"{name} (family {family}), {os.cpu_count()} cores"


def table(rows: list[dict]) -> str:
    lines = ["| server | texts/request | c | requests/s | texts/s | p50 ms | p99 ms | server CPU us/request |"
             " client CPU us/request | x min(ceiling, offline), median (each round) | errors |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        if r["server"] == "offline":
            lines.append(f"| offline (Predictor.predict, best batch, no HTTP) | - | - | - | {r['texts_s']:.0f} | - |"
                         f" - | {r['server_cpu_us']:.0f} per text | - | - | - |")
            continue
        each = ", ".join(f"{x:.2f}" for x in r["ratios"])
        lines.append(f"| {r['server']} | {r['per_request']} | {r['concurrency']} | {r['rps']:.0f} | {r['texts_s']:.0f}"
                     f" | {r['p50']:.1f} | {r['p99']:.1f} | {r['server_cpu_us']:.0f} | {r['client_cpu_us']:.0f} |"
                     f" {statistics.median(r['ratios']):.2f} ({each}) | {r['errors']} |")
    return "\n".join(lines)


def targets(rows: list[dict]) -> list[str]:
    out = []
    for per_request in TEXTS_PER_REQUEST:
        ours = next(r for r in rows if r["server"] == "torchloom serve" and r["per_request"] == per_request
                    and r["concurrency"] == 64)
        ratio = statistics.median(ours["ratios"])
        out.append(f"- {per_request} text(s) per request, c=64: {ours['texts_s']:.0f} texts/s, {ratio:.2f}x"
                   f" min(ceiling, offline) (median of the rounds' ratios; target >= 0.7x):"
                   f" {'met' if ratio >= 0.7 else 'NOT met'}")
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=4.0, help="measured seconds per level")
    p.add_argument("--warm-up", type=float, default=1.0, help="seconds of load before each measured window")
    p.add_argument("--offline-seconds", type=float, default=6.0, help="seconds for the offline rate, each round")
    p.add_argument("--rounds", type=int, default=3, help="rounds; each measures every side once")
    p.add_argument("--server-args", default="", help="more torchloom serve options")
    p.add_argument("--only", default="ceiling,app,serve",
                   help="which servers (comma-separated): ceiling (bare endpoint), app (torchloom's app, a fixed"
                        " answer instead of batcher and model), serve")
    p.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    p.add_argument("--bare-server", choices=["http", "app"], help=argparse.SUPPRESS)
    a = p.parse_args()
    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(key, "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if a.bare_server:
        run_bare_server(a.bare_server)
        return
    from torchloom.model.tiny import write_tiny_model

    load_start, started = os.getloadavg(), time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="torchloom-bench-front-"))
    texts = load_texts()
    model = export_benchmark_model(work / "model", "torch", texts, base=write_tiny_model(work / "tiny"))
    commands = {"ceiling": [sys.executable, str(Path(__file__).resolve()), "--bare-server", "http"],
                "app": [sys.executable, str(Path(__file__).resolve()), "--bare-server", "app"],
                "serve": [sys.executable, "-m", "torchloom", "serve", model, "--port", "0", *a.server_args.split()]}
    servers: dict[str, Process] = {}
    try:
        for key in a.only.split(","):
            servers[key] = Process(commands[key], work, key)
            asyncio.run(wait_ready(servers[key].url))
        offline = Offline(model, texts)
        rounds = [one_round(servers, offline, texts, a) for _ in range(a.rounds)]
    finally:
        for server in servers.values():
            server.stop()
    shutil.rmtree(work, ignore_errors=True)  # kept when a server failed: its logs are there
    rows = medians(rounds)
    header = (f"Measured {datetime.now(UTC):%Y-%m-%d %H:%M} UTC with `benchmarks/serve_front.py --rounds {a.rounds}"
              f" --seconds {a.seconds:g}{' --server-args ' + repr(a.server_args) if a.server_args else ''}` on"
              f" {cpu_name()}, 1-min load average {load_start[0]:.2f} at the start and {os.getloadavg()[0]:.2f} at"
              f" the end ({time.monotonic() - started:.0f} s; the cores are shared with other jobs, so the rounds"
              f" interleave the sides and the table gives medians). Tiny model (2 layers, 32 wide, fresh"
              f" {len(LABELS)}-label head, max_length 128); {a.seconds:g} s per level after {a.warm_up:g} s of load;"
              f" offline {a.offline_seconds:g} s a round over batches {', '.join(map(str, OFFLINE_BATCHES))}.")
    both = {"ceiling", "serve"} <= set(a.only.split(","))
    body = "\n\n".join([header, table(rows)] + (["Targets:\n" + "\n".join(targets(rows))] if both else []))
    print("\n" + body)
    if not a.no_write:
        print(f"\nwritten to {write_doc(body, SECTION)}")


if __name__ == "__main__":
    main()
