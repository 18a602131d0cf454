"""Serving throughput and latency: `torchloom serve` against a naive server and the offline limit.

    .venv/bin/python benchmarks/serve.py [--requests 1000] [--time-cap 45] [--runtimes torch,onnx,onnx-int8]
                                         [--no-write]

Model: the embedded all-MiniLM-L6-v2 with a fresh 5-label head (BBC News labels), exported with
export_model (max_length 128); quality does not matter for speed. Texts: headline + first paragraph of
BBC News articles (cut at 400 characters, ~80 tokens), one text per request.

For each runtime (torch: PyTorch eager; onnx / onnx-int8: the model exported with `--format onnx` /
`onnx-int8` through the parity gates, served with `--runtime onnx`), measured on this machine one after
the other:
- offline limit: Predictor.predict (clean, tokenize, forward) on lists of B texts, no HTTP, for several B,
  on that runtime, each the median of 3 rounds that take the B in turn; the best B is the limit a server on
  that runtime could reach.
- torchloom serve (local engine, defaults: max batch 32, max batch tokens 8192, max wait 5 ms) in a
  subprocess.
And once:
- naive: the same model behind FastAPI on uvicorn the way a first version is usually written: a plain `def`
  endpoint (FastAPI runs it in its thread pool) calling the model once per request, no batching.
The load generator (asyncio + aiohttp, loopback only) keeps C requests in flight (C = 1, 8, 64) until it
has sent a fixed number of requests or the time cap passes, after a short warm-up. The load generator runs
on the same 2 cores as the server, as a client on the same host would.

Writes the table to docs/benchmarks.md under '## Serving' (replacing only that section).
"""

import argparse
import asyncio
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LABELS = ["business", "entertainment", "politics", "sport", "tech"]
CONCURRENCY = (1, 8, 64)
OFFLINE_BATCHES = (1, 8, 16, 32, 64)
TEXT_CHARS = 400


def load_texts(n: int = 512) -> list[str]:
    """Headline + first paragraph of BBC News articles, or synthetic sentences without the demo corpus."""
    try:
        from torchloom.embedded import demo_data_path

        root = Path(demo_data_path())
        files = sorted(root.rglob("*.txt"))
    except Exception:
        files = []
    texts = []
    for f in files[:: max(1, len(files) // n)][:n]:
        raw = f.read_text(encoding="utf-8", errors="replace")
        texts.append(" ".join(raw.split())[:TEXT_CHARS])
    if not texts:
        words = ["market", "shares", "match", "goal", "film", "album", "election", "phone", "vote", "record",
                 "profit", "league"]
        texts = [" ".join(words[(i * 7 + j) % len(words)] for j in range(40 + i % 40)) for i in range(n)]
    return texts


def export_benchmark_model(out_dir: Path, runtime: str = "torch", texts: list[str] | None = None,
                           source: str | None = None, base: str | None = None) -> str:
    """The benchmark model (a copy of `source`, an exported model, or `base` with a fresh head: MiniLM unless
    told); for onnx / onnx-int8 also its gated ONNX file. The gate's rows are the benchmark texts labelled with
    PyTorch's own answers: the int8 gate then asks for 99 % agreement, which a random head's near-ties cannot
    give."""
    import numpy as np
    import torch

    from torchloom.embedded import demo_model_path
    from torchloom.model.build import build_classifier
    from torchloom.model.export import export_model

    if source:
        shutil.copytree(source, out_dir)
        out = str(out_dir)
    else:
        base = base or demo_model_path()
        torch.manual_seed(0)
        model = build_classifier(base, LABELS)
        out = export_model(model, base, LABELS, str(out_dir), extra_info={"max_length": 128})
    if runtime != "torch":
        from torchloom.model.onnx import GateRows, export_onnx
        from torchloom.model.predict import Predictor

        predictor = Predictor(out)
        ids = [f["input_ids"] for f in predictor.encode(texts or [])]
        labels = np.array([predictor.labels.index(p["label"]) for p in predictor.predict(texts or [])])
        export_onnx(out, GateRows("benchmark", ids, labels), runtime, say=print)
    return out


def cpu_idle(seconds: float = 3.0) -> float:
    """Fraction of CPU time idle over `seconds` (Linux /proc/stat); 1.0 where that is not available."""
    def read() -> tuple[int, int]:
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:9]]
        return sum(values), values[3]

    try:
        total0, idle0 = read()
        time.sleep(seconds)
        total1, idle1 = read()
    except OSError:
        return 1.0
    return (idle1 - idle0) / max(1, total1 - total0)


def wait_for_idle(max_wait: float, threshold: float = 0.85) -> float:
    """Wait (at most max_wait s) until the machine is mostly idle: other jobs on these 2 cores skew every number."""
    deadline = time.monotonic() + max_wait
    idle = cpu_idle()
    while idle < threshold and time.monotonic() < deadline:
        print(f"waiting for an idle machine ({idle:.0%} idle)", flush=True)
        idle = cpu_idle()
    return idle


# --- offline limit ---------------------------------------------------------------------------------------


def offline(model_dir: str, texts: list[str], time_cap: float, runtime: str = "torch", rounds: int = 3,
            device: str = "cpu") -> dict[int, float]:
    """Texts/s of Predictor.predict on lists of B texts, for each B in OFFLINE_BATCHES: the median of `rounds`
    rounds that time every B in turn (a noisy machine then moves all B alike instead of crowning the luckiest)."""
    import statistics

    from torchloom.machine import usable_cores
    from torchloom.model.predict import Predictor

    predictors = {b: Predictor(model_dir, device=device, batch_size=b, threads=usable_cores(),
                               runtime="torch" if runtime == "torch" else "onnx") for b in OFFLINE_BATCHES}
    for b, predictor in predictors.items():
        predictor.predict(texts[:b])  # warm-up
    samples: dict[int, list[float]] = {b: [] for b in OFFLINE_BATCHES}
    done = 0
    for _ in range(rounds):
        for b, predictor in predictors.items():
            n, started = 0, time.perf_counter()
            while n < len(texts) and time.perf_counter() - started < time_cap / rounds:
                batch = texts[done % len(texts):done % len(texts) + b]  # short at the end of the list
                predictor.predict(batch)
                done, n = done + len(batch), n + len(batch)
            samples[b].append(n / (time.perf_counter() - started))
    results = {b: statistics.median(rates) for b, rates in samples.items()}
    for b, rate in results.items():
        print(f"offline {runtime} batch {b:3}: {rate:7.1f} texts/s (median of"
              f" {', '.join(f'{r:.1f}' for r in samples[b])})", flush=True)
    return results


# --- servers ---------------------------------------------------------------------------------------------


def naive_app(model_dir: str, device: str = "cpu"):
    """One model call per request; FastAPI runs the plain `def` endpoint in its thread pool."""
    from fastapi import FastAPI
    from pydantic import BaseModel

    from torchloom.model.predict import Predictor

    predictor = Predictor(model_dir, device=device)
    app = FastAPI()

    class Body(BaseModel):
        texts: list[str]

    @app.post("/v1/predict")
    def predict(body: Body) -> dict:
        return {"predictions": predictor.predict(body.texts)}

    @app.get("/readyz")
    def readyz() -> dict:
        return {"status": "ready"}

    return app


def run_naive_server(model_dir: str, device: str = "cpu") -> None:
    import uvicorn

    from torchloom.serve.server import listen, url_of

    sock = listen("127.0.0.1", 0)
    app = naive_app(model_dir, device)
    print(f"naive server: listening on {url_of(sock)}", flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False)).run(sockets=[sock])


class Process:
    def __init__(self, args: list[str], log_dir: Path, name: str) -> None:
        self.out = log_dir / f"{name}.out"
        with open(self.out, "wb") as out, open(log_dir / f"{name}.err", "wb") as err:
            self.proc = subprocess.Popen(args, stdout=out, stderr=err, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        deadline = time.monotonic() + 180
        self.url = ""
        while not self.url:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise SystemExit(f"{name} did not start; see {log_dir}/{name}.err")
            match = re.search(r"listening on (\S+)", self.out.read_text())
            self.url = match.group(1) if match else ""
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# --- load generator --------------------------------------------------------------------------------------


async def wait_ready(url: str) -> None:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        for _ in range(600):
            try:
                async with session.get(f"{url}/readyz") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    raise SystemExit(f"{url} never became ready")


async def load(url: str, texts: list[str], concurrency: int, requests: int, time_cap: float) -> dict:
    """Keep `concurrency` requests in flight until `requests` are sent or `time_cap` seconds pass."""
    import aiohttp

    latencies: list[float] = []
    errors = 0
    sent = 0
    connector = aiohttp.TCPConnector(limit=concurrency)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        async def one(i: int) -> None:
            nonlocal errors
            started = time.perf_counter()
            async with session.post(f"{url}/v1/predict", json={"texts": [texts[i % len(texts)]]}) as r:
                await r.read()
                if r.status != 200:
                    errors += 1
                    return
            latencies.append(time.perf_counter() - started)

        # warm-up: a few rounds at this concurrency, not measured
        await asyncio.gather(*(one(i) for i in range(min(2 * concurrency, 64))))
        latencies.clear()
        started = time.perf_counter()
        deadline = started + time_cap

        async def worker() -> None:
            nonlocal sent
            while sent < requests and time.perf_counter() < deadline:
                sent += 1
                await one(sent)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    latencies.sort()

    def pct(p: float) -> float:
        return latencies[min(len(latencies) - 1, int(p / 100 * len(latencies)))] * 1000 if latencies else float("nan")

    done = len(latencies)
    return {"requests": done, "errors": errors, "seconds": elapsed, "rps": done / elapsed, "texts_s": done / elapsed,
            "p50": pct(50), "p95": pct(95), "p99": pct(99)}


def batch_totals(url: str) -> tuple[float, float]:
    """(texts, batches) the server has run so far, from its /metrics."""
    import urllib.request

    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    total = float(re.search(r"^torchloom_batch_size_sum (\S+)$", text, re.M).group(1))
    count = float(re.search(r"^torchloom_batch_size_count (\S+)$", text, re.M).group(1))
    return total, count


def measure_server(name: str, url: str, texts: list[str], requests: int, time_cap: float) -> list[dict]:
    asyncio.run(wait_ready(url))
    rows = []
    for c in CONCURRENCY:
        n = requests if c > 1 else max(100, requests // 4)
        before = batch_totals(url) if name.startswith("torchloom serve") else None
        row = asyncio.run(load(url, texts, c, n, time_cap))
        row.update(server=name, concurrency=c)
        if before is not None:
            after = batch_totals(url)
            row["mean_batch"] = (after[0] - before[0]) / max(1.0, after[1] - before[1])
        rows.append(row)
        print(f"{name:16} c={c:3}: {row['rps']:7.1f} req/s  p50 {row['p50']:7.1f} ms  p95 {row['p95']:7.1f} ms"
              f"  p99 {row['p99']:7.1f} ms  ({row['requests']} requests, {row['errors']} errors)", flush=True)
    return rows


# --- report ----------------------------------------------------------------------------------------------


def table(rows: list[dict], offline_rates: dict[str, dict[int, float]]) -> str:
    """x offline: against the offline limit of the server's own runtime (the naive server: torch's)."""
    lines = ["| server | runtime | concurrency | requests/s | texts/s | p50 ms | p95 ms | p99 ms | x offline |"
             " errors |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        best = max(offline_rates[r["runtime"]].values())
        lines.append(f"| {r['server']} | {r['runtime']} | {r['concurrency']} | {r['rps']:.1f} | {r['texts_s']:.1f} |"
                     f" {r['p50']:.1f} | {r['p95']:.1f} | {r['p99']:.1f} | {r['texts_s'] / best:.2f} | {r['errors']} |")
    for runtime, rates in offline_rates.items():
        best_b = max(rates, key=rates.get)
        lines.append(f"| offline limit (Predictor, batch {best_b}, no HTTP) | {runtime} | - | - | {rates[best_b]:.1f} |"
                     " - | - | - | 1.00 | - |")
    lines.append("")
    for runtime, rates in offline_rates.items():
        lines.append(f"Offline texts/s by batch size, {runtime}: "
                     + ", ".join(f"{b}: {v:.1f}" for b, v in rates.items()))
    return "\n".join(lines)


def targets(rows: list[dict], offline_rates: dict[str, dict[int, float]]) -> str:
    naive = next(r for r in rows if r["server"] == "naive" and r["concurrency"] == 64)
    out = []
    served = [runtime for runtime in offline_rates if any(r["server"] == "torchloom serve" and r["runtime"] == runtime
                                                           for r in rows)]
    for runtime in served:
        best = max(offline_rates[runtime].values())
        ours = next(r for r in rows if r["server"] == "torchloom serve" and r["runtime"] == runtime
                    and r["concurrency"] == 64)
        errors = sum(r["errors"] for r in rows if r["server"] == "torchloom serve" and r["runtime"] == runtime)
        checks = [
            (f"/ offline limit of {runtime} = {ours['texts_s'] / best:.2f}", ours["texts_s"] / best >= 0.85, ">= 0.85"),
            (f"/ naive (torch) = {ours['texts_s'] / naive['texts_s']:.2f}", None, "none; for scale"),
            (f"p99 / p50 = {ours['p99'] / ours['p50']:.2f}", ours["p99"] / ours["p50"] <= 3, "<= 3"),
            (f"non-200 answers at c = 1, 8, 64: {errors}", errors == 0, "0"),
        ]
        out += [f"- torchloom serve ({runtime}) {text} (target {goal})"
                + ("" if ok is None else f": {'met' if ok else 'NOT met'}") for text, ok, goal in checks]
    return "\n".join(out)


def write_doc(body: str, title: str = "Serving", path: Path | None = None) -> Path:
    """`body` as the section `## {title}` of docs/benchmarks.md (or `path`): replaced where it is, else appended."""
    path = path or ROOT / "docs" / "benchmarks.md"
    old = path.read_text(encoding="utf-8") if path.is_file() else "# Benchmarks\n"
    section = f"## {title}\n\n{body.strip()}\n"
    match = re.search(rf"^## {re.escape(title)}\n.*?(?=^## |\Z)", old, flags=re.M | re.S)
    if match:
        new = old[:match.start()] + section + ("\n" if old[match.end():] else "") + old[match.end():]
    else:
        new = old.rstrip("\n") + "\n\n" + section
    path.write_text(new, encoding="utf-8")
    return path


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=1000, help="requests per concurrency level (c=1: a quarter)")
    p.add_argument("--time-cap", type=float, default=45.0, help="seconds per concurrency level at most")
    p.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    p.add_argument("--wait-idle", type=float, default=600, help="wait up to this many s for >= 85%% idle CPUs")
    p.add_argument("--runtimes", default="", help="comma-separated: torch, onnx, onnx-int8 (default: all three with"
                                                  " --model, else torch,onnx)")
    p.add_argument("--model", help="an exported model dir to serve (e.g. runs/bbc-minilm/model); default: MiniLM"
                                   " with a fresh head, which the int8 gate refuses (near-ties everywhere)")
    p.add_argument("--server-args", default="", help="more torchloom serve options, e.g. '--max-batch-size 64'")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where the model runs (offline, torchloom serve, naive); cuda writes '## Serving on a GPU'")
    p.add_argument("--naive-server", metavar="MODEL_DIR", help=argparse.SUPPRESS)
    a = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if a.naive_server:
        run_naive_server(a.naive_server, a.device)
        return

    idle = wait_for_idle(a.wait_idle)
    load_start = os.getloadavg()[0]
    work = Path(tempfile.mkdtemp(prefix="torchloom-bench-serve-"))
    texts = load_texts()
    runtimes = (a.runtimes or ("torch,onnx,onnx-int8" if a.model else "torch,onnx")).split(",")
    models = {runtime: export_benchmark_model(work / runtime, runtime, texts, a.model)
              for runtime in {"torch", *runtimes}}
    what = a.model or f"MiniLM-L6 + fresh {len(LABELS)}-label head"
    print(f"model: {what}; {len(texts)} texts of <= {TEXT_CHARS} chars", flush=True)
    offline_rates = {runtime: offline(models[runtime], texts, a.time_cap / 3, runtime, device=a.device)
                     for runtime in runtimes}

    rows: list[dict] = []
    servers = [("torchloom serve", runtime, [sys.executable, "-m", "torchloom", "serve", models[runtime], "--port",
                                             "0", "--device", a.device, "--runtime",
                                             "torch" if runtime == "torch" else "onnx", *a.server_args.split()])
               for runtime in runtimes]
    servers.append(("naive", "torch", [sys.executable, str(Path(__file__).resolve()), "--naive-server",
                                       models["torch"], "--device", a.device]))
    if "torch" not in offline_rates:
        offline_rates["torch"] = offline(models["torch"], texts, a.time_cap / 3, device=a.device)
    for name, runtime, args in servers:
        server = Process(args, work, f"{name}-{runtime}".replace(" ", "-"))
        try:
            for row in measure_server(f"{name} ({runtime})", server.url, texts, a.requests, a.time_cap):
                rows.append({**row, "server": name, "runtime": runtime})
        finally:
            server.stop()

    cpu = platform.processor() or platform.machine()
    import torch

    gpu = f"GPU {torch.cuda.get_device_name(0)}" if a.device == "cuda" else "no GPU"
    header = (f"Measured {datetime.now(UTC):%Y-%m-%d %H:%M} UTC with `benchmarks/serve.py --device {a.device}` on"
              f" {os.cpu_count()} cores ({cpu}), {gpu}, torch {torch.__version__}, Python {platform.python_version()}."
              f" Model: {what}, max_length 128; one BBC News headline + lede"
              f" (<= {TEXT_CHARS} chars) per request; load generator on the same cores (aiohttp, loopback),"
              f" {a.requests} requests per level (c=1: {max(100, a.requests // 4)}) or {a.time_cap:g} s."
              " torchloom serve with its defaults (max batch 32, max batch tokens 8192, max wait 5 ms), one"
              " server per runtime (onnx, onnx-int8: exported through the parity gates, --runtime onnx);"
              " naive = FastAPI `def` endpoint, PyTorch, one forward per request."
              f" CPU idle before the start: {idle:.0%}; 1-min load average at start {load_start:.1f}, at the end"
              f" {os.getloadavg()[0]:.1f} (other jobs share this machine: read the ratios, not the absolutes).")
    batches = ", ".join(f"{r['runtime']} c={r['concurrency']}: {r['mean_batch']:.1f}" for r in rows
                        if "mean_batch" in r)
    body = "\n\n".join([header, table(rows, offline_rates),
                        f"Mean texts per model batch in torchloom serve (from its /metrics): {batches}.",
                        "Targets at concurrency 64:\n" + targets(rows, offline_rates)])
    print("\n" + body)
    shutil.rmtree(work, ignore_errors=True)
    if not a.no_write:
        print(f"\nwritten to {write_doc(body, 'Serving on a GPU' if a.device == 'cuda' else 'Serving')}")


if __name__ == "__main__":
    main()
