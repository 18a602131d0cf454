"""The baseline: a minimal hand-written DDP fine-tuning loop, under any launcher.

    python -m torch.distributed.run --nproc-per-node 2 benchmarks/bare_ddp.py \\
        DATA_DIR MODEL_DIR STEPS BATCH PRECISION OUT [LAUNCH_TIME] [--device cuda] [--warmup 3]

`bare_loop(...)` is the same loop as a function, for a bare `TorchDistributor.run` and a bare
`TorchTrainer.fit` (benchmarks/engines.py). It reads the prepared Parquet whole into memory, slices
it by rank, trains STEPS optimizer steps with AdamW (fused, the kernel torchloom uses) and returns
{"samples_per_s", "tokens_per_s", "first_step_s", "total_s"} on rank 0. Throughput excludes the first
`warmup` steps (3 unless told): it is timed from the end of step `warmup` to the end of the last, the
device synchronised at both ends on a GPU (one process per GPU, nccl; on a CPU gloo); tokens are the
attention mask's ones. first_step_s counts from LAUNCH_TIME (the launcher's start) when given, else from
process start.
"""

import argparse
import json
import os
import time

T0 = time.time()


def bare_loop(data_dir: str, model_dir: str, steps: int, batch: int, precision: str,
              launch_time: float = 0.0, device: str = "cpu", warmup: int = 3) -> dict:
    import pyarrow.parquet as pq
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    from transformers import AutoModelForSequenceClassification

    if not dist.is_initialized():
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    on = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if device == "cuda" else "cpu")
    sync = torch.cuda.synchronize if on.type == "cuda" else (lambda: None)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    table = pq.read_table(os.path.join(data_dir, "train"), columns=["input_ids", "label_id"])
    ids, labels = table.column("input_ids").to_pylist(), table.column("label_id").to_pylist()
    ids, labels = ids[rank::world], labels[rank::world]
    with open(os.path.join(data_dir, "manifest.json")) as f:
        num_labels = len(json.load(f)["labels"])
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(
        model_dir, num_labels=num_labels, attention_probs_dropout_prob=0.0)  # as torchloom's default
    model.to(on).train()
    model = DDP(model, device_ids=[on.index] if on.type == "cuda" else None)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-5, fused=True)
    micro = batch // world
    first = warm = None
    tokens = 0
    for step in range(steps):
        i = (step * micro) % max(1, len(ids) - micro)
        chunk = ids[i:i + micro]
        length = max(len(x) for x in chunk)
        x = torch.tensor([c + [0] * (length - len(c)) for c in chunk]).to(on)
        mask = torch.tensor([[1] * len(c) + [0] * (length - len(c)) for c in chunk]).to(on)
        y = torch.tensor(labels[i:i + micro]).to(on)
        with torch.autocast(on.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            logits = model(input_ids=x, attention_mask=mask).logits
        F.cross_entropy(logits.float(), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step == 0:
            first = time.time() - (launch_time or T0)
        if step == warmup - 1:
            sync()
            warm = time.perf_counter()
        elif warm is not None:
            tokens += sum(len(c) for c in chunk)
    sync()
    seconds = time.perf_counter() - warm
    tokens = torch.tensor([float(tokens)], device=on)
    dist.all_reduce(tokens)  # after the clock stopped: every rank's real tokens
    result = {"samples_per_s": (steps - warmup) * batch / seconds, "tokens_per_s": float(tokens) / seconds,
              "first_step_s": first, "total_s": time.time() - (launch_time or T0)}
    dist.barrier()
    return result


def main() -> None:
    p = argparse.ArgumentParser()
    for name in ("data_dir", "model_dir", "steps", "batch", "precision", "out"):
        p.add_argument(name)
    p.add_argument("launch_time", nargs="?", type=float, default=0.0)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the throughput (at least 1)")
    a = p.parse_args()
    import torch.distributed as dist

    result = bare_loop(a.data_dir, a.model_dir, int(a.steps), int(a.batch), a.precision, a.launch_time, a.device,
                       max(1, a.warmup))
    if dist.get_rank() == 0:
        with open(a.out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
