"""One GPU, one table (issue 48, item 6): training and serving efficiency, torchloom against its baselines.

    .venv/bin/python benchmarks/gpu.py [--write]            # on a GPU: ~5 minutes on an H100/H200 (under 8)
    .venv/bin/python benchmarks/gpu.py --device cpu --tiny  # the dry run: tiny models, a few steps and requests
    .venv/bin/python benchmarks/gpu.py --bundle .gpu        # what a lent GPU machine lacks, to carry there (below)
    .venv/bin/python benchmarks/gpu.py --record FILE        # a section a lent machine saved (--save), into the docs

Training, for (a) all-MiniLM-L6-v2 (the embedded one) and (b) a BERT-base-sized encoder with random weights
(a transformers BertConfig, 12 layers, 768 hidden, 12 heads, 3072 feed-forward, with MiniLM's tokenizer files:
model/tiny.write_tiny_model), each with a fresh 5-label head, on prepared rows of exactly --seq-len tokens
(128; synthetic ids, data/synthetic.py: no padding, so tokens = samples x 128), at one global batch (--batch,
256) and one precision (bf16 on a GPU that has it, else fp32), one process on one device, the sides one after
the other:
- bare loop (the baseline): bare_ddp.bare_loop, the one rank of a one-process group, both models in turn in one
  process;
- torchloom train: `torchloom train` on the same prepared data, one run per model, one worker, its defaults but
  for no evaluation and no checkpoint before the end; tokens/s and MFU as the run itself reports them
  (metrics.jsonl), its padding and time split from train_result.json;
- HF Trainer: transformers' Trainer on the same rows (hf_trainer.py's dataset), both models in turn in one
  process, its defaults but for the batch, the precision, attention dropout 0 (torchloom's default and the bare
  loop's) and no saving.
Timing: every side times the same window the same way: from the end of step --warmup-steps (10) to the end of
the last step (--steps, 100, later), the device synchronised at both ends (on a GPU a step only queues work):
start-up, the first steps' allocation and autotuning are outside it. torchloom's ends are the wall clock of its
metrics.jsonl lines at those steps (train.log_every = the warm-up, so a line falls on both; a log step
synchronises the device); the bare loop's are its own clock, the HF Trainer's a callback's at on_step_end.
MFU: model FLOPs (train/clock.py's formula: 6 N per token + 12 L h t^2 per sequence for a training step, a third
of it for a forward) a second over the device's dense peak for the precision (machine.gpu_peak_tflops); '-'
where the peak is not known (any CPU). The torchloom rows show the run's own figure; a line under the table
checks it against this script's.

Serving: MiniLM with a fresh head, exported (serve.export_benchmark_model); one BBC News headline + lede per
request (serve.load_texts, or --texts); the baseline is the offline rate (serve.offline: Predictor.predict on
lists of B texts, no HTTP, the best B; under the server's precision); torchloom serve (its defaults, the same
--precision) at c = 1, 8, 64 (serve.measure_server; the load generator runs on the same host).

Prints one table, every row with the device and the CPU model (`lscpu`); --write records it in
docs/benchmarks.md under "## On a GPU (benchmarks/gpu.py)", newest run first; --save FILE writes the same
section to FILE.

On a lent machine (the device tool: its image has torch, transformers, accelerate, aiohttp and pyarrow, but not
MiniLM, the BBC texts or the serving packages, and a call carries at most 64 MiB):
  here, once:  `echo /.gpu/ >> .git/info/exclude`, then `.venv/bin/python benchmarks/gpu.py --bundle .gpu`
               (MiniLM with fp16 weights, 45 MB; the texts; the wheels in WHEELS for CPython 3.12)
  there:       run(carry=[".gpu"], timeout_s=600, command="python3 -m pip install -q --no-index --no-deps
               --target /tmp/site .gpu/whl/*.whl && PYTHONPATH=src:/tmp/site PYTHONUNBUFFERED=1 python3
               benchmarks/gpu.py --minilm .gpu/minilm --texts .gpu/texts.json --save $OUT/gpu.md 2>&1 |
               tee $OUT/log")
  here again:  `.venv/bin/python benchmarks/gpu.py --record <files_at>/gpu.md`
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from pathlib import Path

from serve import CONCURRENCY, LABELS, Process, export_benchmark_model, load_texts, measure_server, offline, write_doc

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
TITLE = "On a GPU (benchmarks/gpu.py)"
TORCHLOOM = [sys.executable, "-m", "torchloom"]
BERT_BASE = {"hidden": 768, "layers": 12, "heads": 12, "intermediate": 3072}
TINY_BERT = {"hidden": 48, "layers": 2, "heads": 2, "intermediate": 192}  # the dry run's stand-in for it
WHEELS = ("fastapi", "starlette", "pydantic", "pydantic_core", "annotated-types", "typing-inspection", "uvicorn",
          "tomli_w")  # what `torchloom train` and `serve` import that the lent machines' image lacks
INTRO = ("`benchmarks/gpu.py` (its docstring says how each side is run and timed): training samples/s, tokens/s"
         " and MFU of MiniLM and a BERT-base-sized encoder (random weights) at sequence length 128, torchloom"
         " against a bare loop and the HF Trainer at the same batch and precision; serving at c = 1, 8, 64"
         " against the offline rate. Newest run first.")


@dataclass(frozen=True)
class Plan:
    device: str  # cpu | cuda
    precision: str  # fp32 | bf16 | fp16
    batch: int
    seq_len: int
    warmup: int  # steps before the timed window
    steps: int  # steps in it
    requests: int  # per concurrency level (c=1: a quarter, at least 100)
    time_cap: float  # seconds per concurrency level, and for the offline rates
    tiny: bool
    compile: bool = False  # torchloom train with --train.compile true (compiling adds about a minute a model)

    @property
    def total(self) -> int:
        return self.warmup + self.steps


# --- the machine -----------------------------------------------------------------------------------------


def cpu_model() -> str:
    """`lscpu`'s Model name, else /proc/cpuinfo's, else what Python knows."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        match = re.search(r"^Model name:\s*(.+)$", out, re.M)
        if match:
            return match.group(1).strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        match = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
        if match:
            return match.group(1).strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name(device: str) -> str:
    import torch

    return torch.cuda.get_device_name(0) if device == "cuda" else "no GPU (CPU)"


def choose_precision(device: str, asked: str) -> str:
    """bf16 on a GPU that has it, else fp32 (a CPU too: the dry run only checks that everything runs)."""
    import torch

    if asked != "auto":
        return asked
    return "bf16" if device == "cuda" and torch.cuda.is_bf16_supported() else "fp32"


def peak_tflops(device: str, precision: str) -> float | None:
    from torchloom.machine import gpu_peak_tflops

    return gpu_peak_tflops(device_name(device), precision) if device == "cuda" else None


# --- model FLOPs (train/clock.py's formula, through its own code) ----------------------------------------


def model_flops(model_dir: str, lengths: list[int]) -> tuple[float, float]:
    """(real tokens, training FLOPs) of sequences of these lengths through the model at `model_dir`: StepClock's
    count over an attention mask, the model's shape from flops_shape (built on the meta device: no weights)."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from torchloom.train.clock import StepClock, flops_shape

    config = AutoConfig.from_pretrained(model_dir, num_labels=len(LABELS), local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForSequenceClassification.from_config(config)
    clock = StepClock(torch.device("cpu"), flops_shape(model))
    lengths_t = torch.tensor(lengths)
    clock.count((torch.arange(int(lengths_t.max()))[None, :] < lengths_t[:, None]).long())
    return clock.run["real_tokens"], clock.run["flops"]


# --- models and data -------------------------------------------------------------------------------------


def fp32_model(model_dir: str, work: Path) -> str:
    """`model_dir` where its weights are fp32; else a copy with fp32 weights (a --bundle's MiniLM is fp16 to fit
    the carry, and transformers would load it, and train it, in fp16)."""
    from safetensors import safe_open

    weights = Path(model_dir) / "model.safetensors"
    with safe_open(str(weights), "pt") as f:
        half = any(f.get_slice(k).get_dtype() in ("F16", "BF16") for k in f.keys())  # noqa: SIM118
    if not half:
        return model_dir
    out = work / "minilm-fp32"
    shutil.copytree(model_dir, out, ignore=shutil.ignore_patterns("model.safetensors"))
    cast_weights(weights, out / "model.safetensors", "float32")
    return str(out)


def cast_weights(src: Path, dst: Path, dtype: str) -> None:
    """A safetensors file with its floating-point tensors cast to `dtype` (float16 or float32)."""
    import torch
    from safetensors.torch import load_file, save_file

    to = getattr(torch, dtype)
    save_file({k: v.to(to) if v.is_floating_point() else v for k, v in load_file(str(src)).items()}, str(dst),
              metadata={"format": "pt"})


def models(plan: Plan, minilm: str, work: Path) -> list[tuple[str, str]]:
    """(label, model dir) of (a) MiniLM and (b) the BERT-base-sized encoder; tiny stand-ins for both in a dry run."""
    from torchloom.model.tiny import write_tiny_model

    if plan.tiny:
        return [("tiny stand-in for MiniLM-L6 (2 layers, 32 hidden)",
                 write_tiny_model(work / "tiny", tokenizer_from=minilm)),
                ("tiny stand-in for BERT-base ({layers} layers, {hidden} hidden)".format(**TINY_BERT),
                 write_tiny_model(work / "bert", tokenizer_from=minilm, **TINY_BERT))]
    return [("MiniLM-L6", minilm),
            ("BERT-base-sized, random (12 layers, 768 hidden)",
             write_tiny_model(work / "bert", tokenizer_from=minilm, **BERT_BASE))]


def write_data(run_dir: Path, model_dir: str, plan: Plan) -> Path:
    """Prepared rows of exactly seq_len tokens, enough for every step in one epoch (no epoch end in the window)."""
    from transformers import AutoConfig

    from torchloom.data.synthetic import write_synthetic_dataset

    vocab = AutoConfig.from_pretrained(model_dir, local_files_only=True).vocab_size
    rows = {"train": plan.batch * (plan.total + 1), "val": plan.batch, "test": 16}
    write_synthetic_dataset(run_dir / "data", rows=rows, num_labels=len(LABELS), rows_per_group=1024,
                            rows_per_shard=8192, min_len=plan.seq_len, max_len=plan.seq_len, vocab_size=vocab)
    return run_dir / "data"


# --- the three training sides ----------------------------------------------------------------------------


def child_env(plan: Plan) -> dict[str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if plan.device == "cuda":
        env.setdefault("CUDA_VISIBLE_DEVICES", "0")  # one GPU: the HF Trainer would take every GPU it sees
    return env


def run(cmd: list[str], log: Path, plan: Plan, env: dict[str, str] | None = None) -> None:
    with open(log, "wb") as out:
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env={**child_env(plan), **(env or {})},
                              cwd=ROOT)
    if proc.returncode != 0:
        tail = log.read_text(errors="replace")[-4000:]
        raise SystemExit(f"{' '.join(cmd[:4])} ... failed ({proc.returncode}); the end of {log}:\n{tail}")


def one_process(side: str, runs: list[dict], plan: Plan, work: Path) -> list[dict]:
    """The bare loop or the HF Trainer on each model in turn, in one process of its own (one start-up per side:
    no side's window sees start-up). The bare loop is the one rank of a one-process group, with the variables
    torchrun would set."""
    import socket

    out = work / f"{side}.json"
    env = {}
    if side == "bare":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(s.getsockname()[1]), "RANK": "0",
                   "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
    job = {"side": side, "runs": runs, "plan": plan.__dict__, "out": str(out)}
    run([sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(job)], work / f"{side}.log", plan, env)
    return json.loads(out.read_text())


def worker(job: dict) -> None:
    """--worker: one side on each run of `job` in turn; their results, a list, to job["out"]."""
    plan = Plan(**job["plan"])
    if job["side"] == "bare":
        import torch.distributed as dist
        from bare_ddp import bare_loop

        results = [bare_loop(r["data"], r["model"], plan.total, plan.batch, plan.precision, device=plan.device,
                             warmup=plan.warmup) for r in job["runs"]]
        dist.destroy_process_group()
    else:
        results = [hf_side(r, plan) for r in job["runs"]]
    Path(job["out"]).write_text(json.dumps(results))


def hf_side(r: dict, plan: Plan) -> dict:
    """The HF Trainer on one model: steady samples/s over the same window, timed by a callback at its ends."""
    import pyarrow.parquet as pq
    import torch
    from hf_trainer import Encoded
    from transformers import (
        AutoModelForSequenceClassification,
        AutoTokenizer,
        DataCollatorWithPadding,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    table = pq.read_table(os.path.join(r["data"], "train"), columns=["input_ids", "label_id"])
    ids = table.column("input_ids").to_pylist()
    rows = Encoded({"input_ids": ids, "attention_mask": [[1] * len(x) for x in ids]},
                   table.column("label_id").to_pylist())
    sync = torch.cuda.synchronize if plan.device == "cuda" else (lambda: None)
    marks: dict[int, float] = {}

    class Window(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step in (plan.warmup, plan.total):
                sync()
                marks[state.global_step] = time.perf_counter()

    model = AutoModelForSequenceClassification.from_pretrained(r["model"], num_labels=len(LABELS),
                                                               attention_probs_dropout_prob=0.0)
    args = TrainingArguments(output_dir=os.path.join(r["data"], "..", "hf-out"), per_device_train_batch_size=plan.batch,
                             max_steps=plan.total, bf16=plan.precision == "bf16", fp16=plan.precision == "fp16",
                             use_cpu=plan.device == "cpu", save_strategy="no", report_to=[],
                             logging_steps=plan.warmup, seed=42, disable_tqdm=True)
    Trainer(model=model, args=args, train_dataset=rows, callbacks=[Window()],
            data_collator=DataCollatorWithPadding(AutoTokenizer.from_pretrained(r["model"]))).train()
    samples_per_s = plan.steps * plan.batch / (marks[plan.total] - marks[plan.warmup])
    mean_length = sum(map(len, ids)) / len(ids)  # every row is seq_len long: no padding to leave out
    return {"samples_per_s": samples_per_s, "tokens_per_s": samples_per_s * mean_length,
            "optim": str(getattr(args.optim, "value", args.optim))}


def torchloom_train(run_dir: Path, model_dir: str, plan: Plan) -> dict:
    """samples/s over the window from its metrics.jsonl lines' wall clock; tokens/s and MFU, the windows' own
    figures weighted by their seconds; padding and the time split of the whole run (train_result.json)."""
    run(TORCHLOOM + ["train", "--output.dir", str(run_dir), "--model.path", model_dir, "--engine.workers", "1",
                     "--engine.device", plan.device, "--train.batch_size", str(plan.batch),
                     "--train.max_steps", str(plan.total), "--train.precision", plan.precision,
                     "--train.log_every", str(plan.warmup), "--train.eval_every", str(10 * plan.total),
                     "--train.checkpoint_every", str(10 * plan.total), "--train.warmup_ratio", "0",
                     "--tracking.enabled", "false", *(["--train.compile", "true"] if plan.compile else [])],
        run_dir / "torchloom.log", plan)
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    train = {x["step"]: x for x in lines if x.get("kind") == "train"}
    seconds = train[plan.total]["time"] - train[plan.warmup]["time"]
    tokens = flops_share = 0.0  # each window's rate times its own seconds (its rows over its samples/s)
    steps = sorted(s for s in train if s >= plan.warmup)
    for before, step in zip(steps, steps[1:]):
        window_s = (step - before) * plan.batch / train[step]["samples_per_s"]
        tokens += train[step]["tokens_per_s"] * window_s
        flops_share += train[step].get("mfu", float("nan")) * window_s
    result = json.loads((run_dir / "train_result.json").read_text())
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # a BERT-base run's is 1.3 GB
    return {"samples_per_s": (plan.total - plan.warmup) * plan.batch / seconds, "tokens_per_s": tokens / seconds,
            "mfu": None if flops_share != flops_share else flops_share / seconds,  # NaN: no peak known
            "padding": result.get("padding"), "time_split": result.get("time_split", {})}


def attempt(what: str, fn, failed: list[str]):
    """fn()'s result, or None where it failed (said, and noted in `failed`): a lent GPU is one try, so a side that
    fails leaves the others' rows."""
    try:
        return fn()
    except (SystemExit, Exception) as e:
        print(f"{what}: FAILED: {e}", flush=True)
        failed.append(f"{what}: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
        return None


def training(pairs: list[tuple[str, str]], plan: Plan, work: Path,
             failed: list[str]) -> list[list[tuple[str, dict | None]]]:
    """For each model, the three sides' (name, result; None where it failed): the bare loop on both models in one
    process, torchloom one run per model, the HF Trainer on both in one process."""
    runs = [{"model": model_dir, "data": str(write_data(work / f"run{i}", model_dir, plan))}
            for i, (_, model_dir) in enumerate(pairs)]

    def ours() -> list[dict | None]:
        return [attempt(f"torchloom train, {label}", partial(torchloom_train, work / f"run{i}", model_dir, plan),
                        failed) for i, (label, model_dir) in enumerate(pairs)]

    sides: dict[str, list[dict | None]] = {}
    for what, side in (("bare loop (baseline)", partial(one_process, "bare", runs, plan, work)),
                       ("torchloom train", ours), ("HF Trainer", partial(one_process, "hf", runs, plan, work))):
        started = time.perf_counter()
        sides[what] = attempt(f"training: {what}", side, failed) or [None] * len(runs)
        rates = ", ".join("-" if r is None else f"{r['samples_per_s']:.1f}" for r in sides[what])
        print(f"training: {what}: {rates} samples/s (took {time.perf_counter() - started:.0f} s)", flush=True)
    return [[(f"{what} ({results[i]['optim']})" if results[i] and "optim" in results[i] else what, results[i])
             for what, results in sides.items()] for i in range(len(pairs))]


def train_rows(label: str, model_dir: str, sides: list[tuple[str, dict | None]], plan: Plan,
               peak: float | None) -> tuple[list[dict], str]:
    """One model's rows (a failed side's: its name and dashes), and a line checking torchloom's own MFU and
    tokens/s against this script's."""
    _, flops = model_flops(model_dir, [plan.seq_len])  # one sequence: every row has seq_len tokens
    base = sides[0][1]["samples_per_s"] if sides[0][1] else None
    rows = []
    for what, r in sides:
        if r is None:
            rows.append(failed_row(f"training: {what}", label))
            continue
        tflops = r["samples_per_s"] * flops / 1e12
        mfu = r["mfu"] if "mfu" in r else (tflops / peak if peak else None)
        notes = f"steps {plan.warmup + 1}-{plan.total}, batch {plan.batch}, {plan.precision}"
        notes += ", --train.compile true" if plan.compile and what == "torchloom train" else ""
        if "time_split" in r:
            split = ", ".join(f"{k} {v:.0%}" for k, v in r["time_split"].items())
            notes += f"; padding {r['padding']:.0%}; run's time split: {split}"
        rows.append({"what": f"training: {what}", "model": label, "rate": r["samples_per_s"], "unit": "samples/s",
                     "tokens_s": r["tokens_per_s"], "tflops": tflops, "mfu": mfu,
                     "ratio": r["samples_per_s"] / base if base else None, "notes": notes})
    ours = rows[1]
    if ours["rate"] is None:
        return rows, f"{label}: torchloom train failed"
    formula = ours["tflops"] / peak if peak else None
    check = (f"{label}: torchloom's own MFU {fmt_share(ours['mfu'])} against this script's formula"
             f" {fmt_share(formula)}; its tokens/s {ours['tokens_s']:.0f} against samples/s x {plan.seq_len}"
             f" = {ours['rate'] * plan.seq_len:.0f}")
    return rows, check


def failed_row(what: str, model: str) -> dict:
    return {"what": what, "model": model, "rate": None, "unit": "", "tokens_s": None, "tflops": None, "mfu": None,
            "ratio": None, "notes": "FAILED: see the log"}


# --- serving ---------------------------------------------------------------------------------------------


def serve_rows(label: str, model_dir: str, texts: list[str], plan: Plan, work: Path,
               peak: float | None) -> list[dict]:
    """The offline rate (the baseline) and torchloom serve at each concurrency, MiniLM with a fresh head."""
    import torch

    from torchloom.model.device import autocast
    from torchloom.model.predict import Predictor

    started = time.perf_counter()
    served = export_benchmark_model(work / "served", "torch", texts, base=model_dir)
    lengths = [len(f["input_ids"]) for f in Predictor(served).encode(texts)]  # as the server cuts them
    tokens, flops = model_flops(served, lengths)
    per_text_tokens, per_text_flops = tokens / len(texts), flops / 3 / len(texts)  # a forward: a third

    def row(what: str, rate: float, ratio: float, notes: str) -> dict:
        tflops = rate * per_text_flops / 1e12
        return {"what": f"serving: {what}", "model": f"{label}, fresh head", "rate": rate, "unit": "texts/s",
                "tokens_s": rate * per_text_tokens,
                "tflops": tflops, "mfu": tflops / peak if peak else None, "ratio": ratio, "notes": notes}

    with autocast(torch.device(plan.device), plan.precision):  # the server's precision, in this thread
        rates = offline(served, texts, plan.time_cap, rounds=1 if plan.tiny else 3, device=plan.device)
    best_b = max(rates, key=rates.get)
    print(f"serving: offline {rates[best_b]:.1f} texts/s (export and offline took {time.perf_counter() - started:.0f}"
          " s)", flush=True)
    rows = [row(f"offline, Predictor batch {best_b}, no HTTP (baseline)", rates[best_b], 1.0,
                f"{plan.precision}; by batch: " + ", ".join(f"{b}: {v:.0f}" for b, v in rates.items()))]
    server = Process(TORCHLOOM + ["serve", served, "--port", "0", "--device", plan.device, "--precision",
                                  plan.precision], work, "torchloom-serve")
    try:
        measured = measure_server("torchloom serve", server.url, texts, plan.requests, plan.time_cap)
    finally:
        server.stop()
    for r in measured:
        rows.append(row(f"torchloom serve, c={r['concurrency']}", r["texts_s"], r["texts_s"] / rates[best_b],
                        f"p50 {r['p50']:.1f} ms, p99 {r['p99']:.1f} ms, {r['requests']} requests, {r['errors']}"
                        f" errors, mean batch {r.get('mean_batch', 0):.1f}"))
    return rows


# --- the report ------------------------------------------------------------------------------------------


def fmt_share(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def fmt(x: float | None, spec: str, unit: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{unit}"


def table(rows: list[dict], device: str, cpu: str) -> str:
    lines = ["| what | model | samples/s or texts/s | tokens/s | TFLOP/s | MFU | x baseline | notes | device | CPU |",
             "|---|---|---:|---:|---:|---:|---:|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['what']} | {r['model']} | {fmt(r['rate'], '.1f', ' ' + r['unit'])} |"
                     f" {fmt(r['tokens_s'], '.0f')} | {fmt(r['tflops'], '.2f')} | {fmt_share(r['mfu'])} |"
                     f" {fmt(r['ratio'], '.2f')} | {r['notes']} | {device} | {cpu} |")
    return "\n".join(lines)


def goals(rows: list[dict], device: str, dry: bool) -> list[str]:
    """Issue 48's goals on a GPU: BERT-base-sized training MFU >= 35 % (bf16, H100), serving >= 0.5x offline at
    c=64. A dry run meets or misses none."""
    if dry:
        return ["- none judged: a dry run measures nothing"]
    out = []
    bert = next((r for r in rows if r["what"] == "training: torchloom train" and "BERT-base" in r["model"]), None)
    if bert is not None:
        met = "met" if bert["mfu"] is not None and bert["mfu"] >= 0.35 else "NOT met"
        out.append(f"- torchloom train, BERT-base-sized: MFU {fmt_share(bert['mfu'])} (goal >= 35 % on an H100 with"
                   f" bf16; here {device}): {met}")
    c64 = next((r for r in rows if r["what"].endswith(f"c={CONCURRENCY[-1]}") and r["ratio"] is not None), None)
    if c64 is not None:
        out.append(f"- torchloom serve at c={CONCURRENCY[-1]}: {c64['ratio']:.2f}x the offline rate (goal >= 0.5x):"
                   f" {'met' if c64['ratio'] >= 0.5 else 'NOT met'}")
    return out


def section(rows: list[dict], checks: list[str], plan: Plan, device: str, cpu: str, seconds: float,
            model: str) -> str:
    import torch
    import transformers

    what = "dry run (tiny models; not a measurement)" if plan.tiny else "measured"
    head = (f"### {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {device}, {cpu}\n\n"
            f"`benchmarks/gpu.py --device {plan.device}{' --tiny' if plan.tiny else ''}`, {what}: {device},"
            f" {os.cpu_count()} cores ({cpu}), torch {torch.__version__}, transformers {transformers.__version__},"
            f" Python {platform.python_version()}. Training: global batch {plan.batch}, {plan.seq_len} tokens a row"
            f" (no padding), {plan.precision}, one process; steady window steps {plan.warmup + 1}-{plan.total}."
            f" MiniLM: {model}."
            f" Serving: {plan.requests} requests per level (c=1: {max(100, plan.requests // 4)}) or"
            f" {plan.time_cap:g} s, one text per request. The whole script took {seconds:.0f} s.")
    return "\n\n".join([head, table(rows, device, cpu), "Checks:\n" + "\n".join(f"- {c}" for c in checks),
                        "Goals (issue 48):\n" + "\n".join(goals(rows, device, plan.tiny))]) + "\n"


def record(new: str, doc: Path) -> Path:
    """`new` (one run's ### section) first under the section TITLE of `doc`, the runs recorded before it after."""
    old = doc.read_text(encoding="utf-8") if doc.is_file() else "# Benchmarks\n"
    match = re.search(rf"^## {re.escape(TITLE)}\n(.*?)(?=^## |\Z)", old, flags=re.M | re.S)
    earlier = match.group(1) if match else ""
    earlier = earlier[earlier.find("\n### ") + 1:] if "\n### " in earlier else ""
    return write_doc("\n\n".join(p.strip() for p in (INTRO, new, earlier) if p.strip()), TITLE, doc)


# --- bundle: what a lent machine lacks -------------------------------------------------------------------


def bundle(out: Path) -> None:
    """MiniLM with fp16 weights (45 MB: a call carries 64 MiB), the serving texts, and the wheels in WHEELS at
    constraints.txt's versions for CPython 3.12 on x86-64 Linux."""
    from torchloom.embedded import demo_model_path
    from torchloom.model.tiny import TOKENIZER_FILES

    src, dst = Path(demo_model_path()), out / "minilm"
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", *TOKENIZER_FILES):
        if (src / name).is_file():
            shutil.copy(src / name, dst / name)
    cast_weights(src / "model.safetensors", dst / "model.safetensors", "float16")
    (out / "texts.json").write_text(json.dumps(load_texts()), encoding="utf-8")
    pins = {re.sub(r"[-_.]+", "-", n).lower(): v for n, _, v in
            (line.partition("==") for line in (ROOT / "constraints.txt").read_text().split())}
    wanted = [f"{name}=={pins[re.sub(r'[-_.]+', '-', name).lower()]}" for name in WHEELS]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux_2_28_x86_64",
                    "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64", "-d",
                    str(out / "whl"), *wanted], check=True)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"{out}: {size / 2**20:.1f} MiB ({', '.join(wanted)}); carry it with the run (see this script's docstring)")


# --- main ------------------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="the dry run: tiny models, a few steps and requests")
    p.add_argument("--precision", choices=("auto", "fp32", "bf16", "fp16"), default="auto",
                   help="auto: bf16 on a GPU that has it, else fp32")
    p.add_argument("--batch", type=int, default=0, help="global batch (default 256; --tiny 8)")
    p.add_argument("--seq-len", type=int, default=0, help="tokens a row (default 128; --tiny 32)")
    p.add_argument("--warmup-steps", type=int, default=0, help="steps before the timed window (default 10; --tiny 2)")
    p.add_argument("--steps", type=int, default=0, help="steps in the timed window (default 100; --tiny 4)")
    p.add_argument("--requests", type=int, default=0, help="requests per concurrency level (default 2000; --tiny 40)")
    p.add_argument("--time-cap", type=float, default=0, help="s per concurrency level at most (default 15; --tiny 1)")
    p.add_argument("--compile", action="store_true", help="torchloom train with --train.compile true")
    p.add_argument("--minilm", default="", help="MiniLM's dir (default: the embedded one; a --bundle's works)")
    p.add_argument("--texts", default="", help="a JSON list of texts to serve (default: serve.load_texts())")
    p.add_argument("--write", action="store_true", help=f"record the table in --doc under '## {TITLE}'")
    p.add_argument("--doc", default=str(DOC), help="the document --write and --record write (docs/benchmarks.md)")
    p.add_argument("--save", default="", help="also write the section to this file")
    p.add_argument("--record", metavar="FILE", help="put a section --save wrote into --doc; measure nothing")
    p.add_argument("--bundle", metavar="DIR", help="write what a lent GPU machine lacks into DIR; measure nothing")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    return p.parse_args()


def plan_of(a: argparse.Namespace) -> Plan:
    tiny = a.tiny

    def pick(value, full, dry):
        return value or (dry if tiny else full)

    return Plan(device=a.device, precision=choose_precision(a.device, a.precision), batch=pick(a.batch, 256, 8),
                seq_len=pick(a.seq_len, 128, 32), warmup=pick(a.warmup_steps, 10, 2), steps=pick(a.steps, 100, 4),
                requests=pick(a.requests, 2000, 40), time_cap=pick(a.time_cap, 15.0, 1.0), tiny=tiny,
                compile=a.compile)


def measure(a: argparse.Namespace) -> tuple[str, bool]:
    """The section, and whether any side failed."""
    from torchloom.embedded import model_path

    started = time.perf_counter()
    plan = plan_of(a)
    device, cpu = device_name(plan.device), cpu_model()
    peak = peak_tflops(plan.device, plan.precision)
    work = Path(tempfile.mkdtemp(prefix="torchloom-bench-gpu-"))
    try:
        minilm = fp32_model(a.minilm or model_path(""), work)
        texts = json.loads(Path(a.texts).read_text(encoding="utf-8")) if a.texts else load_texts()
        texts = texts[:32] if plan.tiny else texts
        print(f"{device}, {cpu}; {plan}; peak {peak or '-'} TFLOP/s", flush=True)
        rows, checks, failed = [], [], []
        pairs = models(plan, minilm, work)
        for (label, model_dir), sides in zip(pairs, training(pairs, plan, work, failed)):
            more, check = train_rows(label, model_dir, sides, plan, peak)
            rows += more
            checks.append(check)
        served = attempt("serving", lambda: serve_rows(*pairs[0], texts, plan, work, peak), failed)
        rows += served or [failed_row("serving", pairs[0][0])]  # MiniLM (its stand-in in a dry run)
        checks += [f"FAILED: {f}" for f in failed]
        source = "the embedded all-MiniLM-L6-v2" if not a.minilm else f"all-MiniLM-L6-v2 from {a.minilm}"
        return section(rows, checks, plan, device, cpu, time.perf_counter() - started, source), bool(failed)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    a = parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if a.worker:
        worker(json.loads(a.worker))
        return
    if a.bundle:
        bundle(Path(a.bundle))
        return
    if a.record:
        print(f"written to {record(Path(a.record).read_text(encoding='utf-8'), Path(a.doc))}")
        return
    if a.write and a.tiny and Path(a.doc).resolve() == DOC:
        raise SystemExit("--write --tiny: a dry run is not a measurement; give --doc another file to try --write")
    text, failed = measure(a)
    print("\n" + text)
    if a.save:
        Path(a.save).write_text(text, encoding="utf-8")
    if failed:
        raise SystemExit("some sides failed (their rows say FAILED; the lines above say why): not recorded")
    if a.write:
        print(f"written to {record(text, Path(a.doc))}")


if __name__ == "__main__":
    main()
