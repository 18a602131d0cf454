"""The secrets oracle: seeded random passwords of every printable character class, in the URLs of every command
that takes one (the study database, the tracking and registry server, store paths for data, output and models, a
Kubernetes manifest's), then every byte torchloom wrote (the run, the study, the manifests, the cache) and printed
is searched: not one occurrence of a password, raw or as it stood in the URL. Against a real PostgreSQL and a real
S3 server (moto's) on 127.0.0.1; the commands run in this process (cli.main), one real study in its own.
"""

from __future__ import annotations

import contextlib
import io
import os
import random
import string
import subprocess
import sys
from pathlib import Path
from urllib.parse import quote

import pytest
from support.owned import BUCKET, CREDENTIALS
from support.postgres import Postgres, optuna_study_args
from support.runs import prepared_study

pytest.importorskip("optuna")
pytest.importorskip("psycopg")

# What a URL may hold raw in its password: RFC 3986's unreserved and sub-delimiter characters, `:` and `/` (the
# rest is percent-encoded, as a user must for the URL to parse at all: `@`, space, `#`, `?`, `%`, `[`, quotes).
RAW = string.ascii_letters + string.digits + "-._~!$&'()*+,;=:/"
CLASSES = [string.ascii_lowercase, string.ascii_uppercase, string.digits, "/+=", "!$&'()*,;~-._", "\"[]{}|^`<>\\",
           "@ #?%"]
SPACE = '{"train.lr" = "loguniform(1e-4, 1e-2)"}'


def password(rng: random.Random) -> str:
    """12 to 24 characters, with at least one of every class (a base64-made one's `/+=` among them)."""
    chars = [rng.choice(c) for c in CLASSES] + [rng.choice(string.printable[:94]) for _ in range(rng.randint(5, 17))]
    rng.shuffle(chars)
    return "".join(chars)


def in_url(pw: str) -> str:
    return quote(pw, safe=RAW)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    pytest.importorskip("moto")
    from support.s3 import s3_server

    with Postgres(tmp_path_factory.mktemp("pg")) as pg, \
            s3_server(tmp_path_factory.mktemp("moto"), BUCKET, CREDENTIALS) as s3_port:
        pg.url("optuna")
        yield pg, s3_port


def study_args(out: Path, tiny: str, storage: str) -> list[str]:
    return optuna_study_args(out, tiny, storage, 1, SPACE)


def commands(pw: str, pg, here: Path, tiny: str, topics_csv) -> list[list[str]]:
    """Every command that takes a URL, with this password in it (each fails within seconds: a wrong password, a
    missing object, a closed port, or a refusal)."""
    url = in_url(pw)
    db = f"postgresql://torchloom:{url}@127.0.0.1:{pg.port}/optuna"
    closed = f"http://user:{url}@127.0.0.1:9"
    store = f"s3://AKIAEXAMPLE:{url}@{BUCKET}"
    study = here / "study"
    args = study_args(study, tiny, db)
    prepared_study(study, args)
    return [
        ["tune", *args],  # the study's database: the server refuses the password
        ["predict", "--model", f"{store}/missing/model", "some text"],
        ["prepare", "--data.path", f"{store}/missing.csv", "--model.path", tiny, "--output.dir", str(here / "r1"),
         "--tracking.enabled", "false"],
        ["prepare", "--data.path", str(topics_csv), "--model.path", tiny, "--output.dir", f"{store}/runs/x",
         "--tracking.uri", closed, "--tracking.enabled", "false", "--prepare.spark_master", "sc://127.0.0.1:9"],
        ["serve", "models:/reviews@champion", "--tracking-uri", closed],
        ["k8s", "train", "--image", "registry.example/torchloom:1", "--output.dir", f"{store}/runs/k",
         "--model.path", f"{store}/models/base", "--out", str(here / "k8s")],
        ["export", "--output.dir", str(here / "r1"), "--register", "reviews", "--tracking.uri", closed],
    ]


def everything_written(*roots: Path) -> bytes:
    out = []
    for root in roots:
        for p in Path(root).rglob("*") if Path(root).is_dir() else []:
            if p.is_file() and not p.is_symlink():
                with contextlib.suppress(OSError):
                    out.append(p.read_bytes())
    return b"\n".join(out)


def on_store() -> bytes:
    from torchloom.store import storage

    return b"\n".join(storage.read_bytes(storage.join(f"s3://{BUCKET}", rel))
                      for rel in storage.list_files(f"s3://{BUCKET}"))


def leaks(pw: str, text: bytes) -> list[str]:
    forms = {pw, in_url(pw), quote(pw, safe="")}
    return [f for f in forms if f.encode() in text]


def test_no_password_is_written_or_printed_by_any_command(servers, tmp_path, tiny_model_dir, topics_csv, monkeypatch):
    """50 passwords, each through one command of the list in turn (every command sees seven or more)."""
    from torchloom import cli

    pg, _ = servers
    monkeypatch.setenv("TORCHLOOM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("TORCHLOOM_STORE_RETRY_S", "0")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    rng = random.Random(72)
    found, seen = {}, []
    for i in range(50):
        pw = password(rng)
        seen.append(pw)
        here = tmp_path / f"p{i}"
        here.mkdir()
        argv = commands(pw, pg, here, tiny_model_dir, topics_csv)[i % 7]
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = cli.main(argv)
            except SystemExit as e:  # argparse's own refusals
                code = e.code
        printed = (out.getvalue() + err.getvalue()).encode()
        assert code != 0, (argv[0], printed[-2000:])
        hits = leaks(pw, printed + everything_written(here, tmp_path / "cache"))
        if hits:
            found[i] = (argv[0], hits, printed[-600:])
    assert not found, found
    whole = everything_written(tmp_path) + on_store()  # every file of every command, and the store's objects
    assert not [pw for pw in seen if leaks(pw, whole)]


def test_a_study_with_a_slash_in_its_password_writes_it_nowhere(servers, tmp_path, tiny_model_dir):
    """The audit's probe as a user types it: a base64-made password (`/`, `+`, `=`) in tune.storage, a real study
    of one trial: the study's config.toml, best_config.toml, every trial's files and every line, without it."""
    pg, _ = servers
    pw = "Zq3/xK9+mW2=" + random.Random(7).choice(["a", "b"])
    pg.sql(f"CREATE ROLE alice LOGIN PASSWORD '{pw}'")
    pg.sql("GRANT ALL ON DATABASE optuna TO alice")
    pg.sql("GRANT ALL ON SCHEMA public TO alice", database="optuna")
    study = tmp_path / "study"
    args = study_args(study, tiny_model_dir, f"postgresql://alice:{pw}@127.0.0.1:{pg.port}/optuna")
    prepared_study(study, args)
    done = subprocess.run([sys.executable, "-m", "torchloom", "tune", *args], capture_output=True, text=True,
                          timeout=600, cwd=tmp_path, env={**os.environ, "HF_HUB_OFFLINE": "1",
                                                          "TORCHLOOM_CACHE": str(tmp_path / "cache")})
    assert done.returncode == 0, done.stderr[-4000:]
    for written in (study / "best_config.toml", study / "trials" / "trial-000" / "config.toml"):
        assert f"postgresql://***@127.0.0.1:{pg.port}/optuna" in written.read_text(), written
    assert not leaks(pw, (done.stdout + done.stderr).encode() + everything_written(tmp_path))
