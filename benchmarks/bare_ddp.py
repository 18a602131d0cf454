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

same_work (--same-work): at each epoch end (every ceil(train rows / BATCH) steps) the loop also does what
torchloom does there with its defaults: a forward over the validation split (its rank's share, batches of 16,
eval mode, no gradients) and, on rank 0, a checkpoint of the model and the optimizer (torch.save to a temporary
directory) while the other ranks wait at a barrier.
"""

import argparse
import json
import os
import time

T0 = time.time()


def epoch_end_work(model, opt, val: list, on, rank: int) -> None:
    """What torchloom does at an epoch end: validation, then rank 0's checkpoint (see same_work above)."""
    import tempfile

    import torch
    import torch.distributed as dist

    model.eval()
    with torch.inference_mode():
        for i in range(0, len(val), 16):
            chunk = val[i:i + 16]
            length = max(len(x) for x in chunk)
            x = torch.tensor([c + [0] * (length - len(c)) for c in chunk]).to(on)
            mask = torch.tensor([[1] * len(c) + [0] * (length - len(c)) for c in chunk]).to(on)
            model.module(input_ids=x, attention_mask=mask)
    model.train()
    if rank == 0:
        with tempfile.TemporaryDirectory() as d:
            torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict()}, os.path.join(d, "c.pt"))
    dist.barrier()


def bare_loop(data_dir: str, model_dir: str, steps: int, batch: int, precision: str,
              launch_time: float = 0.0, device: str = "cpu", warmup: int = 3, same_work: bool = False) -> dict:
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
    epoch_steps = -(-len(ids) // batch)
    ids, labels = ids[rank::world], labels[rank::world]
    val = pq.read_table(os.path.join(data_dir, "val"), columns=["input_ids"]).column("input_ids").to_pylist()[
        rank::world] if same_work else []
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
        if same_work and (step + 1) % epoch_steps == 0:
            epoch_end_work(model, opt, val, on, rank)
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
    p.add_argument("--same-work", action="store_true", help="validation and a checkpoint at each epoch end")
    a = p.parse_args()
    import torch.distributed as dist

    result = bare_loop(a.data_dir, a.model_dir, int(a.steps), int(a.batch), a.precision, a.launch_time, a.device,
                       max(1, a.warmup), a.same_work)
    if dist.get_rank() == 0:
        with open(a.out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
