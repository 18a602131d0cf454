"""What a shadow costs a server: `torchloom serve MODEL` alone against the same model served with a shadow beside
it (`--model A=MODEL --model S=COPY --shadow S`: S sees every text, tokenized once, its answers never returned), at
c = 64, one text per request.

    .venv/bin/python benchmarks/shadow.py [--models tiny,minilm] [--rounds 3] [--requests 3000] [--time-cap 20]
                                          [--no-write]

Per model (tiny: the random 2-layer BERT, where the front end is most of the cost; minilm: the demo's MiniLM with
a fresh 5-label head, where the forward is), both servers run side by side and rounds alternate alone, shadow,
shadow, alone, ... so that neither side always goes first; each round is a fresh load of `--requests` requests
(or `--time-cap` seconds) after a warm-up, timed by the same load generator from the same moment. The ratio is
the median over rounds of (texts/s with a shadow) / (texts/s alone). Also: the share of texts the shadow answered
by the end of the load (its queue, --max-queue, refuses what it cannot hold: counted, never a client's error; its
backlog is answered, or dropped, before the next round starts, so that it takes no cores from either side). Writes
the table to docs/benchmarks.md under '## Serving with a shadow (issue 58)'.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import shutil
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve import Process, export_benchmark_model, load, load_texts, wait_ready, write_doc  # noqa: E402
from serve_front import cpu_name  # noqa: E402

C = 64


def model_for(name: str, work: Path) -> str:
    from torchloom.model.tiny import write_tiny_model

    base = write_tiny_model(work / "tiny-base") if name == "tiny" else None
    return export_benchmark_model(work / name / "model", base=base)


def shadow_counts(url: str) -> tuple[float, float, float]:
    """(texts the shadow answered, texts it dropped, texts queued in the server) now, from /metrics."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    answered = dropped = queued = 0.0
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for s in family.samples:
            if s.name == "torchloom_model_texts_total" and s.labels.get("role") == "shadow":
                answered += s.value
            elif s.name == "torchloom_shadow_dropped_total":
                dropped += s.value
            elif s.name == "torchloom_queue_depth":
                queued += s.value
    return answered, dropped, queued


def drained(url: str, timeout: float = 300.0) -> tuple[float, float]:
    """Wait until the server's queues are empty (the shadow's backlog answered or dropped), so that it takes no
    cores from the next round; (answered, dropped) then."""
    deadline = time.monotonic() + timeout
    while True:
        answered, dropped, queued = shadow_counts(url)
        if not queued or time.monotonic() > deadline:
            return answered, dropped
        time.sleep(0.5)


def measure(name: str, model: str, texts: list[str], a: argparse.Namespace, work: Path) -> dict:
    copy = work / name / "shadow"
    shutil.copytree(model, copy)
    flags = {"alone": [model], "shadow": ["--model", f"A={model}", "--model", f"S={copy}", "--shadow", "S"]}
    servers = {side: Process([sys.executable, "-m", "torchloom", "serve", *f, "--port", "0", "--device", "cpu"],
                             work, f"{name}-{side}") for side, f in flags.items()}
    try:
        for s in servers.values():
            asyncio.run(wait_ready(s.url))
        rates: dict[str, list[float]] = {"alone": [], "shadow": []}
        p99: dict[str, list[float]] = {"alone": [], "shadow": []}
        watched: list[float] = []
        for side in (["alone", "shadow", "shadow", "alone"] * a.rounds)[:2 * a.rounds]:
            before = drained(servers["shadow"].url) if side == "shadow" else None
            row = asyncio.run(load(servers[side].url, texts, C, a.requests, a.time_cap))
            rates[side].append(row["texts_s"])
            p99[side].append(row["p99"])
            if before is not None:
                at_end = shadow_counts(servers["shadow"].url)  # what the shadow had answered when the load ended
                after = drained(servers["shadow"].url)
                done, dropped = at_end[0] - before[0], after[1] - before[1]
                watched.append(done / max(1.0, after[0] - before[0] + dropped))
            print(f"{name:7} {side:6}: {row['texts_s']:8.1f} texts/s  p99 {row['p99']:7.1f} ms ({row['requests']}"
                  f" requests, {row['errors']} errors){f'; shadow answered {watched[-1]:.1%}' if before else ''}",
                  flush=True)
        ratios = [x / y for x, y in zip(rates["shadow"], rates["alone"])]
        return {"model": name, "alone": statistics.median(rates["alone"]),
                "shadow": statistics.median(rates["shadow"]), "ratio": statistics.median(ratios), "ratios": ratios,
                "p99_alone": statistics.median(p99["alone"]), "p99_shadow": statistics.median(p99["shadow"]),
                "watched": statistics.median(watched)}
    finally:
        for s in servers.values():
            s.stop()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="tiny,minilm")
    p.add_argument("--rounds", type=int, default=3, help="rounds per side")
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--time-cap", type=float, default=20.0)
    p.add_argument("--no-write", action="store_true")
    a = p.parse_args()
    texts = load_texts(1000)
    rows = []
    with tempfile.TemporaryDirectory(prefix="tl-shadow-cost-") as tmp:
        work = Path(tmp)
        for name in a.models.split(","):
            rows.append(measure(name, model_for(name, work), texts, a, work))
    lines = [f"Machine: {cpu_name()}; Python {platform.python_version()}; {datetime.now(UTC):%Y-%m-%d}."
             f" `benchmarks/shadow.py --rounds {a.rounds} --requests {a.requests}`: c = {C}, one text per request;"
             " the shadow is a copy of the model (one tokenizing for both), its model thread at nice 10.", "",
             "| model | texts/s alone | texts/s with a shadow | shadow / alone (median; each round) | p99 ms alone |"
             " p99 ms with a shadow | texts the shadow had answered when the load ended (the rest: later, or"
             " dropped) |", "|---" * 7 + "|"]
    for r in rows:
        each = ", ".join(f"{x:.3f}" for x in r["ratios"])
        lines.append(f"| {r['model']} | {r['alone']:.1f} | {r['shadow']:.1f} | **{r['ratio']:.3f}** ({each}) |"
                     f" {r['p99_alone']:.1f} | {r['p99_shadow']:.1f} | {r['watched']:.1%} |")
    body = "\n".join(lines)
    print(body)
    if not a.no_write:
        print(f"wrote {write_doc(body, 'Serving with a shadow (issue 58)')}")


if __name__ == "__main__":
    main()
