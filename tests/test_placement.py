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


def test_torchrun_warns_of_a_multi_node_launch_whose_nodes_could_not_rejoin():
    from torchloom.engines.torchrun import rendezvous_warning

    multi = {"RANK": "0", "TORCHELASTIC_RESTART_COUNT": "0", "GROUP_WORLD_SIZE": "2",
             "TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in rendezvous_warning(multi)
    assert rendezvous_warning({**multi, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
                               "TORCHELASTIC_USE_AGENT_STORE": "False"}) == ""
    assert rendezvous_warning({**multi, "GROUP_WORLD_SIZE": "1"}) == ""  # one node: its own restarts are fine
    assert rendezvous_warning({**multi, "TORCHELASTIC_MAX_RESTARTS": "0"}) == ""  # nothing to rejoin
    assert rendezvous_warning({**multi, "RANK": "3"}) == ""  # rank 0 says it once


def test_a_rank_on_a_gpu_makes_it_the_current_device_with_or_without_the_engine_s_group(monkeypatch, tmp_path):
    # CUDA events (the step clock), pinning threads and NCCL use the current device: a rank on cuda:1 that left it
    # at 0 would time and pin on another rank's GPU. Both paths: a group torchloom makes, one the engine made (Ray).
    import torch.distributed as dist

    from torchloom.train import distributed

    chosen = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: chosen.append(torch.device(device)))
    monkeypatch.setenv("WORLD_SIZE", "1")
    d = distributed.setup("auto", 0, assigned="cuda:1")
    assert d.device == torch.device("cuda", 1) and chosen == [torch.device("cuda", 1)]
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        d = distributed.setup("auto", 0, assigned="cuda:1")
        assert d.device == torch.device("cuda", 1) and chosen[1:] == [torch.device("cuda", 1)]
    finally:
        dist.destroy_process_group()
