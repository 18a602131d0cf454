"""Nothing lost by design: --overwrite deletes only what torchloom wrote (the run's ledger, runs/ledger.py), all of
it or nothing, and never an input of the command; locally and on a real S3 server (moto's, on 127.0.0.1)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.owned import BUCKET, CREDENTIALS, FOREIGN, one_error, real_config, real_manifest, torchloom

# Names a user keeps under the names a run uses (and some of a run's own, changed by the user).
USER_FILES = ["data/reviews.csv", "data/train/mine.parquet", "model/config.json", "model/tokenizer.json",
              "checkpoints/epoch=0.ckpt", "checkpoints/step-9/meta.json", "logs/app.log", "plots/figure.png",
              "notes.md", "report.md", "metrics.jsonl", "baseline/terms.json", "input/path/data.csv", "trials/x",
              "config.toml", "torchloom-run.json", "data/manifest.json"]


def earlier_run(write) -> dict[str, bytes]:
    """What a torchloom command leaves in a run (names and markers of a real one): written through `write`."""
    from torchloom.runs.runrecord import new_record

    meta = b'{"files": {"model.safetensors": {"size": 6}}, "step": 2}'
    files = {"config.toml": real_config(), "torchloom-run.json": str(new_record()).encode(),
             "data/manifest.json": real_manifest(), "data/train/part-0.parquet": b"PAR1..",
             "data/rejected/part-00000.parquet": b"PAR1", "checkpoints/step-2/model.safetensors": b"weight",
             "checkpoints/step-2/meta.json": meta, "metrics.jsonl": b'{"step": 1}\n', "model/config.json": b"{}",
             "report.md": b"# report\n", "logs/rank-0.log": b"hello\n", "plots/loss.png": b"\x89PNG"}
    for rel, content in files.items():
        write(rel, content)
    return files


class Local:
    def __init__(self, root: Path):
        self.root = root

    def tree(self):
        from torchloom.runs.ledger import LocalTree

        return LocalTree(self.root)

    def write(self, rel: str, content: bytes) -> None:
        (self.root / rel).parent.mkdir(parents=True, exist_ok=True)
        (self.root / rel).write_bytes(content)

    def snapshot(self) -> dict[str, bytes]:
        return {p.relative_to(self.root).as_posix(): p.read_bytes() for p in self.root.rglob("*") if p.is_file()}

    def locate(self, rel: str) -> str:
        return str(self.root / rel)

    def replace(self, inputs: list[str]) -> None:
        from torchloom.runs.runfiles import RunFiles

        RunFiles(self.root).place.replace(inputs=inputs)


class Store(Local):
    def __init__(self, prefix: str):
        self.root = prefix

    def tree(self):
        from torchloom.runs.store_tree import StoreTree

        return StoreTree(self.root)

    def write(self, rel: str, content: bytes) -> None:
        from torchloom.store import storage

        storage.write_bytes(storage.join(self.root, rel), content)

    def snapshot(self) -> dict[str, bytes]:
        from torchloom.store import storage

        return {rel: storage.read_bytes(storage.join(self.root, rel)) for rel in storage.list_files(self.root)}

    def locate(self, rel: str) -> str:
        return f"{self.root}/{rel}"


def scenario(seed: int, place: Local) -> tuple[dict[str, bytes], list[str], bool]:
    """A random tree at `place`: torchloom's earlier output (with a ledger, from before ledgers, or none), users'
    files under a run's names, and inputs inside it. Returns (the user's files, the inputs, whether every file is
    torchloom's as it left it and no input is among them: then --overwrite must delete them all)."""
    from torchloom.runs.ledger import LEDGER_FILE
    from torchloom.runs.recording import recording

    rng = random.Random(seed)
    base = rng.choice(["ledger", "ledger", "legacy", "none"])
    ours: dict[str, bytes] = {}
    if base == "ledger":
        with recording(place.tree()):  # as a command writes it
            ours = earlier_run(place.write)
    elif base == "legacy":
        ours = earlier_run(place.write)
    users: dict[str, bytes] = {}
    for rel in rng.sample(USER_FILES, rng.choice([0, 0, 1, 2, 3])):
        content = f"the user's {rel} #{seed} ".encode() * rng.randint(2, 5)  # longer than torchloom's: a new size
        if rel == "config.toml" and rng.random() < 0.5:
            content = FOREIGN["hugo"]["config.toml"].encode() + b"# " + content
        place.write(rel, content)
        users[rel] = content
        ours.pop(rel, None)
    inputs = []
    if users and rng.random() < 0.4:
        inputs.append(place.locate(rng.choice(sorted(users))))
    if ours and rng.random() < 0.3:  # a run's own file given as an input (model.path runs/x/model)
        inputs.append(place.locate(rng.choice(["model", "data/train", "checkpoints/step-2"])))
    clean = base == "ledger" and not users and not any(
        place.locate(rel).startswith(i) for i in inputs for rel in ours)
    assert LEDGER_FILE not in users
    return users, inputs, clean


def check_oracle(place: Local, users: dict[str, bytes], inputs: list[str], clean: bool) -> str:
    from torchloom.errors import UserError
    from torchloom.runs.ledger import LEDGER_FILE

    before = place.snapshot()
    try:
        place.replace(inputs)
        outcome = "replaced"
    except UserError as e:
        outcome = "refused"
        assert "nothing deleted" in str(e) or "neither empty nor a torchloom run" in str(e), e
    after = place.snapshot()
    for rel, content in users.items():  # every file torchloom did not write, byte for byte
        assert after.get(rel) == content, (rel, outcome)
    for rel, content in before.items():  # every input, and everything under it
        if any(place.locate(rel) == i or place.locate(rel).startswith(i + "/") for i in inputs):
            assert after.get(rel) == content, (rel, outcome)
    if outcome == "refused":
        assert after == before  # all or nothing
    if clean:  # a tree of torchloom's own files only: replaced whole
        assert outcome == "replaced" and set(after) <= {LEDGER_FILE}, after
    return outcome


def test_the_deletion_oracle_on_random_local_trees(tmp_path):
    seen = set()
    for seed in range(48):
        root = tmp_path / f"t{seed}"
        root.mkdir()
        place = Local(root)
        users, inputs, clean = scenario(seed, place)
        if not place.snapshot():
            continue
        seen.add((check_oracle(place, users, inputs, clean), clean))
    assert {("replaced", True), ("refused", False)} <= seen  # both sides were tried


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    pytest.importorskip("moto")
    from support.s3 import s3_server

    with s3_server(tmp_path_factory.mktemp("moto"), BUCKET, CREDENTIALS) as port:
        yield port


def test_the_deletion_oracle_on_random_store_prefixes(s3, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHLOOM_CACHE", str(tmp_path / "cache"))
    seen = set()
    for seed in range(100, 116):
        place = Store(f"s3://{BUCKET}/oracle/t{seed}")
        users, inputs, clean = scenario(seed, place)
        if not place.snapshot():
            continue
        seen.add((check_oracle(place, users, inputs, clean), clean))
    assert {("replaced", True), ("refused", False)} <= seen


KILLED = """
import os, signal, sys, time
from pathlib import Path
from torchloom.runs.ledger import LocalTree
from torchloom.runs.recording import recording
run = Path(sys.argv[1])
with recording(LocalTree(run)):
    (run / "checkpoints" / "step-4").mkdir(parents=True)
    (run / "checkpoints" / "step-4" / "model.safetensors").write_bytes(b"half-written")
    (run / "config.toml").write_bytes(Path(sys.argv[2]).read_bytes())
    (run / "mine").mkdir()
    (run / "mine" / "during.txt").write_text("the user's, while it ran")
    time.sleep(0.6)  # a beat or two
    os.kill(os.getpid(), signal.SIGKILL)
"""


def killed_command(run: Path, tmp_path: Path) -> None:
    """A command that records into `run`, writes, and is SIGKILLed (no end): a real process, really killed."""
    config = tmp_path / "config.toml"
    config.write_bytes(real_config())
    proc = subprocess.run([sys.executable, "-c", KILLED, str(run), str(config)],
                          env={**os.environ, "TORCHLOOM_LEDGER_BEAT_S": "0.2"}, timeout=120)
    assert proc.returncode == -9


def test_a_killed_command_vouches_only_for_what_its_record_covers(tmp_path):
    """What it wrote before its last beat is torchloom's (replaced whole); a file under no run name never is; a file
    that came after its last record stays, named in one line, and nothing is deleted."""
    from torchloom.errors import UserError
    from torchloom.runs.ledger import LocalTree, replace

    run = tmp_path / "run"
    killed_command(run, tmp_path)
    # judged by the beat the killed command kept (0.2 s, its entry says: 2 of them and 1 s of slack), not by this
    # process's own (2 s, which would take the file below for the command's)
    assert json.loads((run / "torchloom-ledger.json").read_text())["open"][0]["beat_s"] == 0.2
    time.sleep(1.5)
    (run / "model").mkdir()
    (run / "model" / "NOTES.md").write_text("the user's, after the kill")  # under a run's name, but later
    with pytest.raises(UserError, match=r"1 file\(s\) written after the last record of a command killed at about"
                                        r" .* are not torchloom's by record: left in place \(model/NOTES.md\)"):
        replace(LocalTree(run), "output.dir")
    (run / "model" / "NOTES.md").unlink()
    (run / "model").rmdir()
    with pytest.raises(UserError, match="it holds mine/during.txt, which torchloom did not write"):
        replace(LocalTree(run), "output.dir")
    (run / "mine" / "during.txt").unlink()
    assert replace(LocalTree(run), "output.dir") == ["checkpoints/step-4/model.safetensors", "config.toml"]
    assert sorted(p.name for p in run.iterdir()) == ["mine", "torchloom-ledger.json"]  # the killed entry settled
    assert json.loads((run / "torchloom-ledger.json").read_text())["open"] == []


def test_another_host_s_entry_expires_with_its_beat(tmp_path):
    """A command of another host (a shared file system) vouches for files while its beat is fresh, and for nothing
    that came after its beat stopped (a lost host): a user's file added later is the user's for ever."""
    from torchloom.errors import UserError
    from torchloom.runs.ledger import BEAT_S, Ledger, LocalTree, Open, beat_name, expire_s, replace

    run = tmp_path / "run"
    run.mkdir()
    (run / "report.md").write_text("written by the other host's command")
    other = Open(4242, "another-host", {}, ("*",), 1)
    (run / "torchloom-ledger.json").write_bytes(Ledger({}, [other]).dumps())
    beat = run / beat_name(4242, "another-host")
    beat.write_bytes(b"")
    assert not Open(4242, "another-host", {}).alive({}, False)  # no beat: not running
    stale = time.time() - expire_s(BEAT_S) - 60
    os.utime(beat, (stale, stale))
    (run / "report.md").write_text("the user's, long after that host was lost")
    with pytest.raises(UserError, match="report.md"):
        replace(LocalTree(run), "output.dir")
    assert (run / "report.md").read_text() == "the user's, long after that host was lost"
    os.utime(beat)  # while it beats, the other host's command is running, and what it writes is its
    assert replace(LocalTree(run), "output.dir") == ["report.md"]


def test_a_refused_command_leaves_no_ledger_behind(tmp_path, tiny_model_dir):
    """A user's directory that torchloom refuses gets nothing written into it; a new directory that a failing
    command made is removed again."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.md").write_text("mine")
    one_error(torchloom("prepare", "--data.path", str(tmp_path / "none.csv"), "--model.path", tiny_model_dir,
                        "--output.dir", str(mine)))
    assert sorted(p.name for p in mine.iterdir()) == ["notes.md"]
    one_error(torchloom("prepare", "--data.path", str(tmp_path / "none.csv"), "--model.path", tiny_model_dir,
                        "--output.dir", str(tmp_path / "new" / "run")))
    assert not (tmp_path / "new").exists()


# -- the audit's three probes, as a user meets them --------------------------------------------------------------

def test_run_overwrite_never_deletes_an_input_kept_in_the_output_dir(tmp_path, topics_csv, tiny_model_dir):
    """A project folder with `torchloom config`'s config.toml, the data in data/ and a base model in model/."""
    import shutil

    project = tmp_path / "proj2"
    (project / "data").mkdir(parents=True)
    (project / "config.toml").write_bytes(real_config())
    shutil.copy(topics_csv, project / "data" / "reviews.csv")
    shutil.copytree(tiny_model_dir, project / "model")
    before = Local(project).snapshot()
    error = one_error(torchloom("run", "--output.dir", str(project), "--overwrite", "--data.path",
                                str(project / "data" / "reviews.csv"), "--model.path", str(project / "model"),
                                "--tracking.enabled", "false"))
    assert "/proj2: not replaced, nothing deleted: it holds data/reviews.csv (an input)" in error, error
    assert Local(project).snapshot() == before


def test_run_overwrite_on_a_store_never_deletes_an_input_kept_in_the_run(s3, tmp_path, topics_csv, tiny_model_dir):
    prefix = f"s3://{BUCKET}/proj2"
    place = Store(prefix)
    place.write("config.toml", real_config())
    place.write("data/reviews.csv", Path(topics_csv).read_bytes())
    before = place.snapshot()
    error = one_error(torchloom("run", "--output.dir", prefix, "--overwrite", "--data.path",
                                f"{prefix}/data/reviews.csv", "--model.path", tiny_model_dir,
                                "--tracking.enabled", "false", TORCHLOOM_CACHE=str(tmp_path / "cache")))
    assert "not replaced, nothing deleted: it holds data/reviews.csv (an input)" in error, error
    assert place.snapshot() == before


def test_prepare_overwrite_on_a_store_checks_before_it_deletes_or_writes(s3, tmp_path, topics_csv, tiny_model_dir):
    """A static site's prefix (its own config.toml, data/authors.yaml): refused before anything is touched."""
    prefix = f"s3://{BUCKET}/site"
    place = Store(prefix)
    for rel, content in {**FOREIGN["hugo"], "data/authors.yaml": "- name: me\n"}.items():
        place.write(rel, content.encode())
    before = place.snapshot()
    error = one_error(torchloom("prepare", "--output.dir", prefix, "--overwrite", "--data.path", str(topics_csv),
                                "--model.path", tiny_model_dir, "--tracking.enabled", "false",
                                TORCHLOOM_CACHE=str(tmp_path / "cache")))
    assert "holds a config.toml that torchloom did not write" in error, error
    assert place.snapshot() == before
    # prepared data on the store (a run not trained yet) whose data/ holds an object of someone else's: refused
    # before the work
    from torchloom.runs.recording import recording

    run = Store(f"s3://{BUCKET}/run-with-foreign-data")
    with recording(run.tree()):
        earlier_run(lambda rel, content: None if rel.startswith("checkpoints/") else run.write(rel, content))
    run.write("data/authors.yaml", b"- name: me\n")
    before = run.snapshot()
    error = one_error(torchloom("prepare", "--output.dir", run.root, "--overwrite", "--data.path", str(topics_csv),
                                "--model.path", tiny_model_dir, "--tracking.enabled", "false",
                                TORCHLOOM_CACHE=str(tmp_path / "cache2")))
    assert "/data: not replaced, nothing deleted: it holds data/authors.yaml, which torchloom did not" in error, error
    assert run.snapshot() == before


def test_predict_overwrite_replaces_only_earlier_predictions(tmp_path):
    """A directory of Parquet files is not predictions; the input's own directory never is; a store's output is
    not overwritten blind."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from torchloom.batch.files import _check_paths
    from torchloom.errors import UserError
    from torchloom.runs.outputs import record_output

    shared = tmp_path / "exports"
    shared.mkdir()
    pq.write_table(pa.table({"text": ["a"]}), shared / "new.parquet")
    pq.write_table(pa.table({"id": [1]}), shared / "customers.parquet")
    with pytest.raises(UserError, match=r"--output .*exports: holds the input .*new.parquet"):
        _check_paths(str(shared / "new.parquet"), str(shared), overwrite=True, local_only=False)
    elsewhere = tmp_path / "in.parquet"
    pq.write_table(pa.table({"text": ["a"]}), elsewhere)
    with pytest.raises(UserError, match=r"not replaced, nothing deleted: it holds customers.parquet, new.parquet"):
        _check_paths(str(elsewhere), str(shared), overwrite=True, local_only=False)
    with pytest.raises(UserError, match=r"not replaced, nothing deleted: it holds customers.parquet"):
        _check_paths(str(elsewhere), f"file://{shared}", overwrite=True, local_only=False)
    for uri in ("s3a://bucket/predictions", "hdfs://nn:8020/predictions"):
        with pytest.raises(UserError, match=r"--overwrite is only for a local --output"):
            _check_paths(str(elsewhere), uri, overwrite=True, local_only=False)
    assert sorted(p.name for p in shared.iterdir()) == ["customers.parquet", "new.parquet"]
    # a single predictions file: replaced while it is as predict left it, not once someone changed it
    single = tmp_path / "out.parquet"
    pq.write_table(pa.table({"label": ["a"]}), single)
    record_output(single)
    _check_paths(str(elsewhere), str(single), overwrite=True, local_only=True)
    pq.write_table(pa.table({"label": ["a", "b"]}), single)
    with pytest.raises(UserError, match=r"it holds out.parquet, which torchloom did not write as predictions"):
        _check_paths(str(elsewhere), str(single), overwrite=True, local_only=True)


def test_the_ledger_is_not_taken_for_content(tmp_path):
    """A run holding only its ledger is empty to every check ('exists and is not empty', a tune study's)."""
    from torchloom.runs.ledger import LocalTree, is_empty
    from torchloom.runs.recording import begin, end
    from torchloom.runs.runfiles import RunFiles

    run = tmp_path / "run"
    stock = begin(LocalTree(run))
    assert is_empty(LocalTree(run)) and not RunFiles(run).place.holds_anything()
    end(LocalTree(run), stock)
    assert not run.exists()  # begun in a new directory, nothing written: nothing left
    os.makedirs(run)
    assert is_empty(LocalTree(run))
