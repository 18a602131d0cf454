"""A real PostgreSQL server for the tests that share a study or an MLflow store through one: Debian's package
(installed with apt-get when missing), a throwaway cluster made with initdb in a temporary directory, run by the
unprivileged `postgres` user on a free port, stopped and deleted at the end.

    with Postgres(tmp_dir) as pg:            # on 127.0.0.1
        url = pg.url("optuna")               # postgresql://torchloom:<password>@127.0.0.1:<port>/optuna
    with Postgres(tmp_dir, host=ns_host):    # inside a network namespace host, on its address
"""

from __future__ import annotations

import glob
import os
import secrets
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from support.debian import install
from support.net import free_port

USER = "torchloom"


def binaries() -> Path:
    """The directory of PostgreSQL's server programs (initdb, pg_ctl), installing Debian's package when missing."""
    def found() -> list[str]:
        return sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))

    if not found():  # the server, its programs and the `postgres` system user
        install("postgresql", lambda: bool(found()), "PostgreSQL's initdb")
    paths = found()
    assert paths, "Debian's postgresql installed, yet no /usr/lib/postgresql/*/bin/initdb"
    return Path(paths[-1]).parent


class Postgres:
    """A PostgreSQL cluster of its own: user `torchloom` with a random password (md5/scram over TCP), one
    database per name asked for (`url(name)` creates it)."""

    def __init__(self, root: str | Path, host=None):
        self.bin = binaries()
        self.root = Path(root) / f"pg-{secrets.token_hex(3)}"
        self.data = self.root / "data"
        self.host = host  # a cluster.netns Host, or None: 127.0.0.1 of this namespace
        self.address = host.address if host else "127.0.0.1"
        self.port = free_port()
        self.password = "pw-" + secrets.token_hex(8)
        self.log = self.root / "postgres.log"
        self.databases: set[str] = set()

    def _as_postgres(self, argv: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
        argv = ["runuser", "-u", "postgres", "--", *argv] if os.geteuid() == 0 else argv
        if self.host is not None:
            argv = self.host.command(argv)
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)

    def __enter__(self) -> Postgres:
        self.root.mkdir(parents=True)
        secret = self.root / "pwfile"
        secret.write_text(self.password + "\n")
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres", "postgres")
            shutil.chown(secret, "postgres", "postgres")
        self.root.chmod(0o700)
        for parent in Path(self.root).parents:  # the postgres user must be able to walk down to its directory
            if parent.stat().st_mode & 0o001 == 0 and str(parent).startswith(("/tmp", "/var/tmp")):
                parent.chmod(parent.stat().st_mode | 0o001)
        done = self._as_postgres([str(self.bin / "initdb"), "-D", str(self.data), "-U", USER, "-A", "scram-sha-256",
                                  "--pwfile", str(secret), "-E", "UTF8", "--no-sync"], timeout=120)
        secret.unlink()
        if done.returncode:
            pytest.fail(f"initdb failed:\n{done.stdout[-1500:]}\n{done.stderr[-1500:]}")
        with open(self.data / "pg_hba.conf", "a") as hba:  # the hosts of its own subnet (a namespace cluster's) too
            hba.write("host all all samenet scram-sha-256\n")
        self.start()
        return self

    def start(self) -> None:
        options = f"-c listen_addresses={self.address} -p {self.port} -k {self.root} -c fsync=off"
        done = self._as_postgres([str(self.bin / "pg_ctl"), "-D", str(self.data), "-l", str(self.log), "-o", options,
                                  "-w", "-t", "60", "start"], timeout=90)
        if done.returncode:
            log = self.log.read_text(errors="replace")[-2000:] if self.log.is_file() else ""
            pytest.fail(f"postgres did not start:\n{done.stdout[-1000:]}{done.stderr[-1000:]}\n{log}")

    def stop(self, mode: str = "fast") -> None:
        self._as_postgres([str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "-t", "60", "stop"])

    def restart(self, down_s: float = 0.0) -> None:
        """The server stopped (its connections cut), down for `down_s`, started again on the same port."""
        self.stop()
        time.sleep(down_s)
        self.start()

    def __exit__(self, *exc) -> None:
        self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)

    def url(self, database: str = "torchloom", driver: str = "", password: str | None = None) -> str:
        """The URL of `database` (created when first asked for): postgresql://, or postgresql+<driver>://."""
        if database not in self.databases:
            self.sql(f'CREATE DATABASE "{database}"')
            self.databases.add(database)
        scheme = f"postgresql+{driver}" if driver else "postgresql"
        secret = self.password if password is None else password
        return f"{scheme}://{USER}:{secret}@{self.address}:{self.port}/{database}"

    def sql(self, statement: str, database: str = "postgres") -> str:
        import psycopg

        # through the server's Unix socket in its directory: reachable from this namespace wherever it listens
        with psycopg.connect(host=str(self.root), port=self.port, user=USER, password=self.password, dbname=database,
                             autocommit=True) as conn, conn.cursor() as cur:
            cur.execute(statement)
            return str(cur.fetchall()) if cur.description else ""


def optuna_study_args(out: Path, tiny: str, storage: str, trials: int, space: str) -> list[str]:
    """`torchloom tune` arguments for a small Optuna study of the tiny model in `storage` (prepared_study prepares
    its data, so no Spark starts)."""
    (out.parent / "unused.csv").write_text("text,label\n")
    return ["--data.path", str(out.parent / "unused.csv"), "--model.path", tiny, "--output.dir", str(out),
            "--train.precision", "fp32", "--train.batch_size", "8", "--train.epochs", "1", "--engine.workers", "1",
            "--engine.threads_per_worker", "1", "--eval.baseline", "false", "--tracking.enabled", "false",
            "--tune.backend", "optuna", "--tune.trials", str(trials), "--tune.storage", storage,
            "--tune.space", space]
