"""What the live monitor costs a server: `torchloom serve` with monitoring on against the same server with
`--no-monitor`, at c = 64, one text per request (the most answers per second, so the most monitor work per second).

    .venv/bin/python benchmarks/monitor_overhead.py [--models tiny,minilm] [--rounds 3] [--requests 4000]
                                                    [--time-cap 20] [--no-write] [--what monitor|log]

`--what log` measures the durable prediction log instead (issue 76): `--log FILE.db` (SQLite, texts hashed) on
against no log, both with the monitor on; written under '## Serving with the prediction log on and off'.

Per model (tiny: the random 2-layer BERT, the fastest a server answers here, so the monitor's largest share;
minilm: the demo's MiniLM with a fresh 5-label head), both servers run side by side, on the same model copy with
its reference profile (1000 benchmark texts), with the default warm-up (what each chose is in the table;
`--no-tune`: eager on all cores for both); rounds alternate on, off, off, on, ... so that neither side always
goes first, each round a fresh load of `--requests` requests (or `--time-cap` seconds) after a warm-up. The ratio
is the median over rounds of (texts/s with monitoring) / (texts/s without), both timed by the same load generator
from the same moment (its start after the warm-up). Writes the table to docs/benchmarks.md under '## Serving with
the monitor on and off'.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve import LABELS, Process, export_benchmark_model, load, load_texts, wait_ready, write_doc  # noqa: E402
from serve_front import cpu_name, cpu_seconds  # noqa: E402

C = 64


def model_for(name: str, work: Path, texts: list[str]) -> str:
    from torchloom.model.tiny import write_tiny_model
    from torchloom.monitor.profile import write_profile

    base = write_tiny_model(work / "tiny-base") if name == "tiny" else None
    model = export_benchmark_model(work / name / "model", base=base)
    # labels for the profile's accuracy: the model's own answers on half, another label on the rest
    from torchloom.model.predict import Predictor

    answers = Predictor(model).predict(texts)
    truth = [a["label"] if i % 2 else LABELS[(LABELS.index(a["label"]) + 1) % len(LABELS)]
             for i, a in enumerate(answers)]
    write_profile(model, texts, truth, {"val": len(texts), "test": 0})
    return model


def measure(name: str, model: str, texts: list[str], a: argparse.Namespace, work: Path) -> dict:
    servers = {}
    sides = ((("on", ["--log", str(work / f"{name}-log.db")]), ("off", [])) if a.what == "log" else
             (("on", []), ("off", ["--no-monitor"])))
    for side, flags in sides:
        # the warm-up's measured choices (traced or eager, 1 or 2 torch threads) can differ from one server start to
        # the next on a noisy machine: the table says what each side chose; --no-tune gives both eager, all cores
        servers[side] = Process([sys.executable, "-m", "torchloom", "serve", model, "--port", "0", "--device", "cpu",
                                 *(["--no-tune"] if a.no_tune else []), *flags], work, f"{name}-{side}")
    try:
        for s in servers.values():
            asyncio.run(wait_ready(s.url))
        rates: dict[str, list[float]] = {"on": [], "off": []}
        p99: dict[str, list[float]] = {"on": [], "off": []}
        cpu: dict[str, list[float]] = {"on": [], "off": []}
        order = ["on", "off", "off", "on"] * a.rounds
        for side in order[:2 * a.rounds]:
            pid = servers[side].proc.pid
            before = cpu_seconds(pid)
            row = asyncio.run(load(servers[side].url, texts, C, a.requests, a.time_cap))
            # the server's CPU per text, warm-up included (the same warm-up on both sides): less noisy than a rate
            cpu[side].append((cpu_seconds(pid) - before) / max(1, row["requests"] + min(2 * C, 64)) * 1e6)
            rates[side].append(row["texts_s"])
            p99[side].append(row["p99"])
            print(f"{name:7} {a.what} {side:3}: {row['texts_s']:8.1f} texts/s  p99 {row['p99']:7.1f} ms"
                  f"  server CPU {cpu[side][-1]:7.0f} us a text ({row['requests']} requests, {row['errors']} errors)",
                  flush=True)
        on_log = (work / f"{name}-on.err").read_text()
        expected = "prediction log sqlite" if a.what == "log" else "monitoring: the last 500 texts"
        assert expected in on_log, on_log[-2000:]
        chosen = {side: "; ".join(line.split("warm-up: ", 1)[1].split(":")[0] for line in
                                  (work / f"{name}-{side}.err").read_text().splitlines() if "warm-up: " in line)
                  or "eager, all cores (--no-tune)" for side in servers}
        ratios = [x / y for x, y in zip(rates["on"], rates["off"])]
        return {"model": name, "on": statistics.median(rates["on"]), "off": statistics.median(rates["off"]),
                "p99_on": statistics.median(p99["on"]), "p99_off": statistics.median(p99["off"]),
                "ratio": statistics.median(ratios), "ratios": ratios,
                "cpu_on": statistics.median(cpu["on"]), "cpu_off": statistics.median(cpu["off"]), "chosen": chosen}
    finally:
        for s in servers.values():
            s.stop()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="tiny,minilm")
    p.add_argument("--rounds", type=int, default=3, help="rounds per side")
    p.add_argument("--requests", type=int, default=4000)
    p.add_argument("--time-cap", type=float, default=20.0)
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--no-tune", action="store_true", help="serve both sides with --no-tune")
    p.add_argument("--what", choices=("monitor", "log"), default="monitor", help="what is on and off")
    a = p.parse_args()
    texts = load_texts(1000)
    cpu = cpu_name()
    rows = []
    with tempfile.TemporaryDirectory(prefix="tl-monitor-cost-") as tmp:
        work = Path(tmp)
        for name in a.models.split(","):
            rows.append(measure(name, model_for(name, work, texts), texts, a, work))
    lines = [f"Machine: {cpu}; Python {platform.python_version()}; {datetime.now(UTC):%Y-%m-%d}."
             f" `benchmarks/monitor_overhead.py --rounds {a.rounds} --requests {a.requests}"
             f"{' --no-tune' if a.no_tune else ''}{' --what log' if a.what == 'log' else ''}`: c = {C}, one text per"
             " request, window 500 texts (the default),"
             " reference 1000 texts. What each server's warm-up chose: "
             + "; ".join(f"{r['model']} on: {r['chosen']['on']}, off: {r['chosen']['off']}" for r in rows) + ".", "",
             f"| model | texts/s, {a.what} on | texts/s, {a.what} off | on / off (median of rounds; each round) |"
             " p99 ms on | p99 ms off | server CPU us a text, on | off | on / off |", "|---" * 9 + "|"]
    for r in rows:
        each = ", ".join(f"{x:.3f}" for x in r["ratios"])
        lines.append(f"| {r['model']} | {r['on']:.1f} | {r['off']:.1f} | **{r['ratio']:.3f}** ({each}) |"
                     f" {r['p99_on']:.1f} | {r['p99_off']:.1f} | {r['cpu_on']:.0f} | {r['cpu_off']:.0f} |"
                     f" {r['cpu_on'] / r['cpu_off']:.3f} |")
    body = "\n".join(lines)
    print(body)
    if not a.no_write:
        heading = ("Serving with the prediction log on and off (issue 76)" if a.what == "log" else
                   "Serving with the monitor on and off (issue 57)")
        print(f"wrote {write_doc(body, heading)}")


if __name__ == "__main__":
    main()
