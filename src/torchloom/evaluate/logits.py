"""The logits of a range of a prepared split's rows, in eval.batch_size batches and eval.precision: what one
process scoring a whole split (evaluate/run.py) and each Spark task scoring a range of it
(evaluate/spark_scoring.py) both run."""

from __future__ import annotations

import numpy as np
import torch

from torchloom.config import Config
from torchloom.data.eval_rows import range_batches
from torchloom.data.packing import pack_batch
from torchloom.manifest import Manifest
from torchloom.model.device import choose_precision
from torchloom.model.forward import prepared_logits
from torchloom.model.packing import check_packing


def range_logits(cfg: Config, model, manifest: Manifest, split: str, start: int, count: int, device: torch.device
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(logits, labels, row positions) of rows [start, start + count) of `split`, in eval.batch_size batches, the
    model on `device` in eval.precision's choice for it: a range that starts at a multiple of the batch size gives
    exactly the rows' logits the whole split's scoring does (data/eval_rows.py)."""
    precision = choose_precision(cfg.eval.precision, device, key="eval.precision").precision
    batches = range_batches(manifest, split, start, count, cfg.eval.batch_size)
    if cfg.train.packing:  # the same logits with less padding: batches in file order mix short and long texts
        check_packing(model)
        batches = map(pack_batch, batches)
    return prepared_logits(model, batches, device, precision, manifest.num_labels)
