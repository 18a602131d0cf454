"""--overwrite deletes only what is torchloom's: a run, prepared data or a study nobody is running."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.owned import BUCKET, CREDENTIALS, ENV, FOREIGN, one_error, real_config, real_manifest, torchloom


def test_overwrite_refuses_a_directory_that_is_not_a_run(tmp_path, topics_csv, tiny_model_dir):
    mine = tmp_path / "thesis"
    mine.mkdir()
    (mine / "chapter1.tex").write_text("years of work")
    error = one_error(torchloom("run", "--data.path", str(topics_csv), "--model.path", tiny_model_dir,
                                "--output.dir", str(mine), "--overwrite"))
    assert f"output.dir {mine}: not replaced" in error and "neither empty nor a torchloom run" in error
    assert (mine / "chapter1.tex").read_text() == "years of work"


def test_overwrite_refuses_the_working_directory(tmp_path, topics_csv, tiny_model_dir):
    from torchloom.config import build, save

    run = tmp_path / "run"
    (run / "data").mkdir(parents=True)
    save(build(None, []), run / "config.toml")  # a torchloom run, but the one the user stands in
    error = one_error(torchloom("run", "--data.path", str(topics_csv), "--model.path", tiny_model_dir,
                                "--output.dir", ".", "--overwrite", cwd=run))
    assert "is the working directory" in error
    assert (run / "config.toml").exists()


def test_tune_overwrite_refuses_while_another_process_runs_the_study(tmp_path, topics_csv, tiny_model_dir):
    out = tmp_path / "study"
    args = ["tune", "--data.path", str(topics_csv), "--model.path", tiny_model_dir, "--output.dir", str(out),
            "--prepare.spark_master", "local[1]", "--tune.backend", "optuna", "--engine.workers", "1",
            "--tune.trials", "50", "--train.epochs", "3", "--tracking.enabled", "false"]
    running = subprocess.Popen([sys.executable, "-m", "torchloom", *args], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, env=ENV)
    try:
        deadline = time.monotonic() + 120
        while not (out / "study.json").is_file():
            assert running.poll() is None and time.monotonic() < deadline, "the first tune did not start a study"
            time.sleep(0.2)
        error = one_error(torchloom(*args, "--overwrite"))
        assert "another torchloom tune process is running this study" in error
        assert (out / "study.json").is_file() and running.poll() is None
    finally:
        running.kill()
        running.wait()
    # once it has stopped, --overwrite starts the study afresh
    from torchloom.config import build
    from torchloom.tune.study import open_study_dir

    (out / "trials" / "leftover").parent.mkdir(exist_ok=True)
    (out / "trials" / "leftover").write_text("from the killed study")
    sd, resuming = open_study_dir(build(None, [*args[1:], "--output.overwrite", "true"]), "optuna")
    assert not resuming and not (out / "trials" / "leftover").exists() and sd.marker.is_file()


def test_batch_predict_overwrite_replaces_only_earlier_predictions(tmp_path, monkeypatch):
    from torchloom.batch.files import _check_paths
    from torchloom.errors import UserError

    src = tmp_path / "in.parquet"
    src.write_bytes(b"")
    from torchloom.runs.outputs import record_output

    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / "part-0.parquet").write_bytes(b"")
    (earlier / "_SUCCESS").write_bytes(b"")
    with pytest.raises(UserError, match="not replaced, nothing deleted: it holds _SUCCESS, part-0.parquet, which"
                                        " torchloom did not write as predictions"):
        _check_paths(str(src), str(earlier), overwrite=True, local_only=True)  # Parquet, but not torchloom's
    record_output(earlier)  # as predict leaves them
    _check_paths(str(src), str(earlier), overwrite=True, local_only=True)  # earlier predictions: replaced
    (earlier / "notes.md").write_text("mine")
    with pytest.raises(UserError, match="not replaced, nothing deleted: it holds notes.md"):
        _check_paths(str(src), str(earlier), overwrite=True, local_only=True)
    monkeypatch.chdir(earlier)
    with pytest.raises(UserError, match="is the working directory"):
        _check_paths(str(src), ".", overwrite=True, local_only=True)


def test_a_report_is_deleted_only_as_torchloom_left_it_checked_again_right_before(tmp_path):
    """outputs.clear_output (monitor's and predict --model A --model B's reports): an earlier report of torchloom's is
    deleted; one changed since the command's first check (a file added while it scored) is refused, kept whole;
    one holding an input too."""
    from torchloom.errors import UserError
    from torchloom.runs.outputs import check_output, clear_output, record_output

    report = tmp_path / "report"
    report.mkdir()
    (report / "report.md").write_text("# earlier")
    record_output(report)
    check_output(report, [], "--report")  # the command's first check passes...
    (report / "notes.md").write_text("written while the command scored")  # ...then someone adds a file
    with pytest.raises(UserError, match=r"--report .*report: not replaced, nothing deleted: it holds notes.md"):
        clear_output(report, [], "--report")
    assert sorted(p.name for p in report.iterdir()) == ["_torchloom-ledger.json", "notes.md", "report.md"]
    (report / "notes.md").unlink()
    with pytest.raises(UserError, match=r"holds the input .*report.md"):
        clear_output(report, [str(report / "report.md")], "--report")
    clear_output(report, [str(tmp_path / "elsewhere.csv")], "--report")
    assert not report.exists()


# -- what counts as torchloom's: a marker file's content, never its name ---------------------------------------


def make_tree(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def tree(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): p.read_text() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("kind", sorted(FOREIGN))
@pytest.mark.parametrize("command", ["run", "tune"])
def test_overwrite_refuses_a_foreign_project_that_shares_a_name_with_torchloom(tmp_path, topics_csv, tiny_model_dir,
                                                                              kind, command):
    project = tmp_path / kind
    make_tree(project, FOREIGN[kind])
    before = tree(project)
    error = one_error(torchloom(command, "--data.path", str(topics_csv), "--model.path", tiny_model_dir,
                                "--output.dir", str(project), "--tracking.enabled", "false", "--overwrite"))
    assert f"output.dir {project}: not replaced" in error and "neither empty nor a torchloom run" in error
    assert "pass another --output.dir" in error
    assert tree(project) == before


def test_prepare_without_overwrite_never_writes_over_a_foreign_config(tmp_path, topics_csv, tiny_model_dir):
    """No --overwrite and no data/ yet: prepare would write data/ and then config.toml over Hugo's own."""
    project = tmp_path / "hugo"
    make_tree(project, FOREIGN["hugo"])
    before = tree(project)
    error = one_error(torchloom("prepare", "--data.path", str(topics_csv), "--model.path", tiny_model_dir,
                                "--output.dir", str(project), "--tracking.enabled", "false"))
    assert "holds a config.toml that torchloom did not write" in error, error
    assert tree(project) == before


@pytest.mark.parametrize(("rel", "content", "own"), [
    ("config.toml", real_config(), True),
    ("config.toml", FOREIGN["hugo"]["config.toml"].encode(), False),
    ("config.toml", b"", False),  # parses, but none of torchloom's sections
    ("config.toml", b'[data]\npath = "x.csv"\n', False),  # torchloom's keys, but not a config torchloom saved
    ("config.toml", real_config() + b"\n[params]\ntheme = 'x'\n", False),  # a foreign section
    ("config.toml", real_config().replace(b"[train]\n", b"[train]\nfoo = 1\n"), False),  # a foreign key
    ("config.toml", b"\xff\xfe not text", False),
    ("manifest.json", real_manifest(), True),
    ("data/manifest.json", real_manifest(), True),
    ("manifest.json", FOREIGN["webapp"]["manifest.json"].encode(), False),
    ("manifest.json", b"{}", False),
    ("manifest.json", real_manifest().replace(b'"labels"', b'"start_url": "/", "labels"'), False),
    ("manifest.json", b"not json", False),
    ("study.json", b'{"format": "torchloom-study/1", "backend": "optuna"}', True),
    ("study.json", b'{"backend": "ray", "study_name": "s", "created": 1.0, "metric": "macro_f1", "mode": "max",'
                   b' "trials": 4, "best_trial": "t0"}', True),  # written before the format marker
    ("study.json", b'{"backend": "optuna", "study_name": "s"}', False),
    ("study.json", b'{"backend": "optuna", "study_name": "s", "created": 1.0, "metric": "loss", "mode": "min",'
                   b' "author": "me"}', False),
    ("checkpoints", b"", False),  # not a marker at all
])
def test_a_marker_counts_only_by_its_content(rel, content, own):
    from torchloom.runs.runrecord import is_own_file

    assert is_own_file(rel, content) is own


def test_overwrite_replaces_only_what_is_torchloom_s_and_refuses_anything_beside_it(tmp_path):
    """Runs made before ledgers: only content-verified markers (and what they list) count, never a bare name."""
    from torchloom.errors import UserError
    from torchloom.runs.ledger import check_replaceable, replace_local

    dirs = {"run/config.toml": real_config(), "prepared/manifest.json": real_manifest(),
            "study/study.json": b'{"format": "torchloom-study/1", "backend": "optuna"}',
            "lightning/checkpoints/epoch=0.ckpt": b"weights",
            "run/checkpoints/step-2/model.safetensors": b"w" * 10,
            "run/checkpoints/step-2/meta.json": b'{"files": {"model.safetensors": {"size": 10}}}'}
    for rel, content in dirs.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(content)
    (tmp_path / "run" / ".metrics.jsonl.123.tmp").write_text("")  # torchloom's own temporary name
    assert check_replaceable(tmp_path / "run") == [".metrics.jsonl.123.tmp", "checkpoints/step-2/meta.json",
                                                   "checkpoints/step-2/model.safetensors", "config.toml"]
    for name in ("prepared", "study"):
        assert check_replaceable(tmp_path / name)
    with pytest.raises(UserError, match=r"lightning: not replaced: it is neither empty nor a torchloom run"):
        check_replaceable(tmp_path / "lightning")
    # one foreign file beside a marker refuses the whole replacement, and names what it found
    for name in ("run", "prepared", "study"):
        (tmp_path / name / "notes.txt").write_text("mine")
        with pytest.raises(UserError, match=rf"{name}: not replaced, nothing deleted: it holds notes.txt, which"):
            check_replaceable(tmp_path / name)
    # a bare name a run uses proves nothing: metrics.jsonl, or a checkpoint whose meta.json does not list it
    (tmp_path / "run" / "notes.txt").unlink()
    (tmp_path / "run" / "checkpoints" / "step-2" / "model.safetensors").write_bytes(b"w" * 11)
    with pytest.raises(UserError, match=r"it holds checkpoints/step-2/meta.json, checkpoints/step-2/model.safe"):
        replace_local(tmp_path / "run")
    assert (tmp_path / "run" / "config.toml").read_bytes() == real_config()


def test_overwrite_never_deletes_a_project_holding_torchloom_config_s_output(tmp_path, topics_csv, tiny_model_dir):
    """`torchloom config > config.toml` in a project: a torchloom config.toml beside the user's work."""
    project = tmp_path / "project"
    (project / "src").mkdir(parents=True)
    (project / "src" / "train.py").write_text("print('mine')")
    (project / "notes.md").write_text("years of work")
    (project / "config.toml").write_bytes(real_config())
    before = tree(project)
    error = one_error(torchloom("run", "--data.path", str(topics_csv), "--model.path", tiny_model_dir,
                                "--output.dir", str(project), "--tracking.enabled", "false", "--overwrite"))
    assert f"output.dir {project}: not replaced, nothing deleted: it holds notes.md, src/train.py, which" in error
    assert tree(project) == before


def test_overwrite_deletes_nothing_before_every_input_is_checked(tmp_path, tiny_model_dir):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_bytes(real_config())
    (run / "metrics.jsonl").write_text("{}\n")
    error = one_error(torchloom("run", "--data.path", str(tmp_path / "none.csv"), "--model.path", tiny_model_dir,
                                "--output.dir", str(run), "--tracking.enabled", "false", "--overwrite"))
    assert "none.csv" in error and "not replaced" not in error
    assert (run / "metrics.jsonl").read_text() == "{}\n" and (run / "config.toml").read_bytes() == real_config()


# -- the same rule on a store ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    pytest.importorskip("moto")
    from support.s3 import s3_server

    with s3_server(tmp_path_factory.mktemp("moto"), BUCKET, CREDENTIALS) as port:
        yield port


def put_tree(prefix: str, files: dict[str, str | bytes]) -> None:
    from torchloom.store import storage

    for rel, content in files.items():
        storage.write_bytes(storage.join(prefix, rel), content.encode() if isinstance(content, str) else content)


@pytest.mark.parametrize("kind", sorted(FOREIGN))
def test_overwrite_on_a_store_refuses_a_foreign_project(s3, tmp_path, topics_csv, tiny_model_dir, kind):
    from torchloom.store import storage

    prefix = f"s3://{BUCKET}/{kind}"
    put_tree(prefix, FOREIGN[kind])
    before = storage.list_files(prefix)
    error = one_error(torchloom("run", "--data.path", str(topics_csv), "--model.path", tiny_model_dir,
                                "--output.dir", prefix, "--tracking.enabled", "false", "--overwrite",
                                TORCHLOOM_CACHE=str(tmp_path / "cache")))
    assert f"output.dir {prefix}: not replaced" in error and "pass another --output.dir" in error
    assert storage.list_files(prefix) == before
    assert {rel: storage.read_bytes(storage.join(prefix, rel)).decode() for rel in before} == FOREIGN[kind]


@pytest.mark.parametrize("kind", ["hugo", "webapp"])
def test_prepare_on_a_store_never_writes_into_a_foreign_prefix(s3, tmp_path, topics_csv, tiny_model_dir, kind):
    """Decided from the store's objects, never from this host's copy (which has none of them)."""
    from torchloom.store import storage

    prefix = f"s3://{BUCKET}/prepare-{kind}"
    put_tree(prefix, FOREIGN[kind])
    before = storage.list_files(prefix)
    error = one_error(torchloom("prepare", "--data.path", str(topics_csv), "--model.path", tiny_model_dir,
                                "--output.dir", prefix, "--tracking.enabled", "false",
                                TORCHLOOM_CACHE=str(tmp_path / "cache")))
    assert ("holds a config.toml that torchloom did not write" if "config.toml" in FOREIGN[kind]
            else "objects that torchloom did not write") in error, error
    assert storage.list_files(prefix) == before


def test_overwrite_on_a_store_replaces_a_run(s3, tmp_path, monkeypatch):
    from torchloom.errors import UserError
    from torchloom.runs.runfiles import RunFiles
    from torchloom.store import storage

    monkeypatch.setenv("TORCHLOOM_CACHE", str(tmp_path / "cache"))
    prefix = f"s3://{BUCKET}/run"
    put_tree(prefix, {"config.toml": real_config(), "data/manifest.json": real_manifest(),
                      "checkpoints/step-2/w": "ab", "checkpoints/step-2/meta.json": '{"files": {"w": {"size": 2}}}'})
    RunFiles(prefix).place.replace()
    assert storage.list_files(prefix) == {}
    put_tree(prefix, {"data/manifest.json": FOREIGN["webapp"]["manifest.json"], "checkpoints/step-2/x": "w"})
    with pytest.raises(UserError, match=r"not replaced: it is neither empty nor a torchloom run"):
        RunFiles(prefix).place.replace()
    assert len(storage.list_files(prefix)) == 2
    # a run beside a foreign object: refused, naming it
    put_tree(prefix, {"config.toml": real_config(), "report.pdf": "mine"})
    with pytest.raises(UserError, match=r"not replaced, nothing deleted: it holds .*report.pdf, which no marker"):
        RunFiles(prefix).place.replace()
    assert len(storage.list_files(prefix)) == 4


def test_overwrite_never_empties_a_bucket_s_root(s3, tmp_path, topics_csv, tiny_model_dir):
    """A torchloom config.toml at a bucket's root, beside the bucket's other prefixes: nothing is deleted."""
    from pyarrow import fs as pafs

    from torchloom.store import storage

    root = "s3://torchloom-bucket-root"
    pafs.S3FileSystem(endpoint_override=f"http://127.0.0.1:{s3}", scheme="http", allow_bucket_creation=True,
                      region="us-east-1").create_dir(root[5:])
    put_tree(f"{root}/elsewhere", {"keep.txt": "other work"})
    storage.write_bytes(f"{root}/config.toml", real_config())
    before = storage.list_files(root)
    error = one_error(torchloom("run", "--data.path", str(topics_csv), "--model.path", tiny_model_dir,
                                "--output.dir", root, "--tracking.enabled", "false", "--overwrite",
                                TORCHLOOM_CACHE=str(tmp_path / "cache")))
    assert f"output.dir {root}: not replaced: it is a bucket's root" in error, error
    assert storage.list_files(root) == before


def test_the_manifest_keys_rundir_knows_are_the_manifests_fields():
    import dataclasses

    from torchloom.manifest import Manifest
    from torchloom.runs.runrecord import MANIFEST_KEYS

    assert {f.name for f in dataclasses.fields(Manifest)} - {"root"} == MANIFEST_KEYS
