"""Training on real multi-process DDP (gloo, the local elastic engine) with a tiny random model."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from support.command import torchloom
from support.engine_reference import traced_rows, train_losses

from torchloom.config import build
from torchloom.data.buckets import use_length_buckets
from torchloom.data.loader import ShardedLoader
from torchloom.data.synthetic import write_synthetic_dataset
from torchloom.engines import local
from torchloom.errors import UserError
from torchloom.manifest import read as read_manifest
from torchloom.model.build import build_classifier
from torchloom.model.tiny import write_tiny_model
from torchloom.runs.rundir import RunDir
from torchloom.stages.train import how_long
from torchloom.train import checkpoint, optim
from torchloom.train.state import seed_everything

pytestmark = pytest.mark.heavy(6)  # see tests/support/schedule.py


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {
        "dropout": write_tiny_model(root / "tiny"),
        "no_dropout": write_tiny_model(root / "tiny0", dropout=0.0),
    }


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("data") / "data"
    write_synthetic_dataset(d, rows={"train": 103, "val": 21, "test": 19}, rows_per_group=10, rows_per_shard=40)
    return d


def new_run(tmp_path: Path, data_dir: Path, name: str) -> Path:
    rd = tmp_path / name
    rd.mkdir()
    shutil.copytree(data_dir, rd / "data")
    return rd


def cfg_for(rd: Path, model: str, *overrides: str):
    return build(None, [
        "--output.dir", str(rd), "--model.path", model, "--train.precision", "fp32",
        "--train.batch_size", "8", "--train.lr", "1e-3", "--engine.workers", "2", "--train.log_every", "2",
        "--train.budget", "off",  # the fixed 2 epochs the step counts below are written for
        *overrides,
    ])


def weights(ckpt: Path) -> dict[str, torch.Tensor]:
    return checkpoint.load_weights(ckpt)


def test_ddp_two_ranks_equal_one_process_on_the_combined_batch(tmp_path, data_dir, models):
    rd = new_run(tmp_path, data_dir, "ddp")
    steps = 6
    cfg = cfg_for(rd, models["no_dropout"], "--train.max_steps", str(steps), "--train.warmup_ratio", "0.3")
    result = local.train(cfg, rd, quiet=True)
    assert result.steps == steps and result.world_size == 2
    ddp = weights(rd / "checkpoints" / f"step-{steps}")

    # The reference: one process, plain PyTorch, each step on the union of both ranks' micro-batches.
    manifest = read_manifest(rd / "data")
    seed_everything(cfg.train.seed)
    model = build_classifier(models["no_dropout"], manifest.labels)
    opt, sched = optim.build(model, cfg.train.lr, cfg.train.weight_decay, steps, round(0.3 * steps), "linear",
                             torch.device("cpu"))
    loaders = [ShardedLoader(manifest, "train", rank=r, world_size=2, batch_size=4, seed=cfg.train.seed,
                             length_bucketing=use_length_buckets(cfg.train.length_bucketing, manifest))
               for r in range(2)]
    for ld in loaders:
        ld.set_epoch(0)
    for b0, b1 in list(zip(*loaders))[:steps]:
        length = max(b0["input_ids"].shape[1], b1["input_ids"].shape[1])
        ids = torch.cat([F.pad(b["input_ids"], (0, length - b["input_ids"].shape[1])) for b in (b0, b1)])
        mask = torch.cat([F.pad(b["attention_mask"], (0, length - b["attention_mask"].shape[1])) for b in (b0, b1)])
        labels = torch.cat([b0["labels"], b1["labels"]])
        loss = F.cross_entropy(model(input_ids=ids, attention_mask=mask).logits, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        opt.step()
        opt.zero_grad()
        sched.step()
    ref = {k: v.detach() for k, v in model.state_dict().items()}
    assert ddp.keys() == ref.keys()
    moved = 0
    for k in ref:
        torch.testing.assert_close(ddp[k], ref[k], atol=2e-5, rtol=1e-4, msg=k)
        moved += not torch.equal(ref[k], build_classifier(models["no_dropout"], manifest.labels).state_dict()[k])
    assert moved > 10  # the parameters really trained


def test_resume_mid_epoch_is_bit_identical(tmp_path, data_dir, models):
    # 103 rows, 2 ranks, micro-batch 4: 13 steps per epoch; step 10 is mid-epoch, 2 epochs = 26 steps.
    full = new_run(tmp_path, data_dir, "full")
    result = local.train(cfg_for(full, models["dropout"], "--train.checkpoint_every", "5", "--train.keep_last", "10",
                                 "--train.eval_every", "4"), full, quiet=True)
    assert result.steps == 26
    resumed = new_run(tmp_path, data_dir, "resumed")
    ckpt = full / "checkpoints" / "step-10"
    assert json.loads((ckpt / "meta.json").read_text())["epoch"] == 0
    result2 = local.train(cfg_for(resumed, models["dropout"], "--train.checkpoint_every", "5",
                                  "--train.keep_last", "10", "--train.eval_every", "4", "--train.resume", str(ckpt)),
                          resumed, quiet=True)
    assert result2.resumed_from == str(ckpt) and result2.steps == 26
    a, b = weights(full / "checkpoints" / "step-26"), weights(resumed / "checkpoints" / "step-26")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # The metrics log of the resumed run continues where the checkpoint left off.
    steps = [json.loads(line)["step"] for line in (resumed / "metrics.jsonl").read_text().splitlines()]
    assert min(steps) > 10


def test_resume_on_one_and_four_workers_continues_the_same_global_batches(tmp_path, data_dir, models):
    # 103 rows, global batch 8: 13 steps per epoch, 26 in all. Two workers stop at step 5 (mid-epoch);
    # one and four workers go on from its checkpoint through the end of the next epoch.
    trace = ["--train.trace_rows", "true", "--train.log_every", "1", "--train.checkpoint_every", "5",
             "--train.keep_last", "10"]
    two = new_run(tmp_path, data_dir, "two")
    assert local.train(cfg_for(two, models["no_dropout"], *trace), two, quiet=True).steps == 26
    reference_rows, reference_losses = traced_rows(two), train_losses(two)
    assert sorted(reference_rows) == list(range(1, 27))
    assert sorted(i for s in range(1, 14) for i in reference_rows[s]) == list(range(103))
    ckpt = two / "checkpoints" / "step-5"
    for workers in (1, 4):
        rd = new_run(tmp_path, data_dir, f"w{workers}")
        result = local.train(cfg_for(rd, models["no_dropout"], *trace, "--engine.workers", str(workers),
                                     "--train.resume", str(ckpt)), rd, quiet=True)
        assert (result.world_size, result.resumed_world_size, result.resumed_at_step, result.steps) == (
            workers, 2, 5, 26)
        rows = traced_rows(rd)
        assert sorted(rows) == list(range(6, 27))
        for step, ids in rows.items():
            assert ids == reference_rows[step], (workers, step)
        losses = train_losses(rd)
        assert sorted(losses) == list(range(6, 27))
        for step, loss in losses.items():
            assert loss == pytest.approx(reference_losses[step], rel=1e-5), (workers, step)


def test_checkpoints_are_complete_and_pruned(tmp_path, data_dir, models):
    rd = new_run(tmp_path, data_dir, "prune")
    result = local.train(cfg_for(rd, models["dropout"], "--train.epochs", "3", "--train.keep_last", "1"), rd,
                         quiet=True)
    found = [s for s, _ in checkpoint.list_checkpoints(rd / "checkpoints")]
    # the last one, plus the best on validation when it is another
    assert found[-1] == result.steps == 39
    assert set(found) <= {result.best_step, 39} and len(found) <= 2
    assert not list((rd / "checkpoints").glob(".*tmp"))
    for step in found:
        files = {p.name for p in (rd / "checkpoints" / f"step-{step}").iterdir()}
        assert {"model.safetensors", "optimizer.pt", "trainer.pt", "meta.json", "rng-rank0.pt", "rng-rank1.pt"} <= files
    lines = [json.loads(x) for x in (rd / "metrics.jsonl").read_text().splitlines()]
    evals = [x for x in lines if x["kind"] == "eval"]
    assert [e["step"] for e in evals] == [13, 26, 39]
    train = [x for x in lines if x["kind"] == "train"]
    assert all(x["loss"] > 0 and x["samples_per_s"] > 0 and "grad_norm" in x for x in train)
    # what every run reports beside samples/s (train/clock.py): real tokens, padding, where the time went
    import pyarrow.parquet as pq

    real = sum(len(ids) for f in (rd / "data" / "train").rglob("*.parquet")
               for ids in pq.read_table(f, columns=["input_ids"]).column("input_ids").to_pylist())
    assert result.tokens_per_s * result.train_s == pytest.approx(3 * real, rel=0.01)  # 3 epochs of real tokens
    assert 0 < result.padding < 1 and result.mfu is None  # no MFU on a CPU: its peak is no datasheet's
    assert {"data", "forward_backward", "optimizer", "checkpoint", "eval"} <= set(result.time_split)
    assert 0.5 < sum(result.time_split.values()) <= 1.01
    assert all(x["tokens_per_s"] > 0 and 0 <= x["padding"] < 1 and "forward_backward" in x["time_split"]
               for x in train)


def test_batch_size_not_divisible_is_a_one_line_error(tmp_path, data_dir, models):
    rd = new_run(tmp_path, data_dir, "bad")
    proc = torchloom("train", "--output.dir", str(rd), "--model.path", models["dropout"], "--train.batch_size", "7",
                     timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "train.batch_size 7" in lines[0] and "multiple" in lines[0]
    assert "Traceback" not in proc.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_fp16_with_grad_scaler_trains(tmp_path, data_dir, models):
    rd = new_run(tmp_path, data_dir, "gpu")
    n = min(2, torch.cuda.device_count())
    cfg = cfg_for(rd, models["dropout"], "--train.precision", "fp16", "--engine.device", "cuda",
                  "--engine.workers", str(n), "--train.max_steps", "4")
    result = local.train(cfg, rd, quiet=True)
    assert result.device.startswith("cuda") and result.steps == 4


def test_a_failing_rank_becomes_the_error_with_its_traceback_and_is_not_restarted(tmp_path, data_dir, models):
    # max_restarts 2, but an error of a rank's own would happen again: the job fails at once
    # and the webhook (tracking.notify_url, from the environment here) gets one message, its secret never printed
    from support.net import Webhook

    rd = new_run(tmp_path, data_dir, "fail")
    with Webhook() as hook:
        proc = torchloom("train", "--output.dir", str(rd), "--model.path", models["dropout"], "--train.batch_size",
                         "8", "--train.precision", "fp32", "--engine.max_restarts", "2", timeout=300,
                         env={"TORCHLOOM_FAULT": "rank=1,step=3,kind=raise", "TORCHLOOM_NOTIFY_URL": hook.url})
    assert proc.returncode == 1
    assert len(hook.posts) == 1 and hook.posts[0]["content_type"] == "application/json", hook.posts
    message = hook.posts[0]["body"]
    assert message["torchloom"]["event"] == "train_failed" and message["torchloom"]["run"] == str(rd)
    assert message["text"].startswith(f"torchloom {rd}: training failed: ") and "InjectedFault" in message["text"]
    assert f"alert: sent to {hook.url.split('/hooks')[0]} (train_failed, HTTP 200)" in proc.stderr
    assert "secret-token" not in proc.stderr + proc.stdout
    assert "training failed on rank 1: InjectedFault: injected fault on rank 1 at step 3" in proc.stderr
    assert "traceback of rank 1" in proc.stderr and "faults.py" in proc.stderr
    assert json.loads((rd / "logs" / "error-rank1.json").read_text())["type"] == "InjectedFault"
    assert "re-running the workers" not in proc.stderr and not list((rd / "logs").glob("placement-*-start1.json"))


def test_killed_worker_restarts_and_resumes_to_the_same_weights(tmp_path, data_dir, models, monkeypatch):
    # Uninterrupted reference, then the same job with rank 1 SIGKILLed mid-epoch at step 8, after the
    # checkpoint at step 5: torch elastic restarts both workers, they resume from step 5.
    ref = new_run(tmp_path, data_dir, "ref")
    common = ("--train.checkpoint_every", "5", "--train.keep_last", "10", "--train.epochs", "1")
    local.train(cfg_for(ref, models["dropout"], *common), ref, quiet=True)
    rd = new_run(tmp_path, data_dir, "killed")
    monkeypatch.setenv("TORCHLOOM_FAULT", "rank=1,step=8,kind=kill")
    result = local.train(cfg_for(rd, models["dropout"], *common, "--engine.max_restarts", "1"), rd, quiet=True)
    monkeypatch.delenv("TORCHLOOM_FAULT")
    assert (rd / "logs" / "fault-fired-rank1-step8").exists()
    assert result.resumed_from.endswith("step-5") and result.steps == 13
    # this launch's speed: the 8 steps it ran, not the 5 before its start (8 rows each)
    assert result.samples_per_s == pytest.approx((result.samples_seen - 5 * 8) / result.train_s, rel=0.02)
    a, b = weights(ref / "checkpoints" / "step-13"), weights(rd / "checkpoints" / "step-13")
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_a_lost_worker_past_max_restarts_fails_the_job(tmp_path, data_dir, models):
    from torchloom.engines.common import TrainingFailed

    rd = new_run(tmp_path, data_dir, "no-restarts")
    os.environ["TORCHLOOM_FAULT"] = "rank=1,step=3,kind=kill"
    try:
        with pytest.raises(TrainingFailed, match="training failed on rank 1"):
            local.train(cfg_for(rd, models["dropout"], "--engine.max_restarts", "0"), rd, quiet=True)
    finally:
        del os.environ["TORCHLOOM_FAULT"]
    assert (rd / "logs" / "fault-fired-rank1-step3").exists()
    assert not list((rd / "logs").glob("placement-*-start1.json"))  # max_restarts 0: no second start


def test_attention_dropout_override(models):
    assert build_classifier(models["dropout"], ["a", "b"], 0.0).config.attention_probs_dropout_prob == 0.0
    kept = build_classifier(models["dropout"], ["a", "b"], -1.0)
    assert kept.config.attention_probs_dropout_prob == 0.1 and kept.config.hidden_dropout_prob == 0.1


def _seen_by_a_worker() -> tuple[str | None, bool]:
    return os.environ.get("TORCHLOOM_TEST_MARK"), "transformers.modeling_utils" in sys.modules


def test_local_workers_fork_from_a_server_holding_their_imports_and_this_process_environment(monkeypatch):
    # Workers start as forks of a server that has imported what they need; it has the environment of the
    # moment (as spawn would give it), starts again once that changed, and is left alone while a launch runs
    # from it (that launch's ends are reported through it).
    import concurrent.futures
    import multiprocessing
    from multiprocessing import forkserver

    cfg = build(None, ["--engine.device", "cpu"])

    def in_a_worker():
        with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("forkserver")) as pool:
            return pool.submit(_seen_by_a_worker).result(timeout=120)

    monkeypatch.delenv("TORCHLOOM_TEST_MARK", raising=False)
    local.stop_fork_server()  # one an earlier local.train of this process left
    with local.worker_start(build(None, ["--engine.device", "cpu", "--engine.start_method", "spawn"])) as method:
        assert method == "spawn" and forkserver._forkserver._forkserver_pid is None  # the user's way out
    try:
        with local.worker_start(cfg) as method:
            assert method == "forkserver"
            first = forkserver._forkserver._forkserver_pid
            assert in_a_worker() == (None, True)  # the imports are there before the worker's code runs
            monkeypatch.setenv("TORCHLOOM_TEST_MARK", "1")
            with local.worker_start(cfg) as during:
                assert during == "spawn"
            local.stop_fork_server()
            assert forkserver._forkserver._forkserver_pid == first
        with local.worker_start(cfg) as method:
            assert method == "forkserver" and forkserver._forkserver._forkserver_pid != first
            assert in_a_worker() == ("1", True)
    finally:
        local.stop_fork_server()
    assert forkserver._forkserver._forkserver_pid is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_workers_start_as_fresh_interpreters():
    # a forked child cannot initialise CUDA once its parent has: spawn, and no fork server is started
    from multiprocessing import forkserver

    local.stop_fork_server()
    with local.worker_start(build(None, ["--engine.device", "cuda"])) as method:
        assert method == "spawn"
    assert forkserver._forkserver._forkserver_pid is None


def test_train_budget_auto_trains_longer_where_more_epochs_help_and_off_keeps_the_fixed_two(tmp_path, models):
    """Three classes from 96 rows (12 steps an epoch at batch 8): ~45 steps a class asks for 11 epochs, budget
    auto gives at most 5 (stopping once validation has not improved for 2); budget off is the old fixed 2."""
    data = tmp_path / "three"
    write_synthetic_dataset(data, rows={"train": 96, "val": 48, "test": 12}, num_labels=3, rows_per_group=12,
                            rows_per_shard=48)
    results = {}
    for budget in ("off", "auto"):
        rd = new_run(tmp_path, data, budget)
        cfg = cfg_for(rd, models["no_dropout"], "--train.budget", budget, "--train.metric", "accuracy",
                      "--train.lr", "3e-3")
        cfg.train.epochs = cfg.train.early_stopping_patience = "auto"  # the defaults, as a user gets them
        results[budget] = local.train(how_long(cfg, RunDir(rd)), rd, quiet=True)
    off, auto = results["off"], results["auto"]
    assert off.steps == 24 and not off.stopped_early
    assert auto.steps > off.steps and auto.best_metric > off.best_metric, (auto.to_dict(), off.best_metric)


def test_compile_pads_to_a_few_widths_counts_its_graphs_and_trains_the_same_model(tmp_path, data_dir, models,
                                                                                   monkeypatch):
    # train.compile with DDP on 2 ranks: each transformer layer compiled in place (the backend dynamo and AOTAutograd
    # without code generation, seconds instead of a minute); batches padded to 16-token widths, which masked
    # attention ignores: the weights equal the eager run's, under their own names, and the summary counts graphs.
    from torchloom.console import speed_line
    from torchloom.train.parallelize import COMPILE_BACKEND_ENV

    monkeypatch.setenv(COMPILE_BACKEND_ENV, "aot_eager")
    results = {}
    for name, flag in (("eager", "false"), ("compiled", "true")):
        rd = new_run(tmp_path, data_dir, name)
        results[name] = local.train(cfg_for(rd, models["no_dropout"], "--train.max_steps", "4", "--train.compile",
                                            flag), rd, quiet=True)
    eager, compiled = (checkpoint.load_weights(tmp_path / n / "checkpoints" / "step-4") for n in ("eager", "compiled"))
    assert eager.keys() == compiled.keys()
    for k in eager:
        torch.testing.assert_close(compiled[k], eager[k], atol=1e-5, rtol=1e-4, msg=k)
    assert results["eager"].compiled_graphs is None and results["compiled"].compiled_graphs >= 1
    assert results["compiled"].padding > results["eager"].padding, (results["compiled"].padding,
                                                                     results["eager"].padding)  # the 16-token widths
    assert f"compiled ({results['compiled'].compiled_graphs} graph" in speed_line(results["compiled"])
    with pytest.raises(UserError, match="train.compile: runs with train.strategy ddp only"):
        build(None, ["--train.compile", "true", "--train.strategy", "fsdp"])


def test_length_bucketing_auto_resumes_as_the_run_began(tmp_path, data_dir, models):
    # A checkpoint written with buckets on, resumed with auto on data whose manifest says nothing of lengths (auto
    # alone would say off): the run goes on with its own order instead of refusing the loader's state.
    rd = new_run(tmp_path, data_dir, "buckets")
    local.train(cfg_for(rd, models["no_dropout"], "--train.max_steps", "3", "--train.checkpoint_every", "3",
                        "--train.length_bucketing", "true"), rd, quiet=True)
    result = local.train(cfg_for(rd, models["no_dropout"], "--train.max_steps", "5", "--train.resume", "latest",
                                 "--train.length_bucketing", "auto"), rd, quiet=True)
    assert result.resumed_from.endswith("step-3") and result.steps == 5


def test_a_resumed_training_that_ends_worse_on_validation_alerts_and_a_dead_webhook_is_one_line(tmp_path, capsys):
    """The run's history before the resume against its last validation after it: worse is said and sent; better or
    equal is neither. A webhook that cannot be reached costs one line, never the command."""
    from support.net import Webhook

    from torchloom.runs.rundir import RunDir
    from torchloom.stages.train import last_validation, worse_after_resume
    from torchloom.train.result import TrainResult

    rd = RunDir(tmp_path / "run")
    rd.root.mkdir()
    rd.metrics.write_text("\n".join(json.dumps(r) for r in (
        {"kind": "eval", "step": 10, "macro_f1": 0.70}, {"kind": "train", "step": 15, "loss": 0.3},
        {"kind": "eval", "step": 20, "macro_f1": 0.82}, "not json")) + "\n")
    before = last_validation(rd, "macro_f1")
    assert before == (20, 0.82)
    result = TrainResult.__new__(TrainResult)
    with Webhook() as hook:
        cfg = build(overrides=["--tracking.notify_url", hook.url])
        for value, sent in ((0.85, 0), (0.82, 0), (0.74, 1)):
            result.last_eval, result.steps = {"macro_f1": value}, 40
            worse_after_resume(cfg, rd, before, result, 20)
            assert len(hook.posts) == sent
    assert hook.posts[0]["body"]["torchloom"] | {"run": None} == {
        "event": "train_worse_after_resume", "run": None, "engine": "local", "workers": cfg.engine.workers,
        "metric": "macro_f1", "value": 0.74, "before": 0.82, "before_step": 20, "step": 40}
    err = capsys.readouterr().err
    assert err.count("train: warning: validation macro_f1 0.7400 at step 40, worse than 0.8200 at step 20") == 1
    worse_after_resume(build(overrides=["--tracking.notify_url", hook.url]), rd, before, result, 20)  # now closed
    err = capsys.readouterr().err
    assert "alert: the webhook at http://127.0.0.1:" in err and "cannot be reached" in err
    assert "secret-token" not in err
    with pytest.raises(UserError, match="config tracking.notify_url: not an http"):
        build(overrides=["--tracking.notify_url", "hooks.slack.com/x"])
