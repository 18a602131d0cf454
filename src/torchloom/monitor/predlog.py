"""The durable prediction and feedback log (issue 76): every answer a server gives (and each shadow's), every
feedback label, and the loop's events, in a store that outlives the process.

    sqlite:///path/log.db       embedded, zero setup (the default: serve --log); one machine's servers share it
    postgresql://user@host/db   shared by every replica, pod and Ray replica: feedback and the verdict are the
                                fleet's, not a process's (psycopg 3, torchloom's postgres extra)

A prediction row holds its id, time, the fleet and model (name and version), its role (answer or shadow), the
label answered, its top probability, and a hash of the text (blake2b); the text itself only where the server
was started with --keep-texts (retraining on feedback needs it). Rows are written off the request path: the
server appends them to a queue and one writer thread inserts them in batches; past MAX_QUEUED waiting rows new
ones are dropped and counted (serving never waits on the store). Predictions and feedback older than
max_age_s, and predictions past max_rows of a fleet, are deleted by the same thread every PRUNE_EVERY_S.

Feedback rows are numbered (seq) in the order the store took them: a loop's watermark is a seq, and a snapshot
up to a watermark reads the same rows however many replicas wrote them. Events (tl_events) are append-only:
the loop's audit trail. Leases (tl_leases): one holder of a role of the fleet at a time (its loop, loop/lease.py).
Standard library and psycopg only; no torchloom import above errors and uri.
"""

from __future__ import annotations

import hashlib
import json
import logging
import queue
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchloom.errors import UserError

log = logging.getLogger("torchloom.serve")
MAX_QUEUED = 200_000  # rows waiting for the writer; more are dropped (counted) rather than held in memory
WRITE_EVERY_S = 0.2  # the writer inserts what came within this in one transaction
PRUNE_EVERY_S = 60.0
MAX_AGE_S = 30 * 86400.0  # predictions and feedback kept 30 days
MAX_ROWS = 10_000_000  # predictions of a fleet kept

_TABLES = """
CREATE TABLE IF NOT EXISTS tl_predictions (
  id TEXT NOT NULL, model TEXT NOT NULL, fleet TEXT NOT NULL, version TEXT NOT NULL, role TEXT NOT NULL,
  at DOUBLE PRECISION NOT NULL, answer TEXT NOT NULL, confidence DOUBLE PRECISION, text_hash TEXT NOT NULL,
  text TEXT, PRIMARY KEY (id, model));
CREATE INDEX IF NOT EXISTS tl_predictions_at ON tl_predictions (fleet, at);
CREATE TABLE IF NOT EXISTS tl_feedback (
  seq @SERIAL@, id TEXT NOT NULL, fleet TEXT NOT NULL, label TEXT NOT NULL, at DOUBLE PRECISION NOT NULL,
  text TEXT, text_hash TEXT, source TEXT NOT NULL, UNIQUE (fleet, id));
CREATE TABLE IF NOT EXISTS tl_events (
  seq @SERIAL@, fleet TEXT NOT NULL, at DOUBLE PRECISION NOT NULL, kind TEXT NOT NULL, who TEXT NOT NULL,
  detail TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS tl_leases (
  fleet TEXT NOT NULL, name TEXT NOT NULL, holder TEXT NOT NULL, until DOUBLE PRECISION NOT NULL,
  PRIMARY KEY (fleet, name));
"""


def text_hash(text: str) -> str:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=12).hexdigest()


@dataclass
class Labelled:
    """One feedback label as the store holds it, with every model's answer to its text (empty for a label sent
    with its text rather than a prediction's id)."""

    seq: int
    id: str
    label: str
    at: float
    text: str | None
    answers: dict[str, tuple[str, str, str]]  # model -> (version, role, answer)


class PredictionLog:
    """One fleet's rows in one store (module docstring). `where` is the store, credentials masked."""

    def __init__(self, uri: str, fleet: str, keep_texts: bool = False, max_age_s: float = MAX_AGE_S,
                 max_rows: int = MAX_ROWS) -> None:
        self.uri, self.fleet, self.keep_texts = uri, fleet, keep_texts
        self.max_age_s, self.max_rows = max_age_s, max_rows
        self.postgres = uri.startswith(("postgresql://", "postgres://"))
        from torchloom.uri import redact

        self.where = redact(uri)
        self._read_lock = threading.Lock()
        self._reader = self._connect()
        self._create()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.put = 0  # rows queued, ever (the serving thread's count only)
        self.taken = 0  # rows the writer took from the queue, ever (the writer's only): no count two threads bump
        self.written = 0
        self.dropped = 0
        self.pruned = 0
        self.failures = 0
        self._stop = threading.Event()
        self._writer = threading.Thread(target=self._write_loop, name="torchloom-log-writer", daemon=True)
        self._writer.start()

    # --- the store -----------------------------------------------------------------------------------------

    def _connect(self):
        if self.postgres:
            try:
                import psycopg
            except ImportError:
                raise UserError(f"--log {self.where}: PostgreSQL needs psycopg; pip install 'psycopg[binary]>=3.1'"
                                " (torchloom's postgres extra)") from None
            try:
                return psycopg.connect(self.uri, connect_timeout=10)
            except psycopg.Error as e:
                from torchloom.errors import clipped
                from torchloom.uri import mask_userinfo

                raise UserError(f"--log {self.where}: cannot connect ({clipped(mask_userinfo(str(e)))}); start the"
                                " database or fix the URI") from None
        path = self.uri.removeprefix("sqlite:///")  # sqlite:////abs/path, sqlite:///relative/path
        try:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(path, timeout=30, check_same_thread=False, isolation_level=None)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
        except (OSError, sqlite3.Error) as e:
            raise UserError(f"--log {self.where}: cannot open the SQLite file ({e}); pass a writable path") from None
        return db

    def _sql(self, statement: str) -> str:
        return statement.replace("?", "%s") if self.postgres else statement

    def _run(self, db, statement: str, params=(), many: bool = False, fetch: bool = False):
        """One statement in its own transaction (both drivers); rows when `fetch`."""
        statement = self._sql(statement)
        if self.postgres:
            with db.transaction(), db.cursor() as cur:
                (cur.executemany if many else cur.execute)(statement, params)
                return cur.fetchall() if fetch else cur.rowcount
        if many:
            db.execute("BEGIN")
            try:
                cur = db.executemany(statement, params)
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
            return cur.rowcount
        cur = db.execute(statement, params)
        return cur.fetchall() if fetch else cur.rowcount

    def _create(self) -> None:
        serial = "BIGSERIAL PRIMARY KEY" if self.postgres else "INTEGER PRIMARY KEY AUTOINCREMENT"
        with self._read_lock:
            for statement in filter(str.strip, _TABLES.replace("@SERIAL@", serial).split(";")):
                self._run(self._reader, statement)

    def read(self, statement: str, params=()) -> list[tuple]:
        with self._read_lock:
            return self._run(self._reader, statement, params, fetch=True)

    # --- writing, off the request path ---------------------------------------------------------------------

    def predictions(self, model: str, version: str, role: str, ids: list[str], texts: list[str],
                    answers: list[dict[str, Any]]) -> None:
        """Queue one row per answer (the caller's thread pays an append and the texts' hashes)."""
        if self.queued >= MAX_QUEUED:
            self.dropped += len(ids)
            return
        at = time.time()
        rows = [(i, model, self.fleet, version, role, at, a["label"], a.get("score"), text_hash(t),
                 t if self.keep_texts else None) for i, t, a in zip(ids, texts, answers)]
        self.put += len(rows)
        self._queue.put(("p", rows))

    def feedback(self, prediction_id: str, label: str, text: str | None = None, source: str = "id") -> None:
        """Queue one feedback label: of a prediction's id, or of a text sent with its label (source "text")."""
        self.put += 1
        self._queue.put(("f", [(prediction_id, self.fleet, label, time.time(), text,
                                text_hash(text) if text is not None else None, source)]))

    def _write_loop(self) -> None:
        db = self._connect()
        pruned_at = 0.0
        while not self._stop.is_set() or not self._queue.empty():
            batches: dict[str, list] = {"p": [], "f": []}
            try:
                kind, rows = self._queue.get(timeout=WRITE_EVERY_S)
                batches[kind] += rows
                self._stop.wait(WRITE_EVERY_S)  # what comes within goes in the same transaction (one per row
                while True:  # cost the server a fifth of its answers: docs/benchmarks.md)
                    kind, rows = self._queue.get_nowait()
                    batches[kind] += rows
            except queue.Empty:
                pass
            self._write(db, batches)
            if time.monotonic() - pruned_at > PRUNE_EVERY_S:
                pruned_at = time.monotonic()
                self._prune(db)
        db.close()

    def _write(self, db, batches: dict[str, list]) -> None:
        n = len(batches["p"]) + len(batches["f"])
        if not n:
            return
        try:
            if batches["p"]:
                self._run(db, "INSERT INTO tl_predictions (id, model, fleet, version, role, at, answer, confidence,"
                              " text_hash, text) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                          batches["p"], many=True)
            if batches["f"]:
                self._run(db, "INSERT INTO tl_feedback (id, fleet, label, at, text, text_hash, source) VALUES"
                              " (?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING", batches["f"], many=True)
            self.written += n
        except Exception as e:  # the store is down or full: counted and logged, serving goes on
            self.failures += n
            log.warning("prediction log %s: %d rows not written (%s)", self.where, n, str(e).splitlines()[0][:200])
        finally:
            self.taken += n

    def _prune(self, db) -> None:
        try:
            cutoff = time.time() - self.max_age_s
            gone = self._run(db, "DELETE FROM tl_predictions WHERE fleet = ? AND at < ?", (self.fleet, cutoff))
            gone += self._run(db, "DELETE FROM tl_feedback WHERE fleet = ? AND at < ?", (self.fleet, cutoff))
            edge = self._run(db, "SELECT at FROM tl_predictions WHERE fleet = ? ORDER BY at DESC LIMIT 1 OFFSET ?",
                             (self.fleet, self.max_rows), fetch=True)
            if edge:
                gone += self._run(db, "DELETE FROM tl_predictions WHERE fleet = ? AND at <= ?",
                                  (self.fleet, edge[0][0]))
            self.pruned += max(0, gone)
        except Exception as e:
            log.warning("prediction log %s: pruning failed (%s)", self.where, str(e).splitlines()[0][:200])

    @property
    def queued(self) -> int:
        """Rows waiting for the writer now."""
        return self.put - self.taken

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued row is written (or tried); whether it was within the time."""
        deadline = time.monotonic() + timeout_s
        while self.queued > 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.queued <= 0

    def close(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._writer.join(timeout_s)
        with self._read_lock:
            self._reader.close()

    # --- reading -------------------------------------------------------------------------------------------

    def answers_of(self, ids: list[str]) -> tuple[dict[str, dict[str, str]], dict[str, str]]:
        """({id: {model: answer}}, {id: its label}) of these prediction ids, as the store holds them."""
        answers: dict[str, dict[str, str]] = {}
        labels: dict[str, str] = {}
        for start in range(0, len(ids), 500):
            part = ids[start:start + 500]
            marks = ", ".join("?" * len(part))
            for i, model, answer in self.read(f"SELECT id, model, answer FROM tl_predictions WHERE fleet = ? AND id"
                                              f" IN ({marks})", (self.fleet, *part)):
                answers.setdefault(i, {})[model] = answer
            for i, label in self.read(f"SELECT id, label FROM tl_feedback WHERE fleet = ? AND id IN ({marks})",
                                      (self.fleet, *part)):
                labels[i] = label
        return answers, labels

    def labelled(self, after: int = 0, until: int | None = None, since_at: float = 0.0) -> list[Labelled]:
        """Feedback labels past seq `after` (up to `until`, from time `since_at`), in the store's order, each with
        the answers every model gave its text."""
        rows = self.read("SELECT f.seq, f.id, f.label, f.at, f.text, p.model, p.version, p.role, p.answer, p.text"
                         " FROM tl_feedback f LEFT JOIN tl_predictions p ON p.fleet = f.fleet AND p.id = f.id"
                         " WHERE f.fleet = ? AND f.seq > ? AND f.seq <= ? AND f.at >= ? ORDER BY f.seq",
                         (self.fleet, after, until if until is not None else 2 ** 62, since_at))
        out: dict[int, Labelled] = {}
        for seq, i, label, at, text, model, version, role, answer, answered_text in rows:
            item = out.setdefault(seq, Labelled(seq, i, label, at, text, {}))
            if item.text is None and answered_text is not None:
                item.text = answered_text
            if model is not None:
                item.answers[model] = (version, role, answer)
        return list(out.values())

    def watermark(self) -> int:
        """The newest feedback label's seq (0: none yet)."""
        rows = self.read("SELECT MAX(seq) FROM tl_feedback WHERE fleet = ?", (self.fleet,))
        return int(rows[0][0] or 0)

    def count_labels(self, after: int = 0) -> int:
        return int(self.read("SELECT COUNT(*) FROM tl_feedback WHERE fleet = ? AND seq > ?",
                             (self.fleet, after))[0][0])

    # --- events: the loop's audit trail --------------------------------------------------------------------

    def event(self, kind: str, who: str, **detail: Any) -> dict[str, Any]:
        """Append one event now (written at once, not queued: the trail is the record)."""
        at = time.time()
        with self._read_lock:
            self._run(self._reader, "INSERT INTO tl_events (fleet, at, kind, who, detail) VALUES (?, ?, ?, ?, ?)",
                      (self.fleet, at, kind, who, json.dumps(detail, sort_keys=True, default=str)))
        return {"at": at, "kind": kind, "who": who, **detail}

    def events(self, after: int = 0, limit: int = 10_000) -> list[dict[str, Any]]:
        rows = self.read("SELECT seq, at, kind, who, detail FROM tl_events WHERE fleet = ? AND seq > ? ORDER BY seq"
                         " LIMIT ?", (self.fleet, after, limit))
        return [{"seq": s, "at": at, "kind": k, "who": w, **json.loads(d)} for s, at, k, w, d in rows]

    def events_of(self, kind: str, after: int = 0, limit: int = 1000) -> list[dict[str, Any]]:
        """The newest `limit` events of one kind after seq `after`, oldest first."""
        rows = self.read("SELECT seq, at, kind, who, detail FROM tl_events WHERE fleet = ? AND kind = ? AND seq > ?"
                         " ORDER BY seq DESC LIMIT ?", (self.fleet, kind, after, limit))
        return [{"seq": s, "at": at, "kind": k, "who": w, **json.loads(d)} for s, at, k, w, d in reversed(rows)]

    def recent(self, n: int = 50) -> list[dict[str, Any]]:
        """The newest `n` events, oldest first."""
        rows = self.read("SELECT seq, at, kind, who, detail FROM tl_events WHERE fleet = ? ORDER BY seq DESC LIMIT ?",
                         (self.fleet, n))
        return [{"seq": s, "at": at, "kind": k, "who": w, **json.loads(d)} for s, at, k, w, d in reversed(rows)]

    # --- leases: one holder of a role at a time (the fleet's loop) ----------------------------------------------

    def take_lease(self, name: str, holder: str, ttl_s: float) -> tuple[str, float]:
        """The lease `name` of this fleet taken (or renewed) for `holder` until ttl_s from now, where it is free,
        lapsed or `holder`'s already, in one statement (atomic on both stores); (its holder, until) afterwards."""
        now = time.time()
        with self._read_lock:
            self._run(self._reader, "INSERT INTO tl_leases (fleet, name, holder, until) VALUES (?, ?, ?, ?) ON CONFLICT"
                      " (fleet, name) DO UPDATE SET holder = excluded.holder, until = excluded.until WHERE"
                      " tl_leases.until < ? OR tl_leases.holder = excluded.holder",
                      (self.fleet, name, holder, now + ttl_s, now))
            rows = self._run(self._reader, "SELECT holder, until FROM tl_leases WHERE fleet = ? AND name = ?",
                             (self.fleet, name), fetch=True)
        return rows[0][0], float(rows[0][1])

    def replace_lease(self, name: str, was: str, holder: str, ttl_s: float) -> tuple[str, float]:
        """The lease `name` moved from `was` to `holder` only while `was` still holds it (compare and swap); (its
        holder, until) afterwards."""
        with self._read_lock:
            self._run(self._reader, "UPDATE tl_leases SET holder = ?, until = ? WHERE fleet = ? AND name = ? AND"
                      " holder = ?", (holder, time.time() + ttl_s, self.fleet, name, was))
            rows = self._run(self._reader, "SELECT holder, until FROM tl_leases WHERE fleet = ? AND name = ?",
                             (self.fleet, name), fetch=True)
        return rows[0][0], float(rows[0][1])

    def drop_lease(self, name: str, holder: str) -> None:
        with self._read_lock:
            self._run(self._reader, "DELETE FROM tl_leases WHERE fleet = ? AND name = ? AND holder = ?",
                      (self.fleet, name, holder))

    def counts(self) -> list[tuple[tuple[str], float]]:
        """The rows by what became of them: torchloom_log_rows_total{result} (serve/metrics.py)."""
        return [(("written",), self.written), (("dropped",), self.dropped), (("failed",), self.failures),
                (("pruned",), self.pruned), (("queued",), self.queued)]


def log_uri(given: str) -> str | None:
    """The store of --log: "none" -> None; a path -> sqlite:///ABSOLUTE; a sqlite:/// or postgresql:// URI as it
    is; anything else one line."""
    if given.lower() in ("none", "off", ""):
        return None
    if given.startswith(("postgresql://", "postgres://")):
        return given
    if given.startswith("sqlite:///"):
        return given
    from torchloom.uri import has_scheme

    if has_scheme(given):
        raise UserError(f"--log {given.split('://')[0]}://...: not a store the log can use; pass a file path, a"
                        " sqlite:///PATH or a postgresql://USER@HOST/DB URI, or none")
    return "sqlite:///" + str(Path(given).expanduser().absolute())
