"""The training loop, top to bottom: what one optimizer step does on every rank.

Batch arithmetic: `train.batch_size` is global (samples per optimizer step over all ranks), so a
rank's micro-batch is batch_size / (dp * grad_accum), dp being the number of data-parallel replicas:
world_size under ddp and fsdp, 1 under pipeline (whose stages all read the same batches). Each
micro-batch's summed loss is divided by the number of rows the whole step sees (known on every rank
without communication, see ShardedLoader.global_batch_rows) and multiplied by dp, because DDP and
FSDP average gradients over ranks: the result is the gradient of the mean loss over the global batch,
exactly what one process on the combined batch computes.

How the model is spread over the ranks is parallelize()'s business (train/parallelize.py); here it
shows only as `self.par`: the gradient sync of a micro-step, the clipping, and the pipeline's step.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from torchloom.config import Config
from torchloom.data.loader import ShardedLoader
from torchloom.embedded import model_path
from torchloom.errors import UserError
from torchloom.manifest import Manifest
from torchloom.manifest import read as read_manifest
from torchloom.model.build import build_classifier
from torchloom.train import checkpoint, faults, optim
from torchloom.train.distributed import Dist, all_reduce_sum
from torchloom.train.evaluation import autocast, evaluate
from torchloom.train.parallelize import parallelize
from torchloom.train.reporter import NullReporter, Reporter


@dataclass
class TrainState:
    """The trainer's own counters; saved in every checkpoint."""

    step: int = 0  # optimizer steps done
    epoch: int = 0  # epoch in progress
    samples_seen: int = 0
    best_metric: float | None = None
    best_step: int = -1
    evals_without_improvement: int = 0
    stopped_early: bool = False
    stop_reason: str = ""  # why training ended before total_steps: early_stopping, or who asked (e.g. pruned)
    last_eval_step: int = -1
    last_checkpoint_step: int = -1


def micro_batch_size(cfg: Config, world_size: int) -> int:
    """Rows per micro-step on one data-parallel rank."""
    tc = cfg.train
    if tc.strategy == "pipeline":
        per_step = tc.grad_accum * tc.microbatches  # one replica; each micro-step cut into micro-batches
        if tc.batch_size % per_step:
            raise UserError(
                f"config train.batch_size {tc.batch_size}: with train.strategy pipeline it must be a multiple of"
                f" train.grad_accum x train.microbatches = {per_step}; choose e.g."
                f" {per_step * max(1, tc.batch_size // per_step)}"
            )
        return tc.batch_size // tc.grad_accum
    per_step = world_size * tc.grad_accum
    if tc.batch_size % per_step:
        raise UserError(
            f"config train.batch_size {tc.batch_size}: must be a multiple of engine.workers x"
            f" train.grad_accum = {per_step}; choose e.g. {per_step * max(1, tc.batch_size // per_step)}"
        )
    return tc.batch_size // per_step


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def class_weights(manifest: Manifest, mode: str, device: torch.device) -> torch.Tensor | None:
    if mode == "none":
        return None
    counts = manifest.split("train").per_class
    n = np.array([max(1, counts.get(label, 0)) for label in manifest.labels], dtype=np.float64)
    # "balanced" as in scikit-learn: n_samples / (n_classes * n_c).
    return torch.tensor(n.sum() / (len(n) * n), dtype=torch.float32, device=device)


def better(metric: str, new: float, best: float | None) -> bool:
    if best is None:
        return True
    return new < best if metric == "loss" else new > best


def reset_metrics_log(path: Path, resume_step: int | None) -> None:
    """A fresh run (resume_step None) starts a fresh metrics.jsonl; a resumed one keeps the lines up to
    its checkpoint, since the interrupted run's later lines are about to be logged again."""
    if not path.exists():
        return
    if resume_step is None:
        path.unlink()
        return
    kept = [line for line in path.read_text().splitlines()
            if line.strip() and json.loads(line).get("step", 0) <= resume_step]
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)


class Trainer:
    """Built once per rank from the config; `fit()` runs the loop and returns rank-local results."""

    def __init__(self, cfg: Config, d: Dist, run_dir: str | Path, reporter: Reporter | None = None):
        self.cfg, self.d, self.run_dir = cfg, d, Path(run_dir)
        self.reporter = reporter or NullReporter()
        self.tc = cfg.train
        self.manifest = read_manifest(self.run_dir / "data")
        seed_everything(self.tc.seed)
        self.model = build_classifier(model_path(cfg.model.path), self.manifest.labels, cfg.model.attention_dropout)
        self.model.train()  # from_pretrained returns a model in eval mode: dropout off
        self.loss_weights = class_weights(self.manifest, self.tc.class_weights, d.device)
        # Before the optimizer is built: FSDP replaces the parameters, a pipeline stage drops the others'.
        self.par = parallelize(self.model, d, self.tc, self.manifest.tokenizer.get("max_length"), self.loss_weights)
        self.micro_batch = micro_batch_size(cfg, d.world_size)
        self.loader = ShardedLoader(
            self.manifest, "train", rank=self.par.dp_rank, world_size=self.par.dp_size,
            batch_size=self.micro_batch, seed=self.tc.seed,
            shuffle_buffer=self.tc.shuffle_buffer, length_bucketing=self.tc.length_bucketing,
            pad_id=self.model.config.pad_token_id or 0,
        )
        self.steps_per_epoch = math.ceil(len(self.loader) / self.tc.grad_accum)
        self.total_steps = self.tc.max_steps or self.steps_per_epoch * self.tc.epochs
        warmup = round(self.tc.warmup_ratio * self.total_steps)
        self.optimizer, self.scheduler = optim.build(
            self.model, self.tc.lr, self.tc.weight_decay, self.total_steps, warmup, self.tc.schedule, d.device
        )
        use_scaler = self.tc.precision == "fp16" and d.device.type == "cuda"
        self.scaler = torch.amp.GradScaler("cuda") if use_scaler else None
        self.state = TrainState()
        self.ckpt_root = self.run_dir / "checkpoints"
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.last_eval: dict | None = None
        self.resumed_from = self._maybe_resume()

    # -- resume and checkpoints ---------------------------------------------------------------
    def _maybe_resume(self) -> str | None:
        path = checkpoint.resolve(self.tc.resume, self.ckpt_root)
        if path is None:
            if self.d.is_main:
                reset_metrics_log(self.metrics_path, None)
            return None
        ts = checkpoint.load(self.d, path, model=self.model, optimizer=self.optimizer, sharded=self.par.sharded)
        self.scheduler.load_state_dict(ts["scheduler"])
        if self.scaler is not None and ts.get("scaler"):
            self.scaler.load_state_dict(ts["scaler"])
        self.loader.load_state_dict(ts["loader"])
        self.state = TrainState(**ts["state"])
        if self.d.is_main:
            reset_metrics_log(self.metrics_path, self.state.step)
        return str(path)

    def save_checkpoint(self) -> Path:
        s = self.state
        s.last_checkpoint_step = s.step
        trainer_state = {
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler is not None else {},
            "loader": self.loader.state_dict(),
            "state": asdict(s),
        }
        meta = {"epoch": s.epoch, "samples_seen": s.samples_seen, "best_step": s.best_step,
                "strategy": self.par.strategy, "eval": self.last_eval_summary()}
        keep = {s.best_step} if s.best_step >= 0 else set()
        return checkpoint.save(
            self.d, self.ckpt_root, s.step, model=self.model, optimizer=self.optimizer,
            trainer_state=trainer_state, meta=meta, keep_last=self.tc.keep_last, keep=keep, sharded=self.par.sharded,
        )

    # -- logging -------------------------------------------------------------------------------
    def log(self, record: dict) -> None:
        if self.d.is_main:
            with open(self.metrics_path, "a") as f:
                f.write(json.dumps(record) + "\n")
            self.reporter.log(record)  # rank 0 only; MLflow reads the file instead (tracking.MetricsForwarder)

    def progress(self, **fields) -> None:
        # The driver tails this file to draw the live bar, whatever engine runs the workers.
        if self.d.is_main:
            tmp = self.run_dir / ".progress.json.tmp"
            tmp.write_text(json.dumps({"total_steps": self.total_steps, **fields}))
            os.replace(tmp, self.run_dir / "progress.json")

    def last_eval_summary(self) -> dict:
        if not self.last_eval:
            return {}
        return {k: self.last_eval[k] for k in ("loss", "accuracy", "macro_f1") if k in self.last_eval}

    # -- evaluation ----------------------------------------------------------------------------
    def run_eval(self) -> None:
        s = self.state
        s.last_eval_step = s.step
        if self.manifest.split("val").rows == 0:
            return
        self.progress(phase="eval", step=s.step, epoch=self.epoch_float())
        m = evaluate(self.d, self.model, self.manifest, "val", self.cfg.eval.batch_size, self.tc.precision, self.par)
        self.last_eval = m
        value = m[self.tc.metric]
        if better(self.tc.metric, value, s.best_metric):
            s.best_metric, s.best_step, s.evals_without_improvement = value, s.step, 0
        else:
            s.evals_without_improvement += 1
            patience = self.tc.early_stopping_patience
            s.stopped_early = patience > 0 and s.evals_without_improvement >= patience
            if s.stopped_early:
                s.stop_reason = "early_stopping"
        record = {"kind": "eval", "step": s.step, "epoch": self.epoch_float(), **self.last_eval_summary(),
                  "weighted_f1": m["weighted_f1"]}
        self.log(record)
        saved = None
        if s.best_step == s.step and s.last_checkpoint_step != s.step:
            saved = str(self.save_checkpoint())  # the best model always has a checkpoint
        stop = self.reporter.report(record, saved)
        if self.reporter.may_stop:
            # Every rank must leave the loop at the same step: rank 0's answer (a pruner's) decides.
            stop = all_reduce_sum(self.d, [1.0 if (stop and self.d.is_main) else 0.0])[0] > 0
            if stop and not s.stopped_early:
                s.stopped_early, s.stop_reason = True, self.reporter.stop_reason

    def epoch_float(self) -> float:
        done = self.loader.state_dict()["batches_yielded"] / max(1, len(self.loader))
        return round(self.state.epoch + min(1.0, done), 4)

    # -- the loop ------------------------------------------------------------------------------
    def train_step(self, micro_batches: list[dict], first_batch_index: int) -> tuple[torch.Tensor, int]:
        """Forward and backward over the micro-batches of one optimizer step, then the update."""
        d, par = self.d, self.par
        step_rows = sum(self.loader.global_batch_rows(first_batch_index + i) for i in range(len(micro_batches)))
        loss_scale = par.dp_size / step_rows
        loss_sum = torch.zeros((), device=d.device)
        for i, batch in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            # Skip the gradient all-reduce on all but the last micro-step: it would be redone anyway.
            with par.grad_sync(last or not d.enabled):
                if par.pipeline is not None:
                    summed = par.pipeline.step(batch, self.micro_batch, loss_scale)
                else:
                    summed = self.forward_backward(batch, loss_scale)
            loss_sum += summed.detach()
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        clip = self.tc.grad_clip if self.tc.grad_clip > 0 else float("inf")
        grad_norm = par.clip_grad_norm_(clip)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.state.step += 1
        self.state.samples_seen += step_rows
        self._grad_norm = grad_norm
        return loss_sum, step_rows

    def forward_backward(self, batch: dict, loss_scale: float) -> torch.Tensor:
        """One micro-batch through the (data-parallel) model; returns its summed loss."""
        d = self.d
        with autocast(d.device, self.tc.precision):
            logits = self.par.module(
                input_ids=batch["input_ids"].to(d.device, non_blocking=True),
                attention_mask=batch["attention_mask"].to(d.device, non_blocking=True),
            ).logits
        labels = batch["labels"].to(d.device, non_blocking=True)
        summed = F.cross_entropy(logits.float(), labels, weight=self.loss_weights, reduction="sum")
        loss = summed * loss_scale
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
        return summed

    def fit(self) -> dict:
        tc, s, d = self.tc, self.state, self.d
        started = time.perf_counter()
        window_loss, window_rows, window_start, window_steps = 0.0, 0, time.perf_counter(), 0
        first_step_s = None
        loss_acc = torch.zeros((), device=d.device)
        while s.step < self.total_steps and not s.stopped_early:
            position = self.loader.state_dict()["batches_yielded"]
            if position == 0 or position >= len(self.loader):
                if position >= len(self.loader):
                    s.epoch += 1  # a checkpoint taken right at an epoch's end
                self.loader.set_epoch(s.epoch)
                position = 0
            batches = iter(self.loader)
            exhausted = False
            while s.step < self.total_steps and not s.stopped_early:
                group = []
                for _ in range(tc.grad_accum):
                    batch = next(batches, None)
                    if batch is None:
                        exhausted = True
                        break
                    group.append(batch)
                if not group:
                    break
                loss_sum, rows = self.train_step(group, position)
                position += len(group)
                faults.maybe_fire(d.rank, s.step, self.run_dir)
                if first_step_s is None:
                    # From the engine's launch when it says when that was, else from the start of fit().
                    launched = float(os.environ.get("TORCHLOOM_LAUNCH_TIME", "0"))
                    first_step_s = time.time() - launched if launched else time.perf_counter() - started
                loss_acc += loss_sum
                window_rows += rows
                window_steps += 1
                if s.step % tc.log_every == 0 or s.step == self.total_steps:
                    # One small all-reduce at log steps only, on every rank at the same step.
                    local = float(loss_acc)
                    window_loss = all_reduce_sum(d, [local])[0] / max(1, window_rows)
                    if not math.isfinite(window_loss):
                        raise FloatingPointError(
                            f"loss is {window_loss} at step {s.step}; lower train.lr or use train.precision fp32"
                        )
                    elapsed = time.perf_counter() - window_start
                    rate = window_rows / elapsed if elapsed > 0 else 0.0
                    lr = self.scheduler.get_last_lr()[0]
                    self.log({"kind": "train", "step": s.step, "epoch": self.epoch_float(),
                              "loss": round(window_loss, 6), "lr": lr,
                              "grad_norm": round(float(self._grad_norm), 6), "samples_per_s": round(rate, 2)})
                    eta = (self.total_steps - s.step) * elapsed / max(1, window_steps)
                    self.progress(phase="train", step=s.step, epoch=self.epoch_float(), loss=window_loss,
                                  lr=lr, samples_per_s=rate, eta_s=eta)
                    loss_acc.zero_()
                    window_rows, window_steps, window_start = 0, 0, time.perf_counter()
                if tc.eval_every and s.step % tc.eval_every == 0:
                    self.run_eval()
                if tc.checkpoint_every and s.step % tc.checkpoint_every == 0 and s.last_checkpoint_step != s.step:
                    self.save_checkpoint()
                if exhausted:
                    break
            epoch_done = exhausted or self.loader.state_dict()["batches_yielded"] >= len(self.loader)
            if epoch_done:
                if s.last_eval_step != s.step:
                    self.run_eval()
                if not tc.checkpoint_every and s.last_checkpoint_step != s.step:
                    self.save_checkpoint()
        if s.last_eval_step != s.step:
            self.run_eval()
        if s.last_checkpoint_step != s.step:
            self.save_checkpoint()
        train_s = time.perf_counter() - started
        best = self.ckpt_root / f"step-{s.best_step}" if s.best_step >= 0 else None
        return {
            "steps": s.step,
            "total_steps": self.total_steps,
            "epochs": self.epoch_float(),
            "samples_seen": s.samples_seen,
            "train_s": round(train_s, 2),
            "first_step_s": round(first_step_s or 0.0, 2),
            "samples_per_s": round(s.samples_seen / train_s, 2) if train_s > 0 else 0.0,
            "stopped_early": s.stopped_early,
            "stop_reason": s.stop_reason,
            "best_metric": s.best_metric,
            "best_step": s.best_step,
            "best_checkpoint": str(best) if best else None,
            "last_checkpoint": str(self.ckpt_root / f"step-{s.step}"),
            "last_eval": self.last_eval_summary(),
            "resumed_from": self.resumed_from,
            "world_size": d.world_size,
            "device": str(d.device),
        }
