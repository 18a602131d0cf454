"""Device placement: one process per GPU, never two ranks on one device; the engine's assignment wins."""

from __future__ import annotations

import pytest
import torch

from torchloom.config import build
from torchloom.engines import local
from torchloom.errors import UserError
from torchloom.train.distributed import pick_device

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_the_device_an_engine_assigned_wins():
    assert pick_device("auto", 5, assigned="cpu") == torch.device("cpu")
    assert pick_device("cpu", 0) == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only host")
def test_cuda_without_a_gpu_is_one_line():
    with pytest.raises(UserError, match="torch sees no CUDA device") as e:
        pick_device("cuda", 0)
    assert "\n" not in str(e.value)
    assert pick_device("auto", 3) == torch.device("cpu")


@cuda
@pytest.mark.gpu
def test_each_local_rank_takes_its_own_gpu_and_none_beyond_the_count():
    count = torch.cuda.device_count()
    assert [pick_device("auto", r) for r in range(count)] == [torch.device("cuda", r) for r in range(count)]
    with pytest.raises(UserError, match=f"has {count} visible GPU"):
        pick_device("auto", count)


@cuda
@pytest.mark.gpu
def test_more_local_workers_than_gpus_is_refused_before_launch(tmp_path):
    count = torch.cuda.device_count()
    cfg = build(None, ["--output.dir", str(tmp_path), "--engine.workers", str(count + 1), "--train.batch_size",
                       str(16 * (count + 1))])
    with pytest.raises(UserError, match=f"--engine.workers {count}"):
        local.check_gpus(cfg)
    local.check_gpus(build(None, ["--output.dir", str(tmp_path), "--engine.device", "cpu", "--engine.workers",
                                  str(count + 1), "--train.batch_size", str(16 * (count + 1))]))
