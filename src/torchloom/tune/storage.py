"""The Optuna study's database: the study's own SQLite file, or a server every `torchloom tune` process of a study
shares (PostgreSQL, MySQL), on one machine or many.

- `postgresql://` without a driver means psycopg (3), pyproject's `postgres` extra, where psycopg2 is not
  installed (SQLAlchemy's own default is psycopg2); a missing driver is one line naming the extra.
- Credentials come from the URL, or where the driver finds them without one: PGPASSWORD, PGPASSFILE or
  ~/.pgpass for PostgreSQL. No line torchloom writes shows a password.
- A server that stops answering mid-study (a restart, a failover) is waited for: every call of the storage is
  retried for up to OUTAGE_S with one warning line, so no trial is lost or recorded twice; a wrong password or
  an unknown database is one line at once, before any trial starts.
- Heartbeats (tune.heartbeat_s): a process that dies mid-trial stops its trial's heartbeat; 4 heartbeats later
  another process of the study marks the trial failed and runs it again with the same parameters (once).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
import time
import warnings

from torchloom.errors import UserError, first_line, install_hint, message_line
from torchloom.redaction import TUNE_STORAGE_ENV, redact_text

OUTAGE_S = 120.0  # how long a study waits for its database server to answer again
HEARTBEAT_S = 30.0  # tune.heartbeat_s's default: Optuna's heartbeat interval; 4 times it silent, a trial is stale
# the backend's private calls Optuna 4's _CachedStorage makes (a new trial among them: missed, a restart while a
# trial is created ended the study; tests/test_postgres.py)
CACHE_CALLS = ("_create_new_trial", "_get_best_trial_id", "_get_stale_trial_ids", "_get_trials", "_set_trial_param")
DRIVERS = {"postgresql": ("psycopg2", "psycopg", "postgres"), "mysql": ("MySQLdb", "pymysql", "")}


def with_driver(url: str) -> str:
    """A `postgresql://` URL with psycopg named as its driver where psycopg2 (SQLAlchemy's default) is missing."""
    scheme, sep, rest = url.partition("://")
    if not sep or "+" in scheme or scheme not in DRIVERS:
        return url
    default, ours, _ = DRIVERS[scheme]
    import importlib.util

    if importlib.util.find_spec(default) is None and importlib.util.find_spec(ours) is not None:
        return f"{scheme}+{ours}://{rest}"
    return url


def resolved(url: str) -> str:
    """The URL a worker was given as `env:NAME` (a URL with a password travels in the environment), with its driver."""
    if url.startswith("env:"):
        url = os.environ.get(url[len("env:"):], "")
        if not url:
            raise UserError(f"tune.storage: the worker has no ${TUNE_STORAGE_ENV}; the engine did not forward the"
                            " driver's environment; set it on the workers or use a storage URL without a password")
    return with_driver(url)


def make_storage(url: str, heartbeat_s: float = HEARTBEAT_S):
    """Optuna's RDBStorage of `url` with heartbeats every `heartbeat_s` (a trial silent for 4 times that is stale),
    its calls retried through a database outage (not SQLite's)."""
    import optuna

    url = resolved(url)
    with warnings.catch_warnings():  # Optuna 4.9 calls the retry callback deprecated and its heartbeat experimental
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        heartbeat = {"heartbeat_interval": max(1, round(heartbeat_s)), "grace_period": max(4, round(4 * heartbeat_s)),
                     "failed_trial_callback": optuna.storages.RetryFailedTrialCallback(max_retry=1)}
        if url.startswith("sqlite"):
            # Several processes share the file: wait for the lock rather than fail on "database is locked".
            return optuna.storages.RDBStorage(url, engine_kwargs={"connect_args": {"timeout": 120}}, **heartbeat)
        # pool_pre_ping: a connection the server dropped (a restart) is replaced, not handed out to fail
        outage = Outage(url)
        storage = outage.call(optuna.storages.RDBStorage, url, engine_kwargs={"pool_pre_ping": True}, **heartbeat)
    return through_outages(storage, outage)


def is_outage(e: BaseException) -> bool:
    """A server that does not answer now (refused, reset, shutting down), not one that says no (a wrong
    password, an unknown database: those do not get better by waiting)."""
    import sqlalchemy.exc
    from optuna.exceptions import StorageInternalError

    cause: BaseException | None = e
    while isinstance(cause, StorageInternalError) and (cause.__cause__ or cause.__context__):
        cause = cause.__cause__ or cause.__context__
    if not isinstance(cause, sqlalchemy.exc.OperationalError | sqlalchemy.exc.InterfaceError):
        return False
    return not refusal(cause)


def broken_session(e: BaseException) -> bool:
    """A session that a server restart left in a failed transaction (SQLAlchemy's PendingRollbackError): the server
    answers; the session must be dropped before the call is made again (nothing was sent with it)."""
    import sqlalchemy.exc

    for _ in range(20):  # the chain of causes, bounded
        if e is None or isinstance(e, sqlalchemy.exc.PendingRollbackError):
            break
        e = e.__cause__ or e.__context__
    return isinstance(e, sqlalchemy.exc.PendingRollbackError)


def refusal(e: BaseException) -> str | None:
    """What the server said no to (the credentials, the database), or None."""
    text = str(e).lower()
    if "password authentication failed" in text or "access denied" in text or "no password supplied" in text:
        return "the server refused the credentials (a wrong user or password)"
    if "does not exist" in text and "database" in text or "unknown database" in text:
        return "the database does not exist on the server (create it first: createdb NAME)"
    return None


class Outage:
    """Calls to a database server retried while it does not answer, for up to OUTAGE_S from the first refusal, with
    one warning line per outage (and one when it answers again); then the error stands."""

    def __init__(self, url: str):
        self.url, self.since = url, None
        self.lock = threading.Lock()
        self.reset = None  # through_outages: the storage's session dropped before a retry (it may hold a broken one)

    def call(self, fn, *args, **kwargs):
        broken = 0
        while True:
            try:
                result = fn(*args, **kwargs)
            except Exception as e:
                if broken_session(e) and self.reset is not None and broken < 3:
                    broken += 1
                    with contextlib.suppress(Exception):
                        self.reset()
                    continue  # the server answers: no outage to wait for or to say
                if not is_outage(e):
                    raise
                with self.lock:
                    if self.since is None:
                        self.since = time.monotonic()
                        said = redact_text(first_line(e.__cause__ or e))[:120]
                        print(f"torchloom: tune: warning: the study database {redact_text(self.url)} does not answer"
                              f" ({said}); waiting up to {OUTAGE_S:.0f} s for it", file=sys.stderr, flush=True)
                    waited = time.monotonic() - self.since
                if waited > OUTAGE_S:
                    raise
                if self.reset is not None:
                    with contextlib.suppress(Exception):
                        self.reset()
                time.sleep(min(5.0, 0.5 + waited / 4))
                continue
            if self.since is not None:
                with self.lock:
                    if self.since is not None:
                        print(f"torchloom: tune: the study database answers again after"
                              f" {time.monotonic() - self.since:.0f} s", file=sys.stderr, flush=True)
                        self.since = None
            return result


def through_outages(storage, outage: Outage):
    """`storage` whose every public call, and each private one Optuna's cache (_CachedStorage) makes on its backend
    directly (CACHE_CALLS), goes through `outage`. Retried calls are those Optuna makes in a transaction of their
    own: one that failed left nothing behind, so a retry records a trial, a value or a state once."""

    def retrying(fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            return outage.call(fn, *args, **kwargs)
        return call

    session = getattr(storage, "scoped_session", None)
    outage.reset = getattr(session, "remove", None)
    for name in dir(type(storage)):
        if ((not name.startswith("_") or name in CACHE_CALLS) and callable(getattr(type(storage), name, None))
                and name != "remove_session"):
            setattr(storage, name, retrying(getattr(storage, name)))
    return storage


def open_error(url: str, e: BaseException) -> UserError:
    """The study database cannot be opened: one line, its URL without the password."""
    shown = redact_text(url)
    if isinstance(e, ImportError):
        cause: BaseException | None = e  # Optuna wraps the driver's ModuleNotFoundError in its own ImportError
        while cause is not None and not getattr(cause, "name", None):
            cause = cause.__cause__ or cause.__context__
        name = getattr(cause, "name", None) or "the database's Python driver"
        extra = next((d[2] for s, d in DRIVERS.items() if url.startswith(s) and d[2]), "")
        how = f"{install_hint(extra)} (torchloom's {extra} extra)" if extra else f"pip install {name}"
        return UserError(f"tune.storage {shown}: its database driver is not installed ({name}); {how}, or leave"
                         " tune.storage empty for the study's own SQLite file")
    said = refusal(e)
    if said:
        return UserError(f"tune.storage {shown}: {said}; fix the URL, PGPASSWORD or ~/.pgpass, or leave tune.storage"
                         " empty for the study's own SQLite file")
    said = message_line(redact_text(getattr(e, "orig", None) or e)).removeprefix("connection failed: ")
    return UserError(f"tune.storage {shown}: cannot open the study database ({said[:140]}); check that it runs and"
                     " the URL, or leave tune.storage empty for a SQLite file")


def check(url: str) -> None:
    """A shared study database answers and takes these credentials, checked once before the study prepares or runs
    anything: a wrong password, an unknown database, a server that is not there or a missing driver is one line."""
    if not url or url.startswith("sqlite"):
        return
    import sqlalchemy

    try:
        engine = sqlalchemy.create_engine(with_driver(url))
    except (ImportError, sqlalchemy.exc.ArgumentError, ValueError) as e:
        raise open_error(url, e) from None
    try:
        with engine.connect():
            pass
    except Exception as e:  # noqa: BLE001 - whatever the server says, one line
        raise open_error(url, e) from None
    finally:
        engine.dispose()
