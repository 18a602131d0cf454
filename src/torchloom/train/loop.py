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

import itertools
import json
import math
import time
from collections.abc import Iterator
from dataclasses import replace

import torch
import torch.nn.functional as F

from torchloom.config import Config, batch_multiple, budget, micro_batch_size
from torchloom.data.buckets import use_length_buckets
from torchloom.data.loader import ShardedLoader
from torchloom.embedded import model_path
from torchloom.errors import UserError
from torchloom.jsonio import append_text
from torchloom.manifest import read as read_manifest
from torchloom.model.build import build_classifier
from torchloom.model.device import autocast, choose_precision, grad_scaler
from torchloom.model.packing import packed_logits
from torchloom.runs.runfiles import RunFiles
from torchloom.train import optim, preemption
from torchloom.train.clock import StepClock, flops_shape, rates, summed, time_split
from torchloom.train.distributed import AgreedLater, Dist, all_gather_objects, all_reduce_sum
from torchloom.train.evaluation import eval_record, eval_summary, evaluate
from torchloom.train.parallelize import COMPILE_PAD, compiled_graphs, parallelize
from torchloom.train.reporter import Reporter
from torchloom.train.result import TrainResult
from torchloom.train.resume import Checkpoints, elastic_micro_batch_of, trainer_state
from torchloom.train.state import LogWindow, TrainState, better, class_weights, seed_everything, tag_loss

WINDOW_KEY = "window_s"  # summed with the clock's totals: the ranks' seconds after their first batch
# A shuffle window spans shuffle_buffer / batch_size global batches (data/loader.py); with a large global
# batch and the default buffer that would be 1 or 2, so rows next to each other in the data would meet
# in consecutive steps. 16 steps cost each worker 16 of its micro-batches of memory.
MIN_WINDOW_STEPS = 16


class Trainer:
    """Built once per rank from the config and the run's files (the worker's one owner of them); `fit()` starts
    where train.resume says (train/resume.py: the trainer's state in and out), runs the loop and returns this
    rank's result."""

    def __init__(self, cfg: Config, d: Dist, files: RunFiles, reporter: Reporter | None = None,
                 launched_at: float | None = None, startup: dict | None = None):
        self.cfg, self.d = cfg, d
        # seconds of each phase before the first step (the engine's part comes in `startup`): logged once
        self.startup = dict(startup or {})
        # train.precision auto becomes what this rank's device runs best (model/device.py), once
        self.precision = choose_precision(cfg.train.precision, d.device, scaler_ok=cfg.train.strategy == "ddp")
        self.tc = replace(cfg.train, precision=self.precision.precision)
        self.eval_precision = choose_precision(cfg.eval.precision, d.device, key="eval.precision").precision
        if d.rank == 0:
            print(f"precision {self.precision.precision} ({self.precision.reason})", flush=True)
            if self.precision.warning:
                print(f"warning: {self.precision.warning}", flush=True)
        self.files, self.rd = files, files.rd
        self.reporter = reporter or Reporter()
        self.launched_at = launched_at  # wall clock of the engine's launch: time to first step counts from it
        # A run on a store: the manifest from this host's copy, the shards streamed from the store (ranged reads)
        self.manifest = self.files.streamed(read_manifest(self.rd.data))
        if "auto" in (self.tc.batch_size, self.tc.epochs, self.tc.early_stopping_patience):  # the driver
            # decides where it runs one
            self.tc = budget.resolve(replace(cfg, train=self.tc), self.manifest.num_labels,
                                     self.manifest.split("train").rows, self.manifest.tokenizer.get("max_length")
                                     or 128, batch_multiple(self.tc, d.world_size))[0].train
        if self.manifest.multi_label and self.tc.strategy == "pipeline":
            raise UserError("train.strategy pipeline: not for a multi-label run yet (its last stage computes"
                            " cross-entropy); use ddp or fsdp")
        seed_everything(self.tc.seed)
        t = time.perf_counter()
        self.model = build_classifier(model_path(cfg.model.path), self.manifest.labels, cfg.model.attention_dropout,
                                      multi_label=self.manifest.multi_label)
        self.model.train()  # from_pretrained returns a model in eval mode: dropout off
        self.clock = StepClock(d.device, flops_shape(self.model))  # the whole model's shape, before it is spread
        self.loss_weights = class_weights(self.manifest, self.tc.class_weights, d.device)
        # Before the optimizer is built: FSDP replaces the parameters, a pipeline stage drops the others'.
        self.par = parallelize(self.model, d, self.tc, self.manifest.tokenizer.get("max_length"), self.loss_weights)
        self.checkpoints = Checkpoints(d, files, self.tc, self.par, self.clock, self.log)
        self.startup["model_load_s"] = time.perf_counter() - t
        t = time.perf_counter()
        self.micro_batch = micro_batch_size(self.tc, d.world_size)
        self.loader = self.build_loader(self.micro_batch)
        # Global batches: the same on any number of workers (see data/loader.py), so is the schedule.
        self.steps_per_epoch = self.loader.num_steps
        self.total_steps = self.tc.max_steps or self.steps_per_epoch * self.tc.epochs
        warmup = round(self.tc.warmup_ratio * self.total_steps)
        self.optimizer, self.scheduler = optim.build(
            self.model, self.tc.lr, self.tc.weight_decay, self.total_steps, warmup, self.tc.schedule, d.device
        )
        self.scaler = grad_scaler(self.tc.precision, d.device)
        self.state = TrainState()
        self.budget_s = budget.budget_seconds(self.tc.budget)
        self.fit_started = time.perf_counter()
        self.samples_before = 0  # samples_seen when fit() began (a resumed run's are not its speed)
        self.last_eval: dict | None = None
        self.first_step_s: float | None = None
        self.notice = AgreedLater(d)  # the preemption notice, shared at step boundaries
        self.resumed_from: str | None = None
        self.resumed_world_size = self.resumed_step = None  # a resume's: the checkpoint's workers, step
        self.startup["data_s"] = time.perf_counter() - t  # the loader and the optimizer (and a resume: fit)
        if self.tc.trace_rows:
            self.rd.logs.mkdir(parents=True, exist_ok=True)

    def build_loader(self, micro_batch: int) -> ShardedLoader:
        return ShardedLoader(
            self.manifest, "train", rank=self.par.dp_rank, world_size=self.par.dp_size,
            batch_size=micro_batch, global_batch=self.tc.batch_size, seed=self.tc.seed,
            # at least MIN_WINDOW_STEPS global batches per shuffle window, however large the batch
            shuffle_buffer=max(self.tc.shuffle_buffer, MIN_WINDOW_STEPS * self.tc.batch_size),
            length_bucketing=use_length_buckets(self.tc.length_bucketing, self.manifest),
            pad_id=self.model.config.pad_token_id or 0, pin_memory=self.d.device.type == "cuda",
            pad_multiple=COMPILE_PAD if self.tc.compile else 1, packing=self.tc.packing,
        )

    # -- the loop ------------------------------------------------------------------------------
    def fit(self) -> TrainResult:
        """Every optimizer step, then maybe log, evaluate, checkpoint; at the end a last eval and checkpoint."""
        t = time.perf_counter()
        self.resumed_from = self.start()  # the checkpoint train.resume names, or a fresh start
        self.startup["data_s"] += time.perf_counter() - t
        s, tc = self.state, self.tc
        started = self.fit_started = time.perf_counter()
        self.samples_before = s.samples_seen
        window = LogWindow(torch.zeros((), device=self.d.device))
        self.loader.last_epoch = math.ceil(self.total_steps / self.steps_per_epoch) - 1  # no read-ahead past it
        steps = self.optimizer_steps()
        while s.step < self.total_steps and not s.stopped_early:
            step_started = time.perf_counter()
            micro_batches, first_index, epoch_ends = self.next_batches(steps)
            loss_sum, rows, grad_norm = self.train_step(micro_batches, first_index)
            self.reporter.step_done(s.step)
            if self.first_step_s is None:
                self.first_step_s = self.seconds_since_launch(started)
                self.log_startup(time.perf_counter() - step_started - self.startup["first_batch_s"])
            window.add(loss_sum, rows)
            if s.step % tc.log_every == 0 or s.step == self.total_steps:
                self.log_train(window, grad_norm)
            if (tc.eval_every and s.step % tc.eval_every == 0) or (epoch_ends and s.last_eval_step != s.step):
                self.run_eval()
            every = tc.checkpoint_every
            if s.last_checkpoint_step != s.step and ((every and s.step % every == 0) or (epoch_ends and not every)):
                self.save_checkpoint()
            if s.step < self.total_steps:  # the last step ends the run anyway
                with self.clock.phase("notice"):  # any rank's notice of preemption (train/preemption.py)
                    noticed = self.notice.exchange(preemption.NOTICE.given)
                if noticed:
                    return self.preempted(time.perf_counter() - started)
        self.notice.drain()
        self.loader.close()  # an epoch read ahead that early stopping or a budget left unused
        if s.last_eval_step != s.step:
            self.run_eval()
        if s.last_checkpoint_step != s.step:
            self.save_checkpoint()
        uploads = self.checkpoints.drain()  # the job ends with its last upload done
        result = self.result(time.perf_counter() - started)
        result.uploads = uploads
        return result

    def next_batches(self, steps: Iterator[tuple[list[dict], int, bool]]) -> tuple[list[dict], int, bool]:
        """The next step's micro-batches. The first is start-up (its window read while nothing else runs: the
        start-up account's first_batch_s), the others the time split's data wait."""
        if self.first_step_s is not None:
            with self.clock.phase("data"):
                return next(steps)
        started = time.perf_counter()
        try:
            return next(steps)
        finally:
            self.startup["first_batch_s"] = time.perf_counter() - started

    def seconds_since_launch(self, fit_started: float) -> float:
        """From the engine's launch when it said when (start-up included), else from the start of fit()."""
        return time.time() - self.launched_at if self.launched_at else time.perf_counter() - fit_started

    def optimizer_steps(self) -> Iterator[tuple[list[dict], int, bool]]:
        """(micro-batches, index of the first in its epoch, whether the epoch ends with them) for each
        optimizer step, epoch after epoch. A resumed loader continues mid-epoch where it stopped."""
        loader = self.loader
        while True:
            position = loader.state_dict()["batches_yielded"]
            if position == 0 or loader.epoch_finished:
                if loader.epoch_finished:
                    self.state.epoch += 1  # the last epoch ended (at a checkpoint taken right at its end)
                loader.set_epoch(self.state.epoch)
                position = 0
            batches = iter(loader)
            while group := list(itertools.islice(batches, loader.accum)):
                yield group, position, loader.epoch_finished
                position += len(group)

    def train_step(self, micro_batches: list[dict], first_batch_index: int) -> tuple[torch.Tensor, int, torch.Tensor]:
        """Forward and backward over the micro-batches of one optimizer step, then the update.
        Returns the summed loss, the rows of the whole (global) step and the gradient norm."""
        d, par = self.d, self.par
        step_rows = sum(self.loader.global_batch_rows(first_batch_index + i) for i in range(len(micro_batches)))
        loss_scale = par.dp_size / step_rows
        loss_sum = torch.zeros((), device=d.device)
        with self.clock.phase("forward_backward"):
            for i, batch in enumerate(micro_batches):
                self.clock.count(batch["attention_mask"], batch.get("lengths"))
                last = i == len(micro_batches) - 1
                # Skip the gradient all-reduce on all but the last micro-step: it would be redone anyway.
                with par.grad_sync(last or not d.enabled):
                    if par.pipeline is not None:
                        summed = par.pipeline.step(batch, self.micro_batch, loss_scale)
                    else:
                        summed = self.forward_backward(batch, loss_scale)
                loss_sum += summed.detach()
        with self.clock.phase("optimizer"):
            grad_norm = self.update()
        self.state.step += 1
        self.state.samples_seen += step_rows
        if self.tc.trace_rows:
            rows = [i for b in micro_batches for i in b["index"].tolist() if i >= 0]
            with open(self.rd.row_trace(self.d.rank), "a") as f:
                f.write(json.dumps({"step": self.state.step, "epoch": self.state.epoch, "rows": rows}) + "\n")
        return loss_sum, step_rows, grad_norm

    def update(self) -> torch.Tensor:
        """Clip, step the optimizer (through the GradScaler under fp16) and the schedule; returns the gradient norm."""
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        grad_norm = self.par.clip_grad_norm_(self.tc.grad_clip if self.tc.grad_clip > 0 else float("inf"))
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return grad_norm

    def forward_backward(self, batch: dict, loss_scale: float) -> torch.Tensor:
        """One micro-batch through the (data-parallel) model; returns its summed loss."""
        d = self.d
        with autocast(d.device, self.tc.precision):
            if "cls_index" in batch:  # train.packing: the same logits, one per sequence (model/packing.py)
                logits = packed_logits(self.par.module, self.model, batch, d.device)
            else:
                logits = self.par.module(
                    input_ids=batch["input_ids"].to(d.device, non_blocking=True),
                    attention_mask=batch["attention_mask"].to(d.device, non_blocking=True),
                ).logits
        labels = batch["labels"].to(d.device, non_blocking=True)
        if self.manifest.multi_label:
            summed = tag_loss(logits.float(), labels, self.loss_weights, self.tc.tag_loss)
        else:
            summed = F.cross_entropy(logits.float(), labels, weight=self.loss_weights, reduction="sum")
        loss = summed * loss_scale
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
        return summed

    # -- logging -------------------------------------------------------------------------------
    def log_train(self, window: LogWindow, grad_norm: torch.Tensor) -> None:
        """Collective: the window's mean loss over all ranks (one small all-reduce, at log steps only)."""
        s = self.state
        local_loss = float(window.loss)  # the device has synchronised: the clock's CUDA events are done
        loss, work = summed(self.d, local_loss, self.clock.take_window())
        loss /= max(1, window.rows)
        if not math.isfinite(loss):
            raise FloatingPointError(f"loss is {loss} at step {s.step}; lower train.lr or use train.precision fp32")
        elapsed = time.perf_counter() - window.start
        rate = window.rows / elapsed if elapsed > 0 else 0.0
        lr = self.scheduler.get_last_lr()[0]
        self.log({"kind": "train", "step": s.step, "epoch": self.epoch_float(), "loss": round(loss, 6), "lr": lr,
                  "grad_norm": round(float(grad_norm), 6), "samples_per_s": round(rate, 2),
                  **self.work_rates(work, elapsed), "time_split": time_split(work, elapsed, self.d.world_size),
                  "time": round(time.time(), 3)})  # wall clock: throughput over any step range, from outside
        eta = (self.total_steps - s.step) * elapsed / max(1, window.steps)
        self.progress(phase="train", step=s.step, epoch=self.epoch_float(), loss=loss, lr=lr,
                      samples_per_s=rate, eta_s=eta)
        window.reset()

    def work_rates(self, work: dict[str, float], seconds: float) -> dict:
        return rates(work, seconds, max(1, self.d.world_size // self.par.dp_size), self.d.device,
                     self.precision.precision, self.d.world_size)

    def log_startup(self, first_step_s: float) -> None:
        """The start-up account, once: where the time before the first step went on this rank's side."""
        self.startup["first_step_s"] = first_step_s
        self.startup = {k: round(v, 3) for k, v in self.startup.items() if v is not None}
        self.log({"kind": "startup", "step": self.state.step, **self.startup,
                  "since_launch_s": round(self.first_step_s or 0.0, 3)})

    def log(self, record: dict) -> None:
        if self.d.is_main:
            append_text(self.rd.metrics, json.dumps(record) + "\n")  # never through a link (jsonio.append_text)
            self.reporter.log(record)  # rank 0 only; MLflow reads the file instead (tracking.MetricsForwarder)

    def progress(self, **fields) -> None:
        if self.d.is_main:
            self.reporter.progress({"total_steps": self.total_steps, **fields})

    def epoch_float(self) -> float:
        done = self.loader.state_dict()["batches_yielded"] / max(1, len(self.loader))
        return round(self.state.epoch + min(1.0, done), 4)

    def last_eval_summary(self) -> dict:
        return eval_summary(self.last_eval)

    # -- evaluation ----------------------------------------------------------------------------
    def run_eval(self) -> None:
        """Collective: validate, track the best, maybe stop early; the best model always gets a checkpoint."""
        s = self.state
        s.last_eval_step = s.step
        if self.manifest.split("val").rows == 0:
            return
        self.progress(phase="eval", step=s.step, epoch=self.epoch_float())
        with self.clock.phase("eval"):
            m = evaluate(self.d, self.model, self.manifest, "val", self.cfg.eval.batch_size, self.eval_precision,
                         self.par, packing=self.tc.packing)
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
        if self.budget_s is not None and not s.stopped_early and self.budget_spent():
            s.stopped_early, s.stop_reason = True, "budget"
        record = eval_record(m, s.step, self.epoch_float())
        self.log(record)
        saved = None
        if s.best_step == s.step and s.last_checkpoint_step != s.step:
            saved = str(self.save_checkpoint())
        stop = self.reporter.report(record, saved)
        if self.reporter.may_stop:
            # Every rank must leave the loop at the same step: rank 0's answer (a pruner's) decides.
            # Rank 0 may have waited on the tuner's database meanwhile: not under the collective timeout.
            stop = all_reduce_sum(self.d, [1.0 if (stop and self.d.is_main) else 0.0], slow=True)[0] > 0
            if stop and not s.stopped_early:
                s.stopped_early, s.stop_reason = True, self.reporter.stop_reason

    def budget_spent(self) -> bool:
        """Collective: rank 0's clock says whether train.budget's time is spent (every rank leaves at one step)."""
        spent = time.perf_counter() - self.fit_started >= self.budget_s
        return all_reduce_sum(self.d, [1.0 if (spent and self.d.is_main) else 0.0])[0] > 0

    # -- preemption ----------------------------------------------------------------------------
    def preempted(self, train_s: float) -> TrainResult:
        """Every rank is here after the same step: one checkpoint of it if it fits in the grace (Checkpoints.at_notice),
        uploads drained, the notice logged."""
        self.notice.drain()
        s = self.state
        own = preemption.NOTICE.source if preemption.NOTICE.given else ""
        preemption.NOTICE.give("a peer's notice")  # a rank that learned it from the all-reduce: its grace starts now
        sources = [x for x in all_gather_objects(self.d, own) if x]
        resume_at, written_s, uploads = self.checkpoints.at_notice(s, self.save_checkpoint)
        record = {"kind": "preempted", "step": s.step, "notice": sources[0] if sources else "a notice",
                  "checkpoint_s": written_s, "resume_at_step": resume_at, "time": round(time.time(), 3)}
        self.log(record)
        result = self.result(train_s)
        result.uploads = uploads
        result.preemptions = [{"step": s.step, "notice": record["notice"], "checkpoint_s": written_s,
                               "resumed_from_step": resume_at, "workers": 0}]
        return result

    # -- resume and checkpoints (train/resume.py: the state contract, the Checkpoints) -------------
    def trainer_state(self) -> dict:
        return trainer_state(self.scheduler, self.scaler, self.loader, self.state)

    def start(self) -> str | None:
        """Where this training starts: the checkpoint's path once its weights, optimizer and state are back, or None
        for a fresh start."""
        loaded = self.checkpoints.start(self.model, self.optimizer)
        if loaded is None:
            return None
        self.restore(loaded[1])
        self.checkpoints.went_on(self.state.step)
        return loaded[0]

    def restore(self, ts: dict) -> None:
        """The training where trainer_state() left it: schedule, scaler, counters, and the loader's position on these
        workers (on others: the same global batches, elastic_micro_batch_of)."""
        self.scheduler.load_state_dict(ts["scheduler"])
        if self.scaler is not None and ts.get("scaler"):
            self.scaler.load_state_dict(ts["scaler"])
        self.state = TrainState(**ts["state"])
        self.resumed_step, saved = self.state.step, ts["loader"]
        self.resumed_world_size, micro = elastic_micro_batch_of(saved, self.tc, self.par, self.micro_batch)
        if micro != self.micro_batch:
            self.micro_batch, self.loader = micro, self.build_loader(micro)
        if self.resumed_world_size and self.d.is_main:
            print(f"train: resuming step {self.state.step} on {self.par.dp_size} workers (the checkpoint's run had"
                  f" {self.resumed_world_size}): the same global batches of {self.tc.batch_size} go on, as"
                  f" {self.loader.accum} micro-batch(es) of {micro} per worker", flush=True)
        if self.tc.length_bucketing == "auto" and "length_bucketing" in saved:
            self.loader.length_bucketing = bool(saved["length_bucketing"])  # auto goes on as the run began
        self.loader.load_state_dict(saved)

    def save_checkpoint(self) -> str:
        return self.checkpoints.save(self.state, self.model, self.optimizer, self.trainer_state(),
                                     self.last_eval_summary())

    def result(self, train_s: float) -> TrainResult:
        """Collective (the clock's run totals are summed over the ranks): what this launch did. The time split is of
        the time after the first batch arrived (its read is start-up: first_batch_s)."""
        s = self.state
        self.clock.settle()
        # each rank's own window beside its phases: a rank whose first batch came sooner spent more of the run in
        # its phases than rank 0's window holds (summed over ranks they were 1.02 of it, tests/test_train.py)
        window = {**self.clock.run, WINDOW_KEY: train_s - self.startup.get("first_batch_s", 0.0)}
        _, work = summed(self.d, 0.0, window)
        work_rates = self.work_rates(work, train_s)
        return TrainResult(
            steps=s.step, total_steps=self.total_steps, epochs=self.epoch_float(), samples_seen=s.samples_seen,
            train_s=round(train_s, 2), first_step_s=round(self.first_step_s or 0.0, 2),
            samples_per_s=round((s.samples_seen - self.samples_before) / train_s, 2) if train_s > 0 else 0.0,
            stopped_early=s.stopped_early, stop_reason=s.stop_reason, best_metric=s.best_metric,
            best_step=s.best_step,
            best_checkpoint=str(self.rd.checkpoint(s.best_step)) if s.best_step >= 0 else None,
            last_checkpoint=str(self.rd.checkpoint(s.step)), last_eval=self.last_eval_summary(),
            resumed_from=self.resumed_from, world_size=self.d.world_size, device=str(self.d.device),
            resumed_world_size=self.resumed_world_size,
            resumed_at_step=self.resumed_step,
            precision=self.precision.precision, precision_reason=self.precision.reason, startup=self.startup,
            tokens_per_s=work_rates["tokens_per_s"], padding=work_rates["padding"], mfu=work_rates.get("mfu"),
            time_split=time_split(work, work[WINDOW_KEY] / self.d.world_size, self.d.world_size),
            global_batch=self.tc.batch_size,
            compiled_graphs=compiled_graphs() if self.tc.compile else None, packed=self.tc.packing,
        )
