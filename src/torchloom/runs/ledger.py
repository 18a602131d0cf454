"""The ledger: every file torchloom wrote into a run, a study or prepared data, at the size and modification time
it left it (`torchloom-ledger.json` at the top). `--overwrite` deletes what the ledger vouches for and is still as
torchloom left it, nothing else: a user's file under a name a run uses (`data/reviews.csv`, a base model in
`model/`) is not listed, so it is never deleted, and a replacement that would have to is refused in one line.

A file is torchloom's only by a record made when it was written; nothing is inferred from whether a command is
running or was killed:
- A command that writes into a tree opens itself in the ledger before it writes anything (runs/recording.py): its
  pid and host, the names it may write (its claims: the names a run uses, `rundir.top_names`), and every file that
  was there and not torchloom's (its foreign files). While it runs it touches a beat file of its own
  (`.torchloom-beat.<pid>.<host>`) every BEAT_S seconds (its entry records the interval it keeps: beat_s).
- At its end it lists what it wrote: the files under its claims that were not someone else's when it began. A
  file that was someone else's stays theirs, changed or not (a torchloom name written whole, `config.toml`, aside);
  a file under a name no run uses (`NOTES.md`, `mine/labels.csv`) is never torchloom's.
- A command killed before its end (SIGKILL, the OOM killer, a lost host) vouches, for the next command, for what it
  could have written: files under its claims, not someone else's, modified no later than its last beat plus
  slack_ns(its beat). Anything written after that is not torchloom's by record: it stays where it is, and the next
  `--overwrite` names it and deletes nothing. An entry is dead when its process is gone on this host, or its beat
  is older than expire_s(its beat) (another host's, on a shared file system), or, on a store (one driver per prefix: its
  lease, runs/lease.py), once it has stopped beating for a few seconds.

Runs made before ledgers: only content-verified markers count (a run record, a config.toml and a manifest that
torchloom's readers accept, the shards a manifest lists, a checkpoint's files that its meta.json lists at their
sizes, a study marker), never a bare name.

The same rules for a local directory (local_tree.LocalTree) and a prefix on a store (store_tree.StoreTree). Nothing
heavy is imported here: every layer may use it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from torchloom.runs.ledger_markers import verified
from torchloom.runs.local_tree import LocalTree, Stat
from torchloom.runs.rundir import CONFIG_FILE, LEASE_FILE, RUN_RECORD, top_names
from torchloom.runs.runrecord import TEMP_NAME, holds_cwd
from torchloom.uri import has_scheme

__all__ = ["LEDGER_FILE", "NOT_CONTENT", "Ledger", "LocalTree", "Open", "Stat", "Tree", "content", "deletable",
           "known", "parse", "replace", "settle", "under_any"]

LEDGER_FILE = "torchloom-ledger.json"
FORMAT = "torchloom-ledger/2"
OLD_FORMAT = "torchloom-ledger/1"  # open entries without claims or beats: they vouch for nothing after their end
# Not a run's content: the ledger itself, and a store run's lease (its driver's, removed at the end: runs/lease.py).
NOT_CONTENT = frozenset({LEDGER_FILE, LEASE_FILE})
BEAT = re.compile(r"^\.torchloom-beat\.(\d+)\.([0-9a-f]{12})$")

BEAT_S = 2.0  # how often an open command touches its beat file


def beat_s() -> float:
    """This command's beat interval: BEAT_S, or TORCHLOOM_LEDGER_BEAT_S (the tests' faster), read when it opens. Its
    entry records it: a reader judges each command by the interval that command kept, not by its own."""
    try:
        return min(max(float(os.environ.get("TORCHLOOM_LEDGER_BEAT_S", "") or BEAT_S), 0.05), 30.0)
    except ValueError:
        return BEAT_S


def expire_s(beat: float) -> float:
    """A beat older than this: the command is dead (a lost host, a stopped process)."""
    return max(120.0, 30 * beat)


def slack_ns(beat: float) -> int:
    """A killed command wrote nothing later than its last beat plus this: a beat missed, and a store's 1 s times."""
    return int((2 * beat + 1) * 1e9)

# The names a command writes (its claims): every name at the top of a run or study, their sqlite side files, and
# torchloom's temporary names beside them (`.model.tmp-123`, `.config.toml.123.4.tmp`).
RUN_NAMES = frozenset(top_names()) | {RUN_RECORD, CONFIG_FILE}
_NAMES = "|".join(sorted(map(re.escape, RUN_NAMES)))
_BESIDE = re.compile(rf"^\.(?:{_NAMES})[.-]|^(?:{_NAMES})-(?:journal|wal|shm)$")
ALL = "*"  # a claim: every name a run uses


class Tree(Protocol):
    """A directory, or a prefix on a store, as the ledger sees it."""

    where: str  # what names it in a line (a store's URI, credentials masked)
    exclusive: bool  # one command at a time writes it (a store run's lease): an open one found at begin was killed

    def inventory(self) -> dict[str, Stat]: ...  # every file under it by its path relative to it, posix
    def read(self, rel: str) -> bytes | None: ...
    def write(self, rel: str, data: bytes) -> None: ...
    def touch(self, rel: str) -> None: ...  # its modification time moved to now (written if missing)
    def delete(self, rels: list[str]) -> None: ...  # these files, then the directories they leave empty
    def locate(self, rel: str) -> str: ...  # the absolute path or URI of a file in it (to compare with inputs)
    def exists(self) -> bool: ...


def beat_name(pid: int, host: str) -> str:
    return f".torchloom-beat.{pid}.{hashlib.sha256(host.encode()).hexdigest()[:12]}"


def is_content(rel: str) -> bool:
    return rel not in NOT_CONTENT and not BEAT.match(rel)


class _Skipped:
    """What a copy of a run never takes from the store or sends to it: the ledger, the lease and beats (`in`)."""

    def __contains__(self, rel: object) -> bool:
        return isinstance(rel, str) and not is_content(rel)


SKIPPED = _Skipped()


def process_start(pid: int) -> int | None:
    """When a process started (Linux: clock ticks since boot), so that a pid used again is not taken for it."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def claimed(claims: tuple[str, ...], rel: str) -> bool:
    """Is `rel` under a command's claims (a name, `dir/`, or ALL: every name a run uses)?"""
    first = rel.split("/", 1)[0]
    for claim in claims:
        if claim == ALL:
            if first in RUN_NAMES or TEMP_NAME.match(first) or _BESIDE.match(first):
                return True
        elif rel == claim or (claim.endswith("/") and rel.startswith(claim)):
            return True
    return False


def written_whole(rel: str) -> bool:
    """A name at the top that torchloom writes whole (config.toml, report.md): a file there that was someone else's
    when the command began and changed since is the command's (it replaced it)."""
    return "/" not in rel and rel in RUN_NAMES and "." in rel


@dataclass
class Open:
    """A command between its begin and its end: who runs it, what it may write, and what was not torchloom's then."""

    pid: int
    host: str
    foreign: dict[str, Stat]
    claims: tuple[str, ...] = (ALL,)
    started: int | None = None  # process_start(pid): a pid used again by another process is not this command
    old: bool = False  # opened by a version that kept no beat
    beat_s: float = BEAT_S  # how often it touches its beat file (an entry that does not say: the default)

    @property
    def beat(self) -> str:
        return beat_name(self.pid, self.host)

    def same(self, other: Open) -> bool:
        return (self.pid, self.host, self.started) == (other.pid, other.host, other.started)

    def writes(self, rel: str, st: Stat) -> bool:
        """Could this command have written `rel` as it is now: under its claims, and not someone else's."""
        if not claimed(self.claims, rel):
            return False
        was = self.foreign.get(rel)
        return was is None or (was != st and written_whole(rel))

    def alive(self, beats: dict[str, Stat], exclusive: bool, now_ns: int | None = None) -> bool:
        """Still running: this process; else only while its beat is fresh and (on this host, off a store) its
        process is there."""
        if self.same(me()):
            return True
        if self.old:
            return False
        beat = beats.get(self.beat)
        now_ns = time.time_ns() if now_ns is None else now_ns
        # on a store one driver writes (its lease): its entry counts while it is beating right now (its workers
        # see it so), and a killed driver's is dead within seconds; elsewhere a beat expires after expire_s
        fresh_s = 3 * self.beat_s + 2 if exclusive else expire_s(self.beat_s)
        if beat is None or beat[1] is None or now_ns - beat[1] > fresh_s * 1e9:
            return False
        if self.host != socket.gethostname() or exclusive:
            return True
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return self.started is None or process_start(self.pid) in (None, self.started)

    def last_record(self, beats: dict[str, Stat]) -> int | None:
        """The latest modification time (ns) a file this (killed) command wrote can have, or None: unknown."""
        beat = beats.get(self.beat)
        return None if self.old or beat is None or beat[1] is None else beat[1] + slack_ns(self.beat_s)


def me(claims: tuple[str, ...] = (ALL,), foreign: dict[str, Stat] | None = None) -> Open:
    """This process as an open command."""
    return Open(os.getpid(), socket.gethostname(), foreign or {}, claims, process_start(os.getpid()),
                beat_s=beat_s())


@dataclass
class Ledger:
    files: dict[str, Stat] = field(default_factory=dict)
    open: list[Open] = field(default_factory=list)  # commands begun and not ended (killed ones until settled)

    def dumps(self) -> bytes:
        def listed(stats: dict[str, Stat]) -> dict:
            return {rel: list(st) for rel, st in sorted(stats.items())}

        data = {"format": FORMAT, "files": listed(self.files),
                "open": [{"pid": o.pid, "host": o.host, "started": o.started, "claims": list(o.claims),
                          "beat_s": o.beat_s, "foreign": listed(o.foreign)} for o in self.open if not o.old]}
        return json.dumps(data, separators=(",", ":")).encode()


def _stats(raw) -> dict[str, Stat] | None:
    if not isinstance(raw, dict):
        return None
    out = {}
    for rel, st in raw.items():
        if not (isinstance(rel, str) and isinstance(st, list) and len(st) == 2 and isinstance(st[0], int)
                and (st[1] is None or isinstance(st[1], int))):
            return None
        out[rel] = (st[0], st[1])
    return out


def _entry(o, old: bool) -> Open | None:
    foreign = _stats(o.get("foreign")) if isinstance(o, dict) else None
    if foreign is None or not isinstance(o.get("pid"), int) or not isinstance(o.get("host"), str):
        return None
    claims = o.get("claims", [ALL])
    started = o.get("started")
    beat = o.get("beat_s", BEAT_S)
    if not (isinstance(claims, list) and all(isinstance(c, str) for c in claims)) or not (
            started is None or isinstance(started, int)):
        return None
    if isinstance(beat, bool) or not isinstance(beat, (int, float)) or not 0.05 <= beat <= 30.0:
        beat = BEAT_S
    return Open(o["pid"], o["host"], foreign, tuple(claims), started, old, float(beat))


def parse(content: bytes | None) -> Ledger | None:
    """A ledger as Ledger.dumps wrote it (or the version before beats), or None (missing, damaged, someone else's)."""
    try:
        data = json.loads(content) if content is not None else None
    except ValueError:
        return None
    if not isinstance(data, dict) or data.get("format") not in (FORMAT, OLD_FORMAT) or not isinstance(
            data.get("open", []), list):
        return None
    files = _stats(data.get("files"))
    opened = [_entry(o, data["format"] == OLD_FORMAT) for o in data.get("open", [])]
    if files is None or None in opened:
        return None
    return Ledger(files, opened)


def snapshot(tree: Tree) -> tuple[dict[str, Stat], dict[str, Stat]]:
    """(every file of the tree but the ledger, a lease and beats; the beat files), from one listing."""
    everything = tree.inventory()
    return ({rel: st for rel, st in everything.items() if is_content(rel)},
            {rel: st for rel, st in everything.items() if BEAT.match(rel)})


def content(tree: Tree) -> dict[str, Stat]:
    """Every file of the tree but the ledger, a lease and the open commands' beats."""
    return snapshot(tree)[0]


def vouched(ledger: Ledger, inventory: dict[str, Stat], beats: dict[str, Stat],
            exclusive: bool) -> tuple[dict[str, Stat], dict[str, Open]]:
    """(what the ledger vouches for now: what it lists, as it lists it, and what its open commands could have written
    (a killed one's up to its last record); the files a killed command's record does not cover, by that command)."""
    ours = {rel: st for rel, st in ledger.files.items() if inventory.get(rel) == st}
    late: dict[str, Open] = {}
    now_ns = time.time_ns()
    for o in ledger.open:
        live = o.alive(beats, exclusive, now_ns)
        bound = None if live else o.last_record(beats)
        for rel, st in inventory.items():
            if rel in ours or not o.writes(rel, st):
                continue
            if not live and (bound is None or st[1] is None or st[1] > bound):
                late.setdefault(rel, o)  # written after its last record (or its record is of no time)
                continue
            ours[rel] = st
    return ours, {rel: o for rel, o in late.items() if rel not in ours}


@dataclass
class Known:
    """What a tree's ledger (or, before ledgers, its markers) vouches for as it is now."""

    ours: dict[str, Stat]
    ledger: Ledger | None
    late: dict[str, Open] = field(default_factory=dict)  # files past a killed command's last record, by command
    beats: dict[str, Stat] = field(default_factory=dict)


def known(tree: Tree, inventory: dict[str, Stat], beats: dict[str, Stat] | None = None) -> Known:
    ledger = parse(tree.read(LEDGER_FILE))
    if ledger is None:
        return Known(verified(inventory, tree.read), None)
    beats = beats if beats is not None else snapshot(tree)[1]
    ours, late = vouched(ledger, inventory, beats, tree.exclusive)
    return Known(ours, ledger, late, beats)


def killed_line(where: str, late: dict[str, Open], beats: dict[str, Stat]) -> str:
    """'3 files written after the last record of a command killed at about 14:02:31 (pid 123 on h) are not
    torchloom's by record: left in place (a, b, c)'."""
    o = next(iter(late.values()))
    beat = beats.get(o.beat)
    when = time.strftime("%H:%M:%S", time.localtime(beat[1] / 1e9)) if beat and beat[1] else "an unknown time"
    names = sorted(late)
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return (f"{where}: {len(names)} file(s) written after the last record of a command killed at about {when}"
            f" (pid {o.pid} on {o.host}) are not torchloom's by record: left in place ({', '.join(names[:3])}{more})")


# -- what --overwrite may delete: the one deletion path of a run's files ---------------------------------------
def under_any(location: str, inputs: list[str]) -> bool:
    return any(location == i or location.startswith(i.rstrip("/") + "/") for i in inputs)


def deletable(tree: Tree, key: str, inputs: list[str] = (), under: str = "") -> list[str]:
    """The files under `under` (the whole tree by default) that --overwrite deletes: every one, or a one-line
    refusal naming what torchloom did not write (or changed since, or wrote after its last record before a kill),
    and any input of the command among them."""
    from torchloom.errors import UserError

    inventory, beats = snapshot(tree)
    prefix = f"{under.strip('/')}/" if under else ""
    inventory = {rel: st for rel, st in inventory.items() if rel.startswith(prefix)}
    if not inventory:
        return []
    found = known(tree, inventory, beats)
    ours = found.ours
    if found.ledger is None and not ours:
        raise UserError(f"{key} {tree.where}: not replaced: it is neither empty nor a torchloom run, prepared data or"
                        " study (no config.toml, manifest.json or study.json that torchloom wrote); pass another"
                        " --output.dir")
    wanted = [i if has_scheme(i) else os.path.realpath(i) for i in inputs if i]
    kept_inputs = sorted(rel for rel in inventory if under_any(tree.locate(rel), wanted))
    foreign = sorted(rel for rel, st in inventory.items() if ours.get(rel) != st and rel not in kept_inputs)
    if not kept_inputs and not foreign:
        return sorted(inventory)
    where = f"{tree.where}/{prefix.rstrip('/')}" if prefix else tree.where
    late = {rel: o for rel, o in found.late.items() if rel in foreign}
    named = [f"{rel} (an input)" for rel in kept_inputs] + [rel for rel in foreign if rel not in late]
    if late:
        also = (f"; it also holds {', '.join(named[:3])}{' and more' if len(named) > 3 else ''}, which torchloom"
               " did not write" if named else "")
        raise UserError(f"{key} {killed_line(where, late, found.beats)}{also}; not replaced, nothing deleted: look"
                        " at them, move them away, then run again, or pass another --output.dir")
    more = f" and {len(named) - 3} more" if len(named) > 3 else ""
    why = "torchloom did not write (or changed since)" if found.ledger is not None else (
        "no marker of torchloom's vouches for (a run from before ledgers)")
    raise UserError(f"{key} {where}: not replaced, nothing deleted: it holds {', '.join(named[:3])}{more}, which"
                    f" {why}; move them away or pass another --output.dir")


def replace(tree: Tree, key: str, inputs: list[str] = (), under: str = "") -> list[str]:
    """Delete what `deletable` allows (all of it or nothing); the tree's root stays. Returns them. Every deletion
    of a run's files goes through here (--overwrite, a fresh training's checkpoints, a run's staged data)."""
    rels = deletable(tree, key, inputs, under)
    if rels:
        tree.delete(rels)
        settle(tree)
    return rels


def settle(tree: Tree) -> None:
    """Write the ledger as it stands now: what it vouches for that is still there, and the commands still open
    (a killed one is settled: what its record covers is listed; a file that came later is nobody's but its
    owner's)."""
    ledger = parse(tree.read(LEDGER_FILE))
    if ledger is None:
        return
    inventory, beats = snapshot(tree)
    ours, _ = vouched(ledger, inventory, beats, tree.exclusive)
    now_ns = time.time_ns()
    still = [o for o in ledger.open if o.alive(beats, tree.exclusive, now_ns)]
    tree.write(LEDGER_FILE, Ledger(ours, still).dumps())
    gone = [o.beat for o in ledger.open if o not in still and o.beat in beats]
    if gone:
        tree.delete(gone)


def check_replaceable(path: str | Path, key: str = "output.dir", inputs: list[str] = ()) -> list[str]:
    """The files of `path` that --overwrite deletes (ledger.deletable: what torchloom wrote, as it left it), or a
    one-line refusal: never the working directory or one holding it, a home directory or a file system's root."""
    from torchloom.errors import UserError

    path = Path(path)
    if not path.exists():
        return []
    if not path.is_dir():
        raise UserError(f"{key} {path}: exists and is not a directory; --overwrite replaces only torchloom runs")
    resolved = path.resolve()
    if holds_cwd(path) or resolved == Path.home().resolve() or resolved.parent == resolved:
        raise UserError(f"{key} {path}: is the working directory, a home directory or a root, or holds the working"
                        " directory; --overwrite would delete it; pass another --output.dir")
    return deletable(LocalTree(path), key, inputs)


def replace_local(path: str | Path, key: str = "output.dir", inputs: list[str] = ()) -> None:
    """--overwrite of a local directory: delete what check_replaceable allows (all of it or nothing); the
    directory stays."""
    if check_replaceable(path, key, inputs):
        replace(LocalTree(path), key, inputs)


def holding(path: str | Path) -> tuple[Tree, str]:
    """(the tree whose ledger lists a local directory's files, the directory's path in it): its own (prepared data
    has one: seal), else its parent's (a run's model/: the ledger is at the run's top), else its own (a run before
    ledgers: its markers)."""
    path = Path(path)
    if parse(LocalTree(path).read(LEDGER_FILE)) is None and parse(LocalTree(path.parent).read(LEDGER_FILE)):
        return LocalTree(path.parent), path.name
    return LocalTree(path), ""


def seal(path: str | Path) -> None:
    """A directory torchloom has just written whole (prepared data, before it is published): its own ledger lists
    every file in it."""
    tree = LocalTree(path)
    tree.write(LEDGER_FILE, Ledger(content(tree)).dumps())


def is_empty(tree: Tree) -> bool:
    """Holds no file but a ledger (and a store run's lease, and beats)."""
    return not content(tree)
