"""The baseline: a minimal hand-written DDP fine-tuning loop, launched with torchrun.

    python -m torch.distributed.run --nproc-per-node 2 benchmarks/bare_ddp.py \\
        DATA_DIR MODEL_DIR STEPS BATCH PRECISION OUT

Reads the same prepared Parquet as torchloom (whole, into memory), slices it by rank, trains STEPS
optimizer steps with AdamW, and writes {"samples_per_s", "first_step_s", "total_s"} to OUT from rank 0.
Throughput excludes the first 3 steps (warm-up), as torchloom's figure does by its log windows.
"""

import json
import os
import sys
import time

T0 = time.perf_counter()

import pyarrow.parquet as pq  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from transformers import AutoModelForSequenceClassification  # noqa: E402


def main() -> None:
    data_dir, model_dir, steps, batch, precision, out = sys.argv[1:7]
    steps, batch = int(steps), int(batch)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    table = pq.read_table(os.path.join(data_dir, "train"), columns=["input_ids", "label_id"])
    ids, labels = table.column("input_ids").to_pylist(), table.column("label_id").to_pylist()
    ids, labels = ids[rank::world], labels[rank::world]
    num_labels = len(json.load(open(os.path.join(data_dir, "manifest.json")))["labels"])
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=num_labels)
    model.train()
    model = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-5, fused=True)  # the same kernel torchloom uses
    micro = batch // world
    t_first = t_warm = None
    for step in range(steps):
        i = (step * micro) % max(1, len(ids) - micro)
        chunk = ids[i:i + micro]
        length = max(len(x) for x in chunk)
        x = torch.tensor([c + [0] * (length - len(c)) for c in chunk])
        mask = torch.tensor([[1] * len(c) + [0] * (length - len(c)) for c in chunk])
        y = torch.tensor(labels[i:i + micro])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            logits = model(input_ids=x, attention_mask=mask).logits
        F.cross_entropy(logits.float(), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step == 0:
            t_first = time.perf_counter() - T0
        if step == 2:
            t_warm = time.perf_counter()
    elapsed = time.perf_counter() - t_warm
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"samples_per_s": (steps - 3) * batch / elapsed, "first_step_s": t_first,
                       "total_s": time.perf_counter() - T0}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
