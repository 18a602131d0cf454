"""FSDP, pipeline parallelism and activation checkpointing: each against the strategy it must equal.

Two ranks on gloo through the local engine (the same worker entry Spark and Ray run), a tiny random model.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from torchloom.config import build
from torchloom.data.buckets import use_length_buckets
from torchloom.data.loader import ShardedLoader
from torchloom.data.synthetic import write_synthetic_dataset
from torchloom.engines import local
from torchloom.errors import UserError
from torchloom.manifest import read as read_manifest
from torchloom.model.build import build_classifier
from torchloom.model.tiny import write_tiny_model
from torchloom.plan import command as plan
from torchloom.plan.advice import RUN_WITH
from torchloom.runs.runfiles import RunFiles
from torchloom.stages.export import export_stage
from torchloom.train import checkpoint, optim
from torchloom.train.distributed import Dist
from torchloom.train.evaluation import evaluate
from torchloom.train.loop import Trainer
from torchloom.train.state import seed_everything

pytestmark = pytest.mark.heavy(11)  # see tests/support/schedule.py

ONE_PROCESS = Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), owns_group=False)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return write_tiny_model(tmp_path_factory.mktemp("models") / "tiny0", dropout=0.0)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("data") / "data"
    write_synthetic_dataset(d, rows={"train": 103, "val": 21, "test": 19}, rows_per_group=10, rows_per_shard=40)
    return d


def new_run(root: Path, data_dir: Path, name: str) -> Path:
    rd = root / name
    rd.mkdir()
    shutil.copytree(data_dir, rd / "data")
    return rd


def cfg_for(rd: Path, model: str, *overrides: str):
    # grad_clip 0.2 is below most steps' gradient norm here: clipping is active.
    return build(None, [
        "--output.dir", str(rd), "--model.path", model, "--train.batch_size", "8", "--train.grad_accum", "2",
        "--train.lr", "1e-3", "--train.grad_clip", "0.2", "--train.epochs", "1", "--train.log_every", "1",
        "--engine.workers", "2", "--engine.max_restarts", "0", "--eval.batch_size", "5", *overrides,
    ])


def records(rd: Path, kind: str) -> list[dict]:
    lines = (rd / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def assert_weights_close(a: dict, b: dict, atol: float, rtol: float) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=rtol, msg=k)


# ---------------------------------------------------------------------------------------------
# fsdp (with activation checkpointing and gradient accumulation) against ddp, both in bf16 autocast
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory, data_dir, tiny) -> dict[str, Path]:
    # 103 rows, 2 ranks, micro-batch 2, grad_accum 2: 13 steps; checkpoints at 4, 8, 12 and 13;
    # validation every 4 steps with eval batches of 5 rows: 3 batches on rank 0, 2 on rank 1.
    root = tmp_path_factory.mktemp("fsdp")
    common = ("--train.precision", "bf16", "--train.checkpoint_every", "4", "--train.eval_every", "4",
              "--train.keep_last", "10", "--train.select", "last")
    runs = {"ddp": new_run(root, data_dir, "ddp"), "fsdp": new_run(root, data_dir, "fsdp")}
    local.train(cfg_for(runs["ddp"], tiny, *common), runs["ddp"], quiet=True)
    local.train(cfg_for(runs["fsdp"], tiny, *common, "--train.strategy", "fsdp",
                        "--train.activation_checkpointing", "true"), runs["fsdp"], quiet=True)
    return runs


def test_fsdp_loss_curve_and_weights_equal_ddp(fsdp_runs):
    ddp, fsdp = fsdp_runs["ddp"], fsdp_runs["fsdp"]
    a, b = records(ddp, "train"), records(fsdp, "train")
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, 14))
    for x, y in zip(a, b):
        assert y["loss"] == pytest.approx(x["loss"], abs=1e-5), x["step"]
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-4), x["step"]
    assert sum(x["grad_norm"] > 0.2 for x in a) >= 5  # clipping was active: it clips sharded gradients alike
    # Validation under FSDP runs the ranks in lockstep (every forward all-gathers) with uneven shares.
    ea, eb = records(ddp, "eval"), records(fsdp, "eval")
    assert [r["step"] for r in ea] == [r["step"] for r in eb] == [4, 8, 12, 13]
    for x, y in zip(ea, eb):
        assert y["loss"] == pytest.approx(x["loss"], abs=1e-5) and y["accuracy"] == x["accuracy"]
    # The sharded checkpoint, gathered, holds the weights DDP trained.
    step13 = checkpoint.load_weights(fsdp / "checkpoints" / "step-13")
    assert sorted(os.listdir(fsdp / "checkpoints" / "step-13" / "sharded")) == [".metadata", "__0_0.distcp",
                                                                                 "__1_0.distcp"]
    assert not (fsdp / "checkpoints" / "step-13" / "model.safetensors").exists()
    assert_weights_close(step13, checkpoint.load_weights(ddp / "checkpoints" / "step-13"), atol=1e-5, rtol=1e-4)


def test_fsdp_resumed_from_a_sharded_checkpoint_ends_bit_identical(fsdp_runs, tmp_path, data_dir, tiny):
    full = fsdp_runs["fsdp"]
    ckpt = full / "checkpoints" / "step-8"
    assert json.loads((ckpt / "meta.json").read_text())["sharded"] is True
    rd = new_run(tmp_path, data_dir, "resumed")
    result = local.train(cfg_for(rd, tiny, "--train.precision", "bf16", "--train.checkpoint_every", "4",
                                 "--train.eval_every", "4", "--train.keep_last", "10", "--train.strategy", "fsdp",
                                 "--train.activation_checkpointing", "true", "--train.resume", str(ckpt)),
                         rd, quiet=True)
    assert result.resumed_from == str(ckpt) and result.steps == 13
    a = checkpoint.load_weights(full / "checkpoints" / "step-13")
    b = checkpoint.load_weights(rd / "checkpoints" / "step-13")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert [r["loss"] for r in records(rd, "train")] == [r["loss"] for r in records(full, "train")][8:]


def test_fsdp_sharded_checkpoint_resumes_on_four_workers(fsdp_runs, tmp_path, data_dir, tiny):
    # The two-worker sharded checkpoint, loaded by four workers (torch.distributed.checkpoint reshards),
    # going on with the same global batches as micro-batches of 1 row: the same losses and weights.
    full = fsdp_runs["fsdp"]
    ckpt = full / "checkpoints" / "step-8"
    rd = new_run(tmp_path, data_dir, "four")
    result = local.train(cfg_for(rd, tiny, "--train.precision", "bf16", "--train.checkpoint_every", "4",
                                 "--train.eval_every", "4", "--train.keep_last", "10", "--train.strategy", "fsdp",
                                 "--train.activation_checkpointing", "true", "--train.resume", str(ckpt),
                                 "--engine.workers", "4"), rd, quiet=True)
    assert (result.steps, result.world_size, result.resumed_world_size, result.resumed_at_step) == (13, 4, 2, 8)
    for x, y in zip(records(full, "train")[8:], records(rd, "train"), strict=True):
        assert y["step"] == x["step"] and y["loss"] == pytest.approx(x["loss"], rel=1e-3), x["step"]
    assert_weights_close(checkpoint.load_weights(rd / "checkpoints" / "step-13"),
                         checkpoint.load_weights(full / "checkpoints" / "step-13"), atol=1e-4, rtol=1e-3)


def test_fsdp_export_is_the_same_plain_hugging_face_dir_as_ddp(fsdp_runs, tiny):
    from safetensors import safe_open
    from transformers import AutoModelForSequenceClassification

    dirs = {}
    for name, rd in fsdp_runs.items():
        cfg = cfg_for(rd, tiny, "--train.select", "last", "--train.strategy", name)
        dirs[name] = Path(export_stage(cfg)["model_dir"])
    assert sorted(os.listdir(dirs["fsdp"])) == sorted(os.listdir(dirs["ddp"]))
    keys = {}
    for name, d in dirs.items():
        with safe_open(str(d / "model.safetensors"), framework="pt") as f:
            keys[name] = sorted(f.keys())  # noqa: SIM118 (safe_open is not a dict)
    assert keys["fsdp"] == keys["ddp"]
    loaded = AutoModelForSequenceClassification.from_pretrained(str(dirs["fsdp"]), local_files_only=True)
    gathered = checkpoint.load_weights(fsdp_runs["fsdp"] / "checkpoints" / "step-13")
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, gathered[k]), k
    assert loaded.config.id2label == {0: "label_0", 1: "label_1", 2: "label_2"}


def test_resuming_a_checkpoint_of_another_strategy_is_a_one_line_error(fsdp_runs):
    ckpt = fsdp_runs["fsdp"] / "checkpoints" / "step-13"
    with pytest.raises(UserError) as err:
        checkpoint.load(ONE_PROCESS, ckpt, model=None, optimizer=None, sharded=False)
    assert "train.strategy fsdp" in str(err.value) and "\n" not in str(err.value)


# ---------------------------------------------------------------------------------------------
# pipeline against plain one-process training
# ---------------------------------------------------------------------------------------------


def test_pipeline_two_stages_equal_one_process_and_export(tmp_path, data_dir, tiny):
    # grad_accum 2, micro-batch 4 rows cut into 2 micro-batches; the last micro-step has 3 rows (padded).
    rd = new_run(tmp_path, data_dir, "pipeline")
    cfg = cfg_for(rd, tiny, "--train.precision", "fp32", "--train.strategy", "pipeline",
                  "--train.pipeline_stages", "2", "--train.microbatches", "2", "--train.select", "last")
    result = local.train(cfg, rd, quiet=True)
    assert result.steps == 13
    step13 = rd / "checkpoints" / "step-13"
    assert sorted(os.listdir(step13 / "sharded")) == [".metadata", "__0_0.distcp", "__1_0.distcp"]

    # The reference: one process, plain PyTorch, the pipeline's batches (it is one data-parallel replica).
    manifest = read_manifest(rd / "data")
    seed_everything(cfg.train.seed)
    model = build_classifier(tiny, manifest.labels, 0.0)
    model.train()
    opt, sched = optim.build(model, cfg.train.lr, cfg.train.weight_decay, 13, round(0.1 * 13), "linear",
                             torch.device("cpu"))
    loader = ShardedLoader(manifest, "train", rank=0, world_size=1, batch_size=4, global_batch=8, seed=cfg.train.seed,
                           length_bucketing=use_length_buckets(cfg.train.length_bucketing, manifest))
    loader.set_epoch(0)
    batches = list(loader)
    assert len(batches) == 26 and len(batches[-1]["labels"]) == 3
    losses, norms = [], []
    for step in range(13):
        group = batches[2 * step: 2 * step + 2]
        rows = sum(len(b["labels"]) for b in group)
        total = 0.0
        for b in group:
            logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
            summed = F.cross_entropy(logits, b["labels"], reduction="sum")
            (summed / rows).backward()
            total += float(summed.detach())
        losses.append(total / rows)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.2)))
        opt.step()
        opt.zero_grad()
        sched.step()
    train = records(rd, "train")
    assert [r["step"] for r in train] == list(range(1, 14))
    for r, loss, norm in zip(train, losses, norms):
        assert r["loss"] == pytest.approx(loss, abs=1e-5), r["step"]
        # The norm over both stages' gradients (Adam would hide a gradient scale error in the weights).
        assert r["grad_norm"] == pytest.approx(norm, rel=1e-4), r["step"]
    assert sum(n > 0.2 for n in norms) >= 5
    ref = {k: v.detach() for k, v in model.state_dict().items()}
    assert_weights_close(checkpoint.load_weights(step13), ref, atol=2e-5, rtol=1e-4)
    # Validation went through the stages (the last one's logits) and scored what one process scores.
    val = evaluate(ONE_PROCESS, model, manifest, "val", 5, "fp32")
    assert records(rd, "eval")[-1]["loss"] == pytest.approx(val["loss"], abs=1e-5)

    from transformers import AutoModelForSequenceClassification

    out = export_stage(cfg)["model_dir"]
    loaded = AutoModelForSequenceClassification.from_pretrained(out, local_files_only=True)
    assert_weights_close(loaded.state_dict(), ref, atol=2e-5, rtol=1e-4)


# ---------------------------------------------------------------------------------------------
# activation checkpointing: lower peak memory, the same step
# ---------------------------------------------------------------------------------------------


def peak_bytes(fn) -> int:
    """Peak of the bytes allocated while fn runs, above what was allocated before (torch's profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def test_activation_checkpointing_lowers_peak_memory_at_equal_results(tmp_path):
    # Long rows, 4 layers: activations, not the weights, set the peak of a step.
    model = write_tiny_model(tmp_path / "tiny4", layers=4, dropout=0.1)
    data = tmp_path / "data"
    write_synthetic_dataset(data, rows={"train": 64, "val": 4, "test": 4}, min_len=100, max_len=128)
    results = {}
    for ac in ("false", "true"):
        rd = new_run(tmp_path, data, f"ac-{ac}")
        cfg = build(None, ["--output.dir", str(rd), "--model.path", model, "--train.batch_size", "16",
                           "--train.precision", "fp32", "--engine.workers", "1",
                           "--train.activation_checkpointing", ac])
        trainer = Trainer(cfg, ONE_PROCESS, RunFiles(rd))
        trainer.loader.set_epoch(0)
        batches = iter(trainer.loader)
        trainer.train_step([next(batches)], 0)  # the optimizer's state exists from here on
        batch = next(batches)
        losses = []
        peak = peak_bytes(lambda t=trainer, b=batch, out=losses: out.append(t.train_step([b], 1)[0]))
        results[ac] = {"loss": losses[0], "peak": peak, "weights": trainer.model.state_dict()}
    off, on = results["false"], results["true"]
    # Dropout is on: recomputation replays the same random masks, so the step is the same to the bit.
    assert torch.equal(on["loss"], off["loss"])
    for k in off["weights"]:
        assert torch.equal(on["weights"][k], off["weights"][k]), k
    assert on["peak"] < 0.6 * off["peak"], (on["peak"], off["peak"])


# ---------------------------------------------------------------------------------------------
# configuration
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, message", [
    (["--train.strategy", "pipeline", "--train.pipeline_stages", "3", "--engine.workers", "2"],
     "train.pipeline_stages 3: must equal"),
    (["--train.strategy", "pipeline", "--train.pipeline_stages", "1"], "needs 2 or more stages"),
    (["--train.strategy", "pipeline", "--engine.workers", "1"], "needs 2 or more stages"),
    (["--train.strategy", "fsdp", "--train.precision", "fp16"], "fp16 (with a gradient scaler) runs with"),
    (["--train.strategy", "zero2"], "choose one of ddp, fsdp, pipeline"),
])
def test_strategy_config_errors_are_one_line(overrides, message):
    with pytest.raises(UserError) as err:
        build(None, overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_pipeline_batch_must_split_into_microbatches():
    from torchloom.config import micro_batch_size

    with pytest.raises(UserError, match="multiple of train.grad_accum x train.microbatches = 8"):
        build(None, ["--train.strategy", "pipeline", "--train.batch_size", "12", "--train.microbatches", "8"])
    cfg = build(None, ["--train.strategy", "pipeline", "--train.batch_size", "12", "--train.microbatches", "3"])
    assert micro_batch_size(cfg.train, 2) == 12  # one replica: the whole batch goes down the pipeline


def test_batch_that_does_not_split_over_the_workers_is_a_config_error():
    from torchloom.config import micro_batch_size

    with pytest.raises(UserError, match="must be a multiple of engine.workers x train.grad_accum = 3"):
        build(None, ["--engine.workers", "3", "--train.batch_size", "16"])
    build(None, ["--engine.workers", "3"])  # batch_size auto: chosen from the data, a multiple of the workers
    cfg = build(None, ["--engine.workers", "4", "--train.grad_accum", "2", "--train.batch_size", "16"])
    assert micro_batch_size(cfg.train, 4) == 2
    with pytest.raises(UserError, match="= 6"):  # the world size torchrun really started is checked too
        micro_batch_size(cfg.train, 3)


def test_plan_advice_flags_are_real_config(capsys):
    for name, flags in RUN_WITH.items():
        cfg = build(None, flags.split())
        assert cfg.train.strategy == flags.split()[1], name
    # What `torchloom plan` prints when it recommends a pipeline runs as it is.
    assert plan.main(["--model", "distilbert-base", "--device-type", "a100-40g", "--devices", "8",
                      "--devices-per-node", "1", "--inter-bw", "3", "--micro-batch", "32", "--mean-tokens", "96",
                      "--json"]) == 0
    advice = json.loads(capsys.readouterr().out)["recommendation"]
    assert advice["strategy"] == "pipeline"
    [line] = [r for r in advice["reasons"] if r.startswith("in torchloom: torchloom train ")]
    cfg = build(None, line.removeprefix("in torchloom: torchloom train ").split())
    assert (cfg.train.strategy, cfg.train.pipeline_stages, cfg.engine.workers) == ("pipeline", 2, 2)


# ---------------------------------------------------------------------------------------------
# GPU (nccl): skipped without CUDA devices
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("strategy", ["fsdp", "pipeline"])
def test_gpu_strategies_train(tmp_path, data_dir, tiny, strategy):
    rd = new_run(tmp_path, data_dir, strategy)
    cfg = cfg_for(rd, tiny, "--train.strategy", strategy, "--engine.device", "cuda", "--train.max_steps", "4",
                  "--train.activation_checkpointing", "true")
    result = local.train(cfg, rd, quiet=True)
    assert result.device.startswith("cuda") and result.steps == 4
    assert checkpoint.load_weights(rd / "checkpoints" / "step-4")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_fsdp_code_path_on_one_gpu(tmp_path, data_dir, tiny, precision):
    # what one GPU can show of the FSDP path: its code on CUDA (nccl initialised, activation checkpointing, sharded
    # checkpoint files) with one rank, which shards nothing; sharding over ranks is test_gpu_strategies_train[fsdp]
    rd = new_run(tmp_path, data_dir, "fsdp")
    cfg = cfg_for(rd, tiny, "--train.strategy", "fsdp", "--engine.device", "cuda", "--engine.workers", "1",
                  "--train.batch_size", "16", "--train.grad_accum", "1", "--train.max_steps", "6",
                  "--train.precision", precision, "--train.activation_checkpointing", "true",
                  "--train.checkpoint_every", "3")
    result = local.train(cfg, rd, quiet=True)
    assert result.device.startswith("cuda") and result.steps == 6 and result.precision == precision
    assert checkpoint.load_weights(rd / "checkpoints" / "step-6")
