"""Nothing lost when commands die (runs/ledger.py, engines/lifeline.py): seeded rounds where a torchloom command
(prepare, train, run, export, evaluate, predict) is SIGKILLed at a random moment while a user adds, edits and
removes files before, during and after it, a dead host's entry may be left in the ledger, and the next command
(any of them, with or without --overwrite or --resume) runs on what is left. Each round asserts: every user file
byte for byte, every input untouched, no process of the killed command alive 10 s after the kill; over the
rounds, torchloom's own files are replaced whole where the record allows and refused in one line where it does
not (both must occur). A few rounds in CI, locally and on an S3 server (moto's, on 127.0.0.1); many under -m soak.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from support.command import torchloom
from support.owned import BUCKET, CREDENTIALS

BEAT_S = 0.25  # the commands' beat (TORCHLOOM_LEDGER_BEAT_S): a user's "later" is 2 beats and a second on
LATER_S = 2 * BEAT_S + 1.2
ENV = {"HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "TORCHLOOM_CPU_BF16": "0",
       "TORCHLOOM_LEDGER_BEAT_S": str(BEAT_S), "TORCHLOOM_LEASE_S": "2"}
# How long each command takes here, about: the kill falls anywhere in it (or after it ended).
KILL_WITHIN_S = {"prepare": 12, "train": 10, "run": 25, "export": 8, "evaluate": 8, "predict": 6}
USER_PLACES = ["NOTES.md", "mine/labels-v2.csv", "model/NOTES.md", "checkpoints/mine.txt", "data/extra.csv",
               "plots/my-figure.png", "logs/mine.log"]


@pytest.fixture(scope="module")
def template(tmp_path_factory, topics_csv, tiny_model_dir):
    """A finished run of the tiny model (in this process: prepare, baseline, train, export, evaluate), copied
    for each round with its files' times (its ledger then vouches for the copy as it did for it)."""
    from torchloom import cli

    root = tmp_path_factory.mktemp("oracle")
    out = root / "template"
    lines = Path(topics_csv).read_text().splitlines()
    Path(topics_csv).with_name("texts.csv").write_text("\n".join(["text", *(line.rsplit(",", 1)[0] for line in
                                                                           lines[1:])]) + "\n")
    code = cli.main(["run", "--data.path", str(topics_csv), "--model.path", tiny_model_dir, "--output.dir", str(out),
                     "--tracking.enabled", "false", "--train.epochs", "2", "--train.checkpoint_every", "2"])
    assert code == 0
    return out


def command(name: str, out: str, data: str, model: str, rng: random.Random, then: bool) -> list[str]:
    """A command line a user types; `then`: the next command after a kill, which may ask for --overwrite or
    --resume."""
    common = ["--output.dir", out, "--model.path", model, "--tracking.enabled", "false"]
    flags = []
    if then and rng.random() < 0.6 and name in ("prepare", "run", "train"):
        flags = ["--overwrite"]
    elif then and name == "train" and rng.random() < 0.7:
        flags = ["--resume"]
    elif not then and name in ("prepare", "run"):
        flags = ["--overwrite"]
    if name in ("prepare", "run"):
        return [name, "--data.path", data, *common, "--train.epochs", "2", "--train.checkpoint_every", "2", *flags]
    if name == "train":
        return ["train", *common, "--train.epochs", "2", "--train.checkpoint_every", "2",
                *(flags or (["--resume"] if not then else []))]
    if name in ("export", "evaluate"):
        return [name, "--output.dir", out, "--tracking.enabled", "false"]
    texts = str(Path(data).with_name("texts.csv"))  # the data's texts alone (its label column would clash)
    return ["predict", "--model", f"{out}/model", "--input", texts, "--output", f"{out}-predictions.jsonl",
            *(["--overwrite"] if then and rng.random() < 0.5 else [])]


class Place:
    """A run directory, locally or on the store, as a user touches it."""

    def __init__(self, where: str):
        self.where = where

    @property
    def on_store(self) -> bool:
        return self.where.startswith("s3://")

    def write(self, rel: str, data: bytes) -> None:
        if self.on_store:
            from torchloom.store import storage

            storage.write_bytes(storage.join(self.where, rel), data)
            return
        path = Path(self.where) / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)

    def remove(self, rel: str) -> None:
        if self.on_store:
            from torchloom.store import storage

            storage.delete(storage.join(self.where, rel))
        else:
            (Path(self.where) / rel).unlink()

    def snapshot(self) -> dict[str, bytes]:
        if self.on_store:
            from torchloom.store import storage

            return {rel: storage.read_bytes(storage.join(self.where, rel)) for rel in storage.list_files(self.where)}
        root = Path(self.where)
        return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()} \
            if root.is_dir() else {}

    def stats(self) -> dict[str, tuple]:
        if self.on_store:
            from torchloom.store import storage

            return storage.list_objects(self.where)
        root = Path(self.where)
        return {p.relative_to(root).as_posix(): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")
                if p.is_file()} if root.is_dir() else {}

    def read_ledger(self) -> dict | None:
        raw = self.snapshot().get("torchloom-ledger.json")
        return json.loads(raw) if raw else None


def alive_with(token: str) -> list[str]:
    """The processes whose environment holds the round's token: the killed command and everything it started."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if token.encode() in (entry / "environ").read_bytes():
                found.append(f"{entry.name}: {(entry / 'cmdline').read_bytes()[:120]!r}")
        except OSError:
            continue
    return found


def digest_tree(path: Path) -> dict[str, str]:
    return {p.relative_to(path).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()} if path.is_dir() else {
        path.name: hashlib.sha256(path.read_bytes()).hexdigest()}


def user_edit(place: Place, users: dict[str, bytes], rng: random.Random, when: str, anywhere: bool) -> None:
    """Add, edit or remove one of the user's files (`anywhere`: under a run's names too)."""
    choices = USER_PLACES if anywhere else ["NOTES.md", "mine/labels-v2.csv", f"mine/{when}.txt"]
    op = rng.choice(["add", "add", "edit", "remove"]) if users else "add"
    if op == "remove":
        rel = rng.choice(sorted(users))
        place.remove(rel)
        del users[rel]
        return
    rel = rng.choice(sorted(users)) if op == "edit" else rng.choice(choices)
    data = f"the user's {rel}, {when}, {uuid.uuid4().hex}\n".encode() * rng.randint(1, 4)
    place.write(rel, data)
    users[rel] = data


def dead_host_entry(place: Place, rng: random.Random) -> None:
    """Another host's command, open in the ledger and long dead (its beat 10 minutes old)."""
    from torchloom.runs.ledger import beat_name

    ledger = place.read_ledger()
    if ledger is None:
        return
    host = f"lost-host-{rng.randint(0, 999)}"
    pid = rng.randint(1000, 99999)
    ledger["open"].append({"pid": pid, "host": host, "started": 1, "claims": ["*"], "foreign": {}})
    place.write("torchloom-ledger.json", json.dumps(ledger).encode())
    place.write(beat_name(pid, host), b"")
    if not place.on_store:
        old = time.time() - 600
        os.utime(Path(place.where) / beat_name(pid, host), (old, old))


def one_round(seed: int, place: Place, template: Path, data: Path, model: str, work: Path, env: dict,
              plan: dict | None = None) -> str:
    """One round (the module's docstring); `plan` fixes some of its choices: `quiet` (the user touches nothing),
    `next` (the next command's line, as command() would give it)."""
    rng = random.Random(seed)
    plan = plan or {}
    if not place.on_store:
        shutil.copytree(template, place.where, copy_function=shutil.copy2)
    inputs_before = {"data": digest_tree(data.parent), "model": digest_tree(Path(model))}
    users: dict[str, bytes] = {}
    for _ in range(0 if plan.get("quiet") else rng.randint(0, 2)):  # before the killed command
        user_edit(place, users, rng, "before", anywhere=True)
    killed = rng.choice(sorted(KILL_WITHIN_S)) if not place.on_store else "run"
    token = uuid.uuid4().hex
    argv = command(killed, place.where, str(data), model, rng, then=False)
    proc = subprocess.Popen([sys.executable, "-m", "torchloom", *argv], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env={**env, "TORCHLOOM_ORACLE": token}, cwd=work)
    kill_at = rng.uniform(0.5, KILL_WITHIN_S[killed])
    if rng.random() < 0.5 and not plan.get("quiet"):  # during: the user's own files, beside the run's names
        during = threading.Timer(rng.uniform(0, kill_at), user_edit, (place, users, random.Random(seed + 1), "during",
                                                                       False))
        during.start()
    else:
        during = None
    try:
        proc.wait(timeout=kill_at)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    if during is not None:
        during.join()
    deadline = time.monotonic() + 10
    while alive_with(token) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive_with(token), (seed, killed, alive_with(token))
    time.sleep(LATER_S)  # after: later than the killed command's last record
    for _ in range(0 if plan.get("quiet") else rng.randint(0, 3)):
        user_edit(place, users, rng, "after", anywhere=True)
    if rng.random() < 0.3:
        dead_host_entry(place, rng)
    nxt = rng.choice(["prepare", "train", "run", "export", "evaluate", "predict"])
    argv = command(nxt, place.where, str(data), model, rng, then=True)
    if plan.get("next"):
        nxt, argv = plan["next"][0], command(plan["next"][0], place.where, str(data), model, rng, then=False)
    before, stats_before = place.snapshot(), place.stats()
    done = torchloom(*argv, env=env, cwd=work, timeout=300)  # in this process: the ledger judges by the entry's beat
    after, stats_after = place.snapshot(), place.stats()
    for rel, content in users.items():
        assert after.get(rel) == content, (seed, killed, nxt, rel, done.stderr[-2000:])
    assert {"data": digest_tree(data.parent), "model": digest_tree(Path(model))} == inputs_before, (seed, killed, nxt)
    assert "Traceback" not in done.stderr, (seed, killed, nxt, done.stderr[-3000:])
    refused = done.returncode == 2 and "nothing deleted" in done.stderr
    if refused:  # nothing deleted; the ledger may have settled the killed command's entry (and its beat file)
        def content(tree: dict) -> dict:
            return {rel: v for rel, v in tree.items()
                    if rel != "torchloom-ledger.json" and ".torchloom-beat" not in rel}

        assert content(after) == content(before), (seed, killed, nxt)
        return "refused"
    if "--overwrite" in argv and done.returncode == 0 and nxt in ("run", "prepare"):
        old = {rel for rel in before if rel not in users and rel.startswith(("checkpoints/", "model/", "data/"))}
        kept = {rel for rel in old if stats_before[rel] == stats_after.get(rel)}
        assert not kept or nxt == "prepare", (seed, kept)  # replaced whole: no earlier checkpoint, model or data
        return "replaced"
    errors = [line for line in done.stderr.splitlines() if line.startswith("torchloom: error:")]
    return f"{nxt}: rc {done.returncode}{': ' + errors[0][:160] if errors else ''}"


def rounds(seeds, place_of, template, data, model, tmp_path, env, plans=None) -> set[str]:
    seen = set()
    for i, seed in enumerate(seeds):
        work = tmp_path / f"cwd{seed}"
        work.mkdir()
        outcome = one_round(seed, place_of(seed), template, data, model, work, env, (plans or {}).get(i))
        print(f"round {seed}: {outcome}", flush=True)
        seen.add(outcome.split(":")[0] if outcome in ("replaced", "refused") else outcome)
    return seen


@pytest.mark.heavy(3)
def test_the_fault_oracle_on_local_runs(template, topics_csv, tiny_model_dir, tmp_path):
    env = {**os.environ, **ENV, "TORCHLOOM_CACHE": str(tmp_path / "cache")}
    # the first round: the user touches nothing, and `run --overwrite` after the kill replaces the run whole; the
    # second: `run --overwrite` over the user's files (refused, unless the user removed them all); the third: any
    seen = rounds([3, 7, 11], lambda s: Place(str(tmp_path / f"run{s}")), template, Path(topics_csv),
                  tiny_model_dir, tmp_path, env, plans={0: {"quiet": True, "next": ["run"]}, 1: {"next": ["run"]}})
    assert {"replaced", "refused"} <= seen, seen


@pytest.mark.soak
def test_the_fault_oracle_soak(template, topics_csv, tiny_model_dir, tmp_path):
    env = {**os.environ, **ENV, "TORCHLOOM_CACHE": str(tmp_path / "cache")}
    n = int(os.environ.get("TORCHLOOM_ORACLE_ROUNDS", "200"))
    seen = rounds(range(1000, 1000 + n), lambda s: Place(str(tmp_path / f"run{s}")), template, Path(topics_csv),
                  tiny_model_dir, tmp_path, env)
    assert {"replaced", "refused"} <= seen, seen


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    pytest.importorskip("moto")
    from support.s3 import s3_server

    with s3_server(tmp_path_factory.mktemp("moto"), BUCKET, CREDENTIALS) as port:
        yield port


def test_the_fault_oracle_on_the_store(s3, template, topics_csv, tiny_model_dir, tmp_path):
    """A run on S3 whose driver is killed: the next command keeps every object of the user's."""
    env = {**os.environ, **ENV, "TORCHLOOM_CACHE": str(tmp_path / "cache")}
    seen = rounds([21], lambda s: Place(f"s3://{BUCKET}/oracle/run{s}"), template, Path(topics_csv),
                  tiny_model_dir, tmp_path, env)
    assert seen, seen


# -- the audit's cases, as a user types them --------------------------------------------------------------------

def test_run_killed_after_its_first_checkpoint_then_overwrite_keeps_the_user_s_files(topics_csv, tiny_model_dir,
                                                                                      tmp_path):
    """`torchloom run` SIGKILLed once its first checkpoint is there: no process of it is alive 10 s later; the user
    then adds NOTES.md and mine/labels-v2.csv; `torchloom run --overwrite` refuses in one line and keeps both."""
    from support.owned import one_error

    out = tmp_path / "run"
    token = uuid.uuid4().hex
    env = {**os.environ, **ENV, "TORCHLOOM_CACHE": str(tmp_path / "cache")}
    argv = ["run", "--data.path", str(topics_csv), "--model.path", tiny_model_dir, "--output.dir", str(out),
            "--tracking.enabled", "false", "--train.epochs", "3", "--train.checkpoint_every", "1"]
    proc = subprocess.Popen([sys.executable, "-m", "torchloom", *argv], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env={**env, "TORCHLOOM_ORACLE": token})
    deadline = time.monotonic() + 240
    while not list(out.glob("checkpoints/step-*/meta.json")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before its first checkpoint"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 10
    while alive_with(token) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive_with(token)
    time.sleep(LATER_S)
    (out / "NOTES.md").write_text("my notes\n")
    (out / "mine").mkdir()
    (out / "mine" / "labels-v2.csv").write_text("text,label\nx,y\n")
    error = one_error(torchloom(*argv, "--overwrite", env=env, timeout=300))
    assert "not replaced, nothing deleted" in error and "NOTES.md" in error and "mine/labels-v2.csv" in error, error
    assert (out / "NOTES.md").read_text() == "my notes\n"
    assert (out / "mine" / "labels-v2.csv").read_text() == "text,label\nx,y\n"
    assert list(out.glob("checkpoints/step-*/meta.json"))  # nothing of torchloom's deleted either (all or nothing)


def test_the_torchrun_entry_refuses_a_fresh_start_over_checkpoints_and_records_what_it_trains(template, tmp_path,
                                                                                              tiny_model_dir):
    """What `torchloom k8s train` pods run: over an earlier training's checkpoints without --train.resume, one line
    and every checkpoint kept; with --train.resume latest it goes on, and what it wrote is in the run's ledger."""
    from torchloom.runs.ledger import LocalTree, deletable

    run = tmp_path / "run"
    shutil.copytree(template, run, copy_function=shutil.copy2)
    before = {p.relative_to(run).as_posix(): p.read_bytes() for p in (run / "checkpoints").rglob("*") if p.is_file()}
    env = {**os.environ, **ENV}

    def torchrun(*extra: str, rdzv_id: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
                               "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", "--rdzv-id", rdzv_id,
                               "-m", "torchloom.engines.torchrun", "--output.dir", str(run), "--train.epochs", "3",
                               "--model.path", tiny_model_dir, "--tracking.enabled", "false", *extra],
                              capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)

    refused = torchrun(rdzv_id="job-a")
    assert refused.returncode != 0
    errors = [line for line in refused.stderr.splitlines() if line.startswith("torchloom: error:")]
    assert errors and "checkpoint(s) of an earlier training" in errors[0], refused.stderr[-3000:]
    assert "--train.resume latest" in errors[0]  # (the traceback after it is torchrun's own ChildFailedError)
    assert {p.relative_to(run).as_posix(): p.read_bytes() for p in (run / "checkpoints").rglob("*")
            if p.is_file()} == before
    resumed = torchrun("--train.resume", "latest", rdzv_id="job-b")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert deletable(LocalTree(run), "output.dir")  # every file there is torchloom's by the ledger, the new too
    ledger = json.loads((run / "torchloom-ledger.json").read_text())
    assert not ledger["open"] and any(rel.startswith("checkpoints/step-") for rel in ledger["files"])


def test_resume_latest_with_no_checkpoint_says_so(tmp_path, topics_csv, tiny_model_dir):
    from torchloom import cli

    out = tmp_path / "run"
    assert cli.main(["prepare", "--data.path", str(topics_csv), "--model.path", tiny_model_dir, "--output.dir",
                     str(out), "--tracking.enabled", "false", "--eval.baseline", "false"]) == 0
    assert not (out / "checkpoints").exists()
    proc = torchloom("train", "--output.dir", str(out), "--train.epochs", "1", "--resume", "--tracking.enabled",
                     "false", env=ENV, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = proc.stdout + proc.stderr
    assert "train.resume latest: no complete checkpoint in" in said and "training from step 0" in said, said[-3000:]


def test_a_model_with_pickled_weights_is_refused_in_one_line(template, tmp_path):
    """pytorch_model.bin is a pickle: loading one can run code. torchloom loads safetensors only."""
    import torch
    from safetensors.torch import load_file
    from support.owned import one_error

    model = tmp_path / "model"
    shutil.copytree(template / "model", model)
    torch.save(load_file(model / "model.safetensors"), model / "pytorch_model.bin")
    (model / "model.safetensors").unlink()
    error = one_error(torchloom("predict", "--model", str(model), "hello", env=ENV, timeout=120))
    assert "pytorch_model.bin, a pickle" in error and "safetensors only" in error, error


@pytest.mark.soak
@pytest.mark.parametrize("engine", ["spark", "ray"])
def test_a_driver_killed_mid_training_leaves_no_process_on_spark_or_ray(engine, template, tmp_path):
    """Spark's and Ray's tasks are their clusters' to stop: a driver killed with SIGKILL takes its local Spark
    application (its JVM ends with its stdin) and its Ray instance (Ray's processes share the driver's fate)."""
    run = tmp_path / "run"
    shutil.copytree(template, run, copy_function=shutil.copy2)
    token = uuid.uuid4().hex
    argv = ["train", "--output.dir", str(run), "--engine.name", engine, "--train.epochs", "40", "--overwrite",
            "--tracking.enabled", "false"]
    proc = subprocess.Popen([sys.executable, "-m", "torchloom", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, **ENV, "TORCHLOOM_ORACLE": token})
    seen = []
    for line in proc.stdout:  # kill once the ranks are training
        seen.append(line)
        if " step " in line or len(seen) > 400:
            break
    assert proc.poll() is None, "".join(seen[-20:])
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    infrastructure = (b"DashboardAgent", b"RuntimeEnvAgent", b"raylet", b"gcs_server", b"dashboard", b"log_monitor",
                      b"monitor.py")

    def training() -> list[str]:  # what could still write into the run: anything but Ray's own daemons
        return [p for p in alive_with(token) if not any(name.decode() in p for name in infrastructure)]

    deadline = time.monotonic() + 10
    while training() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not training(), training()
    deadline = time.monotonic() + 60  # Ray's daemons notice their driver's end on their own clock
    while alive_with(token) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not alive_with(token), alive_with(token)
