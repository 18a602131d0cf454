"""A run on an S3 store against the same run on local disk (issue 28).

    .venv/bin/python benchmarks/storage.py [--rows 100000] [--rounds 3] [--train-steps 40] [--skip-train]
                                           [--input-rows 200000]

Starts an S3 server (moto, over HTTP on 127.0.0.1: a real S3 API, no network latency) and measures, in one
sitting, each pair interleaved round by round so that a slow spell of the machine hits both sides:

1. the loader alone: one epoch of rank 0 of 2 (shuffled global batches, read-ahead) over a synthetic
   prepared split, its shards read from local disk, then the same shards streamed from the store
   (ranged reads of the row groups); rows/s, and the ratio store / local (goal >= 0.9);
2. training: `torchloom train` of the demo's model on the demo's prepared data, --train-steps optimizer
   steps with a checkpoint every 10, into a local run directory, then into s3://; steady-state samples/s
   (the log windows after the first) and the ratio (goal >= 0.97);
3. per checkpoint of the store run: blocked_s (how long the loop waited for the previous upload) against
   a synchronous upload of the same checkpoint directory, timed here; ratio (goal <= 0.2).
4. prepare's input (--input-rows, 0 skips): a CSV of that many rows (quoted texts, a third with a line
   break) in 4 files, read and parsed by a local[2] Spark into text and label (the sum of the texts' lengths
   as the job's result): Spark's reader on local disk, the tasks streaming the objects from the store
   (inputs/store_read.py: a Spark cluster without a connector), and the embedded Spark's way with an input on a
   store (download to local disk, then Spark's reader); rows/s and the ratio to Spark's reader on disk;
   then (--prepare-rounds) whole `torchloom prepare` runs of the same files the same three ways.

Prints the CPU first: write it beside every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUCKET = "bench"


def start_server(log: Path, cpus: set[int] | None = None) -> tuple[subprocess.Popen, str]:
    """The S3 server; on `cpus` only where given (the benchmark then keeps to the others)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
    endpoint = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.2)
    os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
                      AWS_DEFAULT_REGION="us-east-1")
    from pyarrow import fs as pafs

    pafs.S3FileSystem(endpoint_override=endpoint, scheme="http", allow_bucket_creation=True,
                      region="us-east-1").create_dir(BUCKET)
    return proc, endpoint


def loader_rate(manifest, server=None, log: Path | None = None) -> tuple[float, float, float, int]:
    """(rows/s, this process's CPU seconds, the S3 server's CPU seconds, requests the server answered) of one
    epoch of rank 0 of 2. server: the S3 server's pid; log: its log, one line per request."""
    from torchloom.data import ShardedLoader

    before = requests_logged(log)
    cpu0, srv0 = cpu_seconds(), cpu_seconds(server) if server else 0.0
    loader = ShardedLoader(manifest, "train", rank=0, world_size=2, batch_size=8, seed=0)
    started, rows = time.perf_counter(), 0
    for batch in loader:
        rows += len(batch["labels"])
    rate = rows / (time.perf_counter() - started)
    used = cpu_seconds() - cpu0, (cpu_seconds(server) - srv0) if server else 0.0
    time.sleep(0.2)  # the server writes its log line after the answer
    return rate, *used, requests_logged(log) - before


def requests_logged(log: Path | None) -> int:
    """Reads (GET, HEAD) in the S3 server's log so far: werkzeug writes a line per request."""
    if log is None:
        return 0
    return len(re.findall(r"(?:GET|HEAD) /\S+ HTTP/1\.1", log.read_text(errors="replace")))


def cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU seconds of a process (this one, with its threads, by default), from /proc."""
    if pid is None:
        t = os.times()
        return t.user + t.system
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bench_loader(tmp: Path, rows: int, rounds: int, server_pid: int, log: Path) -> list[tuple]:
    from dataclasses import replace

    from torchloom.data.synthetic import write_synthetic_dataset
    from torchloom.store import storage

    local = write_synthetic_dataset(tmp / "data", rows={"train": rows}, max_len=128, vocab_size=30522,
                                    rows_per_group=1024, rows_per_shard=25_000)
    uri = f"s3://{BUCKET}/loader/data"
    storage.push_tree(tmp / "data", uri, last=("manifest.json",))
    remote = replace(local, root=uri)
    server = server_pid
    out = []
    for r in range(rounds):
        (a, cpu_a, _, _), (b, cpu_b, srv, asked) = loader_rate(local), loader_rate(remote, server, log)
        out.append((f"round {r + 1}", a, b, cpu_b / cpu_a, srv, asked))
        print(f"loader round {r + 1}: local {a:,.0f} rows/s, store {b:,.0f} rows/s ({b / a:.3f}x); the loader's CPU"
              f" {cpu_b / cpu_a:.2f}x local's; the S3 server's CPU {srv:.2f} s, {asked} requests", flush=True)
    return out


def bench_input(tmp: Path, rows: int, rounds: int, prepare_rounds: int = 0) -> list[tuple]:
    """[(round, rows/s Spark on disk, rows/s tasks from the store, rows/s download + Spark)] for prepare's read."""
    import csv
    import random
    import shutil

    from pyspark.sql import functions as F

    from torchloom.config.schema import DataConfig, PrepareConfig
    from torchloom.etl.session import get_spark
    from torchloom.inputs.read import read_input
    from torchloom.store import storage

    rng = random.Random(0)
    words = ["the", "market", "said", "goal", "chip", "team", "price", '"quoted"', "band,", "song", "data", "over",
             "a", "lazy", "dog"]
    src = tmp / "input"
    src.mkdir()
    for f in range(4):
        with open(src / f"part-{f}.csv", "w", newline="") as out:
            w = csv.writer(out)
            w.writerow(["text", "label"])
            for i in range(rows // 4):
                text = " ".join(rng.choice(words) for _ in range(60)) + ("\nmore" if i % 3 == 0 else "")
                w.writerow([text, f"c{i % 5}"])
    uri = f"s3://{BUCKET}/input"
    storage.push_tree(src, uri)
    env = {f"spark.executorEnv.{k}": os.environ[k]
           for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")}
    spark = get_spark(PrepareConfig(spark_master="local[2]", spark_conf=env))
    cfg = DataConfig(text_column="text", label_column="label")

    def rate(path: str, reader: str = "auto", stage: bool = False) -> float:
        started = time.perf_counter()
        if stage:
            shutil.rmtree(tmp / "staged", ignore_errors=True)
            path = storage.stage_input(path, tmp / "staged", "data.path")
        df = read_input(spark, cfg, path, "csv", reader)
        total = df.select(F.sum(F.length("text")), F.count("label")).collect()[0]
        assert total[1] == rows, total
        return rows / (time.perf_counter() - started)

    rate(str(src)), rate(uri)  # warm the JVM and the Python workers
    out = []
    for r in range(rounds):
        a, b, c = rate(str(src)), rate(uri, "pyarrow"), rate(uri, stage=True)
        out.append((f"round {r + 1}", a, b, c))
        print(f"input round {r + 1}: Spark on disk {a:,.0f} rows/s, tasks from the store {b:,.0f} ({b / a:.3f}x),"
              f" download + Spark {c:,.0f} ({c / a:.3f}x)", flush=True)
    spark.stop()
    if prepare_rounds:
        out.append(whole_prepare(tmp, src, uri, prepare_rounds, rows))
    return out


def whole_prepare(tmp: Path, src: Path, uri: str, rounds: int, rows: int) -> tuple:
    """`torchloom prepare` of the same CSV files (the demo's tokenizer, local[2]): from local disk, from the
    store through the tasks, from the store downloaded first; rows/s of each, the median of `rounds`."""
    def once(path: str, reader: str) -> float:
        out = tmp / "prepared"
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "torchloom", "prepare", "--data.path", path, "--output.dir", str(out),
                        "--output.overwrite", "true", "--prepare.spark_master", "local[2]", "--prepare.input_reader",
                        reader, "--data.text_column", "text", "--data.label_column", "label", "--eval.baseline",
                        "false", "--tracking.enabled", "false"], check=True, cwd=ROOT, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, env={**os.environ, "TORCHLOOM_CACHE": str(tmp / "prep-cache")})
        return rows / (time.perf_counter() - started)

    got = []
    for r in range(rounds):
        a, b, c = once(str(src), "auto"), once(uri, "pyarrow"), once(uri, "auto")
        got.append((a, b, c))
        print(f"prepare round {r + 1}: from disk {a:,.0f} rows/s, tasks from the store {b:,.0f} ({b / a:.3f}x),"
              f" downloaded first {c:,.0f} ({c / a:.3f}x)", flush=True)
    return ("prepare", *(statistics.median(x[i] for x in got) for i in range(3)))


def train(output: str, steps: int, data: Path, cache: Path) -> dict:
    """One `torchloom train`, returning {samples_per_s (steady), wall_s, records}."""
    from torchloom.runs.rundir import RunDir
    from torchloom.store import storage

    rd = RunDir(output)
    if rd.remote:
        storage.delete_tree(rd.remote)
        storage.push_tree(data, storage.join(rd.remote, "data"), last=("manifest.json",))
    else:
        import shutil

        shutil.rmtree(output, ignore_errors=True)
        shutil.copytree(data, Path(output) / "data")
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "torchloom", "train", "--output.dir", output, "--train.max_steps",
                    str(steps), "--train.checkpoint_every", "10", "--train.eval_every", str(10 * steps),
                    "--train.log_every", "5", "--tracking.enabled", "false"],
                   check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   env={**os.environ, "HF_HUB_OFFLINE": "1", "TORCHLOOM_CACHE": str(cache)})
    wall = time.perf_counter() - started
    text = (storage.read_bytes(storage.join(rd.remote, "metrics.jsonl")).decode() if rd.remote
            else (Path(output) / "metrics.jsonl").read_text())
    records = [json.loads(x) for x in text.splitlines() if x.strip()]
    rates = [r["samples_per_s"] for r in records if r.get("kind") == "train"][1:]
    return {"samples_per_s": statistics.median(rates), "wall_s": wall, "records": records}


def sync_upload_s(cache: Path, output: str) -> float:
    """A synchronous upload of the store run's last local checkpoint directory, timed."""
    from torchloom.runs.rundir import RunDir
    from torchloom.store import storage

    os.environ["TORCHLOOM_CACHE"] = str(cache)
    rd = RunDir(output)
    last = sorted(rd.checkpoints.glob("step-*"), key=lambda p: int(p.name.split("-")[1]))[-1]
    started = time.perf_counter()
    storage.push_tree(last, storage.join(f"s3://{BUCKET}", "sync-upload", last.name), last=("meta.json",))
    return time.perf_counter() - started


def prepared_demo(tmp: Path) -> Path:
    out = tmp / "demo"
    subprocess.run([sys.executable, "-m", "torchloom", "prepare", "--output.dir", str(out), "--tracking.enabled",
                    "false"], check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return out / "data"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--train-steps", type=int, default=40)
    p.add_argument("--train-rounds", type=int, default=1)
    p.add_argument("--skip-train", action="store_true")
    p.add_argument("--input-rows", type=int, default=200_000)
    p.add_argument("--skip-loader", action="store_true")
    p.add_argument("--server-cpu", type=int, default=None,
                   help="run the S3 server on this CPU alone and everything else on the others, as a store on"
                        " hosts of its own would (the loader and training then have one core fewer)")
    p.add_argument("--prepare-rounds", type=int, default=1, help="whole `torchloom prepare` runs of the input")
    a = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from torchloom.machine import cpu

    print(f"cpu: {cpu().describe()}", flush=True)
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        server_cpus = {a.server_cpu} if a.server_cpu is not None else None
        server, endpoint = start_server(tmp / "moto.log", server_cpus)
        if server_cpus:
            os.sched_setaffinity(0, os.sched_getaffinity(0) - server_cpus)
            print(f"the S3 server on CPU {a.server_cpu}; the rest on CPUs {sorted(os.sched_getaffinity(0))}",
                  flush=True)
        try:
            loader = [] if a.skip_loader else bench_loader(tmp, a.rows, a.rounds, server.pid, tmp / "moto.log")
            inputs = bench_input(tmp, a.input_rows, a.rounds, a.prepare_rounds) if a.input_rows else []
            runs = []
            if not a.skip_train:
                data = prepared_demo(tmp)
                for r in range(a.train_rounds):
                    local = train(str(tmp / "local-run"), a.train_steps, data, tmp / "cache")
                    store = train(f"s3://{BUCKET}/train-run", a.train_steps, data, tmp / "cache")
                    sync = sync_upload_s(tmp / "cache", f"s3://{BUCKET}/train-run")
                    runs.append((local, store, sync))
                    print(f"train round {r + 1}: local {local['samples_per_s']:.2f}, store {store['samples_per_s']:.2f}"
                          f" samples/s; synchronous upload {sync:.2f} s", flush=True)
        finally:
            server.terminate()
    print("\n| measure | local | store | store / local | goal |\n|---|---:|---:|---:|---|")
    med = statistics.median
    if loader:
        la, lb = med(x[1] for x in loader), med(x[2] for x in loader)
        print(f"| loader rows/s (median of {len(loader)} rounds, {a.rows:,} rows) | {la:,.0f} | {lb:,.0f} |"
              f" {lb / la:.3f} | >= 0.9 |")
        print(f"| loader CPU seconds per epoch, store / local (median); the S3 server's CPU on the same cores |"
              f" 1.00 | {med(x[3] for x in loader):.2f} | {1 / med(x[3] for x in loader):.3f} (CPU-bound bound) |"
              f" {med(x[4] for x in loader):.2f} s |")
        print(f"| requests to the S3 server per store epoch (median) | - | {med(x[5] for x in loader):.0f} | - | - |")
    whole = [x for x in inputs if x[0] == "prepare"]
    inputs = [x for x in inputs if x[0] != "prepare"]
    if inputs:
        ia, ib, ic = (med(x[i] for x in inputs) for i in (1, 2, 3))
        print(f"| prepare's input, rows/s read and parsed (median of {len(inputs)}, {a.input_rows:,} CSV rows):"
              f" Spark on disk / the tasks streaming from the store | {ia:,.0f} | {ib:,.0f} | {ib / ia:.3f} | - |")
        print(f"| prepare's input: Spark on disk / download to disk + Spark (the embedded Spark's way) | {ia:,.0f} |"
              f" {ic:,.0f} | {ic / ia:.3f} | - |")
    for _, pa_, pb, pc in whole:
        print(f"| `torchloom prepare` rows/s (median of {a.prepare_rounds}): from disk / through the tasks from the"
              f" store | {pa_:,.0f} | {pb:,.0f} | {pb / pa_:.3f} | - |")
        print(f"| `torchloom prepare` rows/s: from disk / downloaded first | {pa_:,.0f} | {pc:,.0f} | {pc / pa_:.3f} |"
              " - |")
    for i, (local, store, sync) in enumerate(runs, 1):
        print(f"| training samples/s, round {i} ({a.train_steps} steps, checkpoint every 10) |"
              f" {local['samples_per_s']:.2f} | {store['samples_per_s']:.2f} |"
              f" {store['samples_per_s'] / local['samples_per_s']:.3f} | >= 0.97 |")
        ups = [r for r in store["records"] if r.get("kind") == "checkpoint"]
        blocked = med(r["blocked_s"] for r in ups)
        print(f"| blocked_s per checkpoint (median of {len(ups)}) against a synchronous upload, round {i} |"
              f" {sync:.2f} (sync) | {blocked:.2f} | {blocked / sync:.3f} | <= 0.2 |")
        print(f"| upload_s per checkpoint in the background (median), round {i} | - |"
              f" {med(r['upload_s'] for r in ups):.2f} | - | - |")


if __name__ == "__main__":
    main()
