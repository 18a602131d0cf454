"""Checkpoints that verify themselves: every file's size and sha256 recorded last, checked on resume and export."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from support.command import torchloom
from support.engine_reference import COMMON, LAST, assert_same_weights, reference

from torchloom.errors import UserError
from torchloom.train import checkpoint
from torchloom.train.distributed import Dist


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return reference(tmp_path_factory.mktemp("integrity"))


def copy_run(setup, tmp_path: Path, name: str) -> Path:
    rd = tmp_path / name
    shutil.copytree(setup["ref"], rd)
    return rd


def truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


def flip_a_byte(path: Path) -> None:
    """Same size, other contents: only the hash tells."""
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))


def train(rd: Path, setup, *extra: str, expect: int = 0) -> subprocess.CompletedProcess:
    unset = {k: None for k in os.environ if k.startswith("TORCHLOOM_")}
    proc = torchloom("train", "--output.dir", str(rd), "--model.path", setup["model"], "--tracking.enabled", "false",
                     *COMMON, *extra, timeout=300, env=unset)
    assert proc.returncode == expect, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return proc


def test_every_file_of_a_checkpoint_is_recorded_with_its_hash(setup):
    ckpt = setup["ref"] / "checkpoints" / LAST
    files = json.loads((ckpt / "meta.json").read_text())["files"]
    assert {"model.safetensors", "optimizer.pt", "trainer.pt", "rng-rank0.pt", "rng-rank1.pt"} <= set(files)
    assert all(files[n]["size"] == (ckpt / n).stat().st_size for n in files)
    assert checkpoint.damage(ckpt) is None


def test_a_truncated_latest_checkpoint_is_skipped_for_the_newest_intact_one(setup, tmp_path):
    rd = copy_run(setup, tmp_path, "truncated")
    truncate(rd / "checkpoints" / LAST / "model.safetensors")
    proc = train(rd, setup, "--train.resume", "latest")
    warnings = [line for line in proc.stderr.splitlines() if "warning" in line and "skipping" in line]
    assert len(warnings) == 1, proc.stderr[-3000:]
    assert f"{LAST}/model.safetensors" in warnings[0] and "bytes" in warnings[0]
    # resumed from step-10 and trained steps 11-13 again: the uninterrupted run's weights, an intact step-13
    assert_same_weights(setup["ref"] / "checkpoints" / LAST, rd / "checkpoints" / LAST)
    assert checkpoint.damage(rd / "checkpoints" / LAST) is None


def test_no_intact_checkpoint_is_one_line_naming_the_directory(setup, tmp_path):
    rd = copy_run(setup, tmp_path, "all-damaged")
    for _, path in checkpoint.list_checkpoints(rd / "checkpoints"):
        flip_a_byte(path / "trainer.pt")
    proc = train(rd, setup, "--train.resume", "latest", expect=2)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("torchloom: error:")]
    assert len(errors) == 1 and f"no intact checkpoint in {rd / 'checkpoints'}" in errors[0], proc.stderr[-3000:]
    assert "trainer.pt differs" in errors[0] and len(errors[0]) < 300
    assert not (rd / "logs" / "rank-0.log").exists() or "rank 0 of 2" not in (rd / "logs" / "rank-0.log").read_text()


def test_a_damaged_checkpoint_named_on_purpose_is_refused(setup, tmp_path):
    rd = copy_run(setup, tmp_path, "named")
    ckpt = rd / "checkpoints" / "step-10"
    (ckpt / "optimizer.pt").unlink()
    with pytest.raises(UserError, match=r"step-10: damaged: .*optimizer\.pt is missing"):
        checkpoint.resolve(str(ckpt), rd / "checkpoints")


def test_export_skips_a_damaged_last_and_refuses_a_damaged_best(setup, tmp_path, capsys):
    rd = copy_run(setup, tmp_path, "export")
    root = rd / "checkpoints"
    truncate(root / LAST / "trainer.pt")
    assert checkpoint.select(root, "last") == root / "step-10"
    assert f"skipping {LAST}" in capsys.readouterr().err
    best = checkpoint.read_meta(root / "step-10").get("best_step", -1)
    if best >= 0:
        flip_a_byte(root / f"step-{best}" / "model.safetensors")
        with pytest.raises(UserError, match="the best checkpoint is damaged"):
            checkpoint.select(root, "best")


def test_a_sharded_checkpoint_whose_hashes_differ_is_refused(tmp_path):
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    one = Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), owns_group=False)
    root = tmp_path / "checkpoints"
    path = checkpoint.save(one, root, 1, model=model, optimizer=optimizer, trainer_state={}, meta={},
                           keep_last=2, keep=set(), sharded=True)
    shards = [p for p in (path / checkpoint.SHARDED_DIR).iterdir() if p.suffix == ".distcp"]
    assert shards and all(f"sharded/{p.name}" in checkpoint.read_meta(path)["files"] for p in shards)
    assert checkpoint.damage(path) is None
    flip_a_byte(shards[0])
    with pytest.raises(UserError, match=rf"no intact checkpoint in {root}.*{shards[0].name} differs"):
        checkpoint.resolve("latest", root)


def test_rank_0_hashes_its_files_as_it_writes_them_and_never_reads_them_back(tmp_path, monkeypatch):
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    one = Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), owns_group=False)
    reads = []
    monkeypatch.setattr(checkpoint, "sha256_file", lambda p: reads.append(p) or "")
    path = checkpoint.save(one, tmp_path / "checkpoints", 1, model=model, optimizer=optimizer,
                           trainer_state={"step": 1}, meta={}, keep_last=2, keep=set())
    assert reads == []  # before: every file read back once for meta.json
    monkeypatch.undo()
    files = checkpoint.read_meta(path)["files"]
    assert set(files) == {"model.safetensors", "optimizer.pt", "trainer.pt", "rng-rank0.pt"}
    assert checkpoint.damage(path) is None  # the hashes taken while writing are the files' hashes
    assert torch.load(path / "trainer.pt", weights_only=True) == {"step": 1}


def _resolve_on_two_ranks(rank: int, root: str, port: int, out) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        d = Dist(rank=rank, world_size=2, local_rank=rank, device=torch.device("cpu"), owns_group=False)
        checked = []
        real = checkpoint.damage
        checkpoint.damage = lambda p: checked.append(str(p)) or real(p)
        try:
            got = str(checkpoint.resolve_once(d, "latest", root))
        except UserError as e:
            got = f"error: {e}"
        out.put((rank, got, len(checked)))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("damaged", [False, True])
def test_resume_is_resolved_and_checked_once_by_rank_0_and_handed_to_every_rank(setup, tmp_path, damaged):
    import multiprocessing as mp

    from support.net import free_port

    rd = copy_run(setup, tmp_path, "resolve")
    root = rd / "checkpoints"
    if damaged:  # every checkpoint: rank 0's one-line error reaches rank 1 too
        for _, p in checkpoint.list_checkpoints(root):
            truncate(p / "model.safetensors")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_resolve_on_two_ranks, args=(r, str(root), port, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    results = dict((rank, (got, checked)) for rank, got, checked in (out.get(timeout=120) for _ in procs))
    for p in procs:
        p.join(60)
    assert results[0][0] == results[1][0]  # the same answer on both ranks
    assert results[1][1] == 0 and results[0][1] >= 1  # only rank 0 read the checkpoint's files
    if damaged:
        assert results[1][0].startswith("error: train.resume latest: no intact checkpoint")
    else:
        assert results[0][0] == str(root / LAST)
