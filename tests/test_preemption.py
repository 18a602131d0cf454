"""Preemption: a notice (SIGTERM to a worker, or to its launcher) stops every rank after the same step with a
checkpoint; the run goes on from it to the weights of an uninterrupted run, and the restart budget is untouched."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch
from test_train import cfg_for, data_dir, models, new_run, weights  # noqa: F401  (fixtures)

from torchloom.engines import local

pytestmark = pytest.mark.heavy(7)  # see tests/support/schedule.py

# 103 rows, batch 8: 13 steps; a periodic checkpoint every 4 steps
COMMON = ("--train.epochs", "1", "--train.keep_last", "20", "--train.checkpoint_every", "4")
STEPS = 13

# 2 rounds in CI; `-m soak` runs the other 8 of the 10
ROUNDS = [0, *(pytest.param(n, marks=pytest.mark.soak) for n in range(1, 10))]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_dir, models):  # noqa: F811
    rd = new_run(tmp_path_factory.mktemp("uninterrupted"), data_dir, "ref")
    local.train(cfg_for(rd, models["dropout"], *COMMON), rd, quiet=True)
    return rd


def assert_same_weights(reference, rd) -> None:
    a, b = weights(reference / "checkpoints" / f"step-{STEPS}"), weights(rd / "checkpoints" / f"step-{STEPS}")
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("round_", ROUNDS)
def test_sigterm_to_a_random_worker_checkpoints_its_step_and_goes_on_to_the_same_weights(
        tmp_path, data_dir, models, reference, round_):  # noqa: F811
    rng = random.Random(2900 + round_)
    rank, step = rng.randrange(2), rng.randrange(2, 12)
    rd = new_run(tmp_path, data_dir, "preempted")
    os.environ["TORCHLOOM_FAULT"] = f"rank={rank},step={step},kind=term"
    try:  # max_restarts 0: a preemption that used the budget would end the run
        result = local.train(cfg_for(rd, models["dropout"], *COMMON, "--engine.max_restarts", "0"), rd, quiet=True)
    finally:
        del os.environ["TORCHLOOM_FAULT"]
    [p] = result.preemptions
    # the notice reaches the loop at the end of its step or of the next one, and the ranks agree on it one boundary
    # later (train/distributed.AgreedLater): no step is lost
    assert p["step"] in (step, step + 1, step + 2), (step, p)
    assert p["checkpoint_s"] >= 0 and p["resumed_from_step"] == p["step"] and p["workers"] == 2
    assert p["notice"].startswith(f"SIGTERM to rank {rank} on host ")
    assert (rd / "checkpoints" / f"step-{p['step']}").is_dir()
    assert result.steps == STEPS and result.resumed_from.endswith(f"step-{p['step']}")
    assert_same_weights(reference, rd)
    first = [json.loads(f.read_text()) for f in (rd / "logs").glob("placement-*-start0.json")]
    assert len(first) == 2 and all(f["preempted"] for f in first)
    assert len(list((rd / "logs").glob("placement-*-start1.json"))) == 2
    assert not list((rd / "logs").glob("error-rank*.json"))


def test_sigterm_while_a_checkpoint_is_being_written_leaves_it_whole_and_goes_on_from_it(
        tmp_path, data_dir, models, reference, monkeypatch):  # noqa: F811
    # The notice lands while rank 1 writes the periodic checkpoint of step 4: the handler does no I/O, so the
    # write finishes untouched; the ranks stop after step 4 (or 5, or 6: they agree on a notice a boundary later)
    # and the run goes on to the same weights.
    rd = new_run(tmp_path, data_dir, "saving")
    monkeypatch.setenv("TORCHLOOM_FAULT", "rank=1,step=4,kind=term_saving")
    result = local.train(cfg_for(rd, models["dropout"], *COMMON, "--engine.max_restarts", "0"), rd, quiet=True)
    assert (rd / "logs" / "fault-fired-rank1-step4").read_text().endswith("while saving: True")
    [p] = result.preemptions
    assert p["step"] in (4, 5, 6) and p["checkpoint_s"] >= 0 and p["resumed_from_step"] == p["step"], p
    for step in {4, p["step"]}:
        meta = json.loads((rd / "checkpoints" / f"step-{step}" / "meta.json").read_text())
        assert meta["step"] == step and meta["files"]
    assert not list((rd / "checkpoints").glob(".step-*.tmp"))
    assert result.steps == STEPS and result.resumed_from.endswith(f"step-{p['step']}")
    assert_same_weights(reference, rd)


def train_command(rd, model: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "torchloom", "train", "--output.dir", str(rd), "--model.path", model,
            "--train.precision", "fp32", "--train.batch_size", "8", "--train.lr", "1e-3", "--engine.workers", "2",
            "--train.log_every", "1", "--tracking.enabled", "false", *COMMON, *extra]


def wait_for_step(rd, step: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if (rd / "metrics.jsonl").is_file():
            lines = (rd / "metrics.jsonl").read_text().splitlines()
            if any(json.loads(x).get("kind") == "train" and json.loads(x)["step"] >= step for x in lines if x):
                return
        time.sleep(0.05)
    raise AssertionError(f"step {step} not reached; stderr: {proc.stderr.read() if proc.stderr else ''}")


def test_sigterm_to_the_launcher_exits_75_after_a_checkpoint_and_resume_gives_the_same_weights(
        tmp_path, data_dir, models, reference):  # noqa: F811
    # Kubernetes and most schedulers signal the launcher (PID 1), not the workers: torch elastic passes
    # SIGTERM on to them, they stop after the same step with a checkpoint, and the command says how to go on.
    step = random.Random(2975).randrange(2, 10)
    rd = new_run(tmp_path, data_dir, "launcher")
    env = {**os.environ, "TORCHLOOM_FAULT": "rank=0,step=1,kind=slow,sleep=0.4"}  # time to signal mid-run
    proc = subprocess.Popen(train_command(rd, models["dropout"], "--engine.max_restarts", "0"), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_step(rd, step, proc)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 75, stderr[-3000:]
    assert "Traceback" not in stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("torchloom: train: preempted at step ") and "--resume" in last, last
    stopped_at = int(last.split("preempted at step ")[1].split()[0])
    assert step <= stopped_at < STEPS and "checkpoint written in" in last, last
    assert (rd / "checkpoints" / f"step-{stopped_at}").is_dir() and not (rd / "train_result.json").exists()
    # the same command with --resume goes on from there, to the uninterrupted run's weights
    done = subprocess.run(train_command(rd, models["dropout"], "--resume"), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((rd / "train_result.json").read_text())
    assert result["resumed_at_step"] == stopped_at and result["steps"] == STEPS
    assert_same_weights(reference, rd)


def test_a_grace_period_too_short_for_a_checkpoint_goes_on_from_the_periodic_one(
        tmp_path, data_dir, models, reference, capfd):  # noqa: F811
    # A checkpoint took tens of ms here; 10 ms of grace cannot hold the next one: no checkpoint is started,
    # one line says so, and the run goes on from the periodic checkpoint of step 4, to the same weights.
    # The notice at step 5 is acted on after step 6 or 7 (a boundary later, or two when the notice thread
    # is late under load), never at step 8, whose periodic checkpoint would be written anyway.
    rd = new_run(tmp_path, data_dir, "short")
    os.environ["TORCHLOOM_FAULT"] = "rank=1,step=5,kind=term"
    try:
        result = local.train(cfg_for(rd, models["dropout"], *COMMON, "--engine.max_restarts", "0",
                                     "--train.preemption_grace_s", "0.01"), rd, quiet=True)
    finally:
        del os.environ["TORCHLOOM_FAULT"]
    [p] = result.preemptions
    assert p["step"] in (6, 7) and p["checkpoint_s"] == -1 and p["resumed_from_step"] == 4, p
    assert not (rd / "checkpoints" / f"step-{p['step']}").exists() and result.resumed_from.endswith("step-4")
    lines = [x for x in capfd.readouterr().out.splitlines() if "preempted at step" in x]
    assert len(lines) == 1 and "more than the" in lines[0] and "the newest checkpoint, step 4," in lines[0], lines
    assert_same_weights(reference, rd)


def test_a_notice_url_gives_the_notice_only_when_it_says_so():
    # a real HTTP server on 127.0.0.1 in the role of a cloud's metadata server: 404, then "FALSE", then "TRUE"
    import http.server
    import threading

    from torchloom.train import preemption

    answers = [(404, b""), (200, b"FALSE"), (200, b"TRUE")]
    seen = []

    class Metadata(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            code, body = answers[min(len(seen), len(answers) - 1)]
            seen.append(code)
            self.send_response(code)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metadata)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    preemption.NOTICE.clear()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/instance/preempted"
        preemption.poll_url(url, every_s=0.05)
        deadline = time.monotonic() + 10
        while not preemption.NOTICE.given and time.monotonic() < deadline:
            time.sleep(0.02)
        assert preemption.NOTICE.given and len(seen) >= 3, seen
        assert preemption.NOTICE.source.startswith(url) and "(TRUE)" in preemption.NOTICE.source
    finally:
        preemption.NOTICE.clear()
        server.shutdown()
