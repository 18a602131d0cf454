"""The ledger: every file torchloom wrote into a run, a study or prepared data, at the size and modification time
it left it (`torchloom-ledger.json` at the top). `--overwrite` deletes what the ledger lists and is still as
torchloom left it, nothing else: a user's file under a name a run uses (`data/reviews.csv`, a base model in
`model/`) is not listed, so it is never deleted, and a replacement that would have to is refused in one line.

How files get listed: each command that writes into a run takes stock when it starts (`begin`: every file there
that the ledger does not list as it is now is someone else's) and again when it ends (`end`: every other file
there is torchloom's, written by this command). `begin` opens the command in the ledger with that stock, so a
command killed before its end (SIGKILL, a lost host) is settled the same way by the next one.

Runs made before ledgers: only content-verified markers count (a run record, a config.toml and a manifest that
torchloom's readers accept, the shards a manifest lists, a checkpoint's files that its meta.json lists at their
sizes, a study marker), never a bare name.

The same rules for a local directory (LocalTree) and a prefix on a store (store_tree.StoreTree). Nothing heavy is
imported here: every layer may use it.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from torchloom.jsonio import write_atomic
from torchloom.runs.rundir import CONFIG_FILE, LEASE_FILE, MANIFEST_FILE, RUN_RECORD, STEP_DIR, STUDY_FILE
from torchloom.runs.runrecord import TEMP_NAME, holds_cwd, is_own_file, parse_record
from torchloom.uri import has_scheme

LEDGER_FILE = "torchloom-ledger.json"
FORMAT = "torchloom-ledger/1"
# Not a run's content: the ledger itself, and a store run's lease (its driver's, removed at the end: runs/lease.py).
NOT_CONTENT = frozenset({LEDGER_FILE, LEASE_FILE})

Stat = tuple[int, int | None]  # (size, modification time in ns; None where a store lists none)


class Tree(Protocol):
    """A directory, or a prefix on a store, as the ledger sees it."""

    where: str  # what names it in a line (a store's URI, credentials masked)
    exclusive: bool  # one command at a time writes it (a store run's lease): an open one found at begin was killed

    def inventory(self) -> dict[str, Stat]: ...  # every file under it by its path relative to it, posix
    def read(self, rel: str) -> bytes | None: ...
    def write(self, rel: str, data: bytes) -> None: ...
    def delete(self, rels: list[str]) -> None: ...  # these files, then the directories they leave empty
    def locate(self, rel: str) -> str: ...  # the absolute path or URI of a file in it (to compare with inputs)
    def exists(self) -> bool: ...


@dataclass
class Open:
    """A command between its begin and its end: who runs it, and the files that were not torchloom's then."""

    pid: int
    host: str
    foreign: dict[str, Stat]

    def alive(self) -> bool:
        """Still running, as far as this host can tell (a command of another host is taken to be)."""
        if self.host != socket.gethostname():
            return True
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


@dataclass
class Ledger:
    files: dict[str, Stat] = field(default_factory=dict)
    open: list[Open] = field(default_factory=list)  # commands begun and not ended (killed ones until settled)

    def dumps(self) -> bytes:
        def listed(stats: dict[str, Stat]) -> dict:
            return {rel: list(st) for rel, st in sorted(stats.items())}

        data = {"format": FORMAT, "files": listed(self.files),
                "open": [{"pid": o.pid, "host": o.host, "foreign": listed(o.foreign)} for o in self.open]}
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


def parse(content: bytes | None) -> Ledger | None:
    """A ledger as Ledger.dumps wrote it, or None (missing, damaged, someone else's file)."""
    try:
        data = json.loads(content) if content is not None else None
    except ValueError:
        return None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("open", []), list):
        return None
    files = _stats(data.get("files"))
    opened = []
    for o in data.get("open", []):
        foreign = _stats(o.get("foreign")) if isinstance(o, dict) else None
        if foreign is None or not isinstance(o.get("pid"), int) or not isinstance(o.get("host"), str):
            return None
        opened.append(Open(o["pid"], o["host"], foreign))
    return Ledger(files, opened) if files is not None else None


def content(tree: Tree) -> dict[str, Stat]:
    """Every file of the tree but the ledger and a lease."""
    return {rel: st for rel, st in tree.inventory().items() if rel not in NOT_CONTENT}


def settled(ledger: Ledger, inventory: dict[str, Stat]) -> dict[str, Stat]:
    """What the ledger vouches for now: while commands are open (or were killed), every file there but those that
    were someone else's when one of them began and are unchanged since; else what it lists, as it lists it."""
    if not ledger.open:
        return {rel: st for rel, st in ledger.files.items() if inventory.get(rel) == st}
    return {rel: st for rel, st in inventory.items() if not any(o.foreign.get(rel) == st for o in ledger.open)}


def verified(inventory: dict[str, Stat], read) -> dict[str, Stat]:
    """A run made before ledgers: the files its content-verified markers vouch for (module docstring)."""
    ours: set[str] = set()
    for rel in inventory:
        name = rel.rsplit("/", 1)[-1]
        # a temporary or lock file of torchloom's own pattern (a study's .running.lock), the record, a config or
        # study marker that torchloom's readers accept
        if (TEMP_NAME.match(name) or (rel == RUN_RECORD and parse_record(read(rel)) is not None)
                or (rel in (CONFIG_FILE, STUDY_FILE) and is_own_file(rel, read(rel) or b""))):
            ours.add(rel)
        elif name == MANIFEST_FILE and rel in (MANIFEST_FILE, f"data/{MANIFEST_FILE}"):
            ours |= _manifest_files(rel, read(rel) or b"", inventory)
        elif name == "meta.json" and _is_checkpoint(rel):
            ours |= _checkpoint_files(rel, read(rel) or b"", inventory)
    return {rel: inventory[rel] for rel in ours}


def _manifest_files(rel: str, raw: bytes, inventory: dict[str, Stat]) -> set[str]:
    if not is_own_file(rel, raw):
        return set()
    base = rel.rsplit("/", 1)[0] + "/" if "/" in rel else ""
    shards = {f"{base}{s.get('path')}" for split in json.loads(raw)["splits"].values()
              for s in split["shards"] if isinstance(s, dict) and isinstance(s.get("path"), str)}
    return {rel} | (shards & inventory.keys())


def _is_checkpoint(rel: str) -> bool:
    parts = rel.split("/")
    return len(parts) == 3 and parts[0] == "checkpoints" and STEP_DIR.match(parts[1]) is not None


def _checkpoint_files(rel: str, raw: bytes, inventory: dict[str, Stat]) -> set[str]:
    try:
        files = json.loads(raw).get("files")
    except (ValueError, AttributeError):
        return set()
    if not isinstance(files, dict) or not files:
        return set()
    base = rel.rsplit("/", 1)[0]
    listed = {f"{base}/{name}": want.get("size") for name, want in files.items() if isinstance(want, dict)}
    if any(inventory.get(path, (None,))[0] != size for path, size in listed.items()):
        return set()  # not as its meta.json says: not vouched for
    return {rel, *listed}


def known(tree: Tree, inventory: dict[str, Stat]) -> tuple[dict[str, Stat], Ledger | None]:
    """The files the tree's ledger (or, before ledgers, its markers) vouches for as they are now, and its ledger."""
    ledger = parse(tree.read(LEDGER_FILE))
    if ledger is None:
        return verified(inventory, tree.read), None
    return settled(ledger, inventory), ledger


# -- a command's stock-taking ----------------------------------------------------------------------------------
_open: dict[str, int] = {}  # the trees a command of this process is recording, and how deeply nested
_open_lock = threading.Lock()


@contextmanager
def recording(tree: Tree) -> Iterator[None]:
    """Around a command that writes into `tree`: what it wrote is listed in the ledger when it ends, whether it
    ends well or not. Nested uses on one tree (`run`'s stages) record once, at the outermost."""
    key = tree.where
    with _open_lock:
        depth = _open.get(key, 0)
        _open[key] = depth + 1
    try:
        if depth:
            yield
            return
        stock = begin(tree)
        try:
            yield
        finally:
            end(tree, stock)
    finally:
        with _open_lock:
            _open[key] -= 1
            if not _open[key]:
                del _open[key]


@dataclass
class Stock:
    """What a command found when it began (begin), for its end."""

    before: dict[str, Stat] = field(default_factory=dict)  # every file there
    foreign: dict[str, Stat] = field(default_factory=dict)  # those of them that were not torchloom's as they were
    started: bool = False  # the ledger was begun by this command (the tree was new or empty)
    made: list[Path] = field(default_factory=list)  # the local directories its begin made, innermost first
    taken: bool = True  # False: the tree could not be read then (a store that did not answer)


def begin(tree: Tree) -> Stock:
    """Take stock, and open this command in the ledger at once (a command killed before its end is settled by the
    next): in a tree that has a ledger, or a new or empty one; nothing is written into a tree that holds files but
    no ledger (it may be someone else's, and the command may yet refuse it)."""
    try:
        inventory = content(tree)
        ours, ledger = known(tree, inventory)
        foreign = {rel: st for rel, st in inventory.items() if ours.get(rel) != st}
        started = ledger is None and not inventory
        made = []
        if isinstance(tree, LocalTree):
            made = [p for p in (tree.root.absolute(), *tree.root.absolute().parents) if not p.exists()]
        if ledger is not None or started:
            # a killed command is settled in `ours`; on a store the lease says no other driver runs (runs/lease.py)
            others = [o for o in (ledger.open if ledger else []) if not tree.exclusive and o.alive()]
            tree.write(LEDGER_FILE, Ledger(ours, [*others, Open(os.getpid(), socket.gethostname(), foreign)]).dumps())
        return Stock(inventory, foreign, started, made)
    except Exception:  # a store that does not answer: the stage's own check says so, in one line
        return Stock(taken=False)


def end(tree: Tree, stock: Stock) -> None:
    """List what this command wrote: every file there but those that were someone else's at its begin (or another
    open command's), unchanged. Nothing is left where the command wrote nothing (a refusal leaves a user's directory
    as it was; a ledger this command began in an empty tree goes again)."""
    if not stock.taken:
        return
    try:
        if not tree.exists():
            return
        inventory = content(tree)
        ledger = parse(tree.read(LEDGER_FILE))
        if inventory == stock.before and (stock.started or ledger is None):
            if stock.started and ledger is not None and len(ledger.open) <= 1:
                tree.delete([LEDGER_FILE])
                for made in stock.made:  # innermost first; only where nothing else came meanwhile
                    try:
                        made.rmdir()
                    except OSError:
                        break
            return
        me = Open(os.getpid(), socket.gethostname(), stock.foreign)
        others = [o for o in (ledger.open if ledger else []) if o != me]
        files = {rel: st for rel, st in inventory.items()
                 if not any(o.foreign.get(rel) == st for o in [*others, me])}
        tree.write(LEDGER_FILE, Ledger(files, others).dumps())
    except Exception as e:
        _warn(tree, e)


def is_empty(tree: Tree) -> bool:
    """Holds no file but a ledger (and a store run's lease)."""
    return not content(tree)


def _warn(tree: Tree, e: Exception) -> None:
    from torchloom.errors import first_line

    print(f"torchloom: warning: {tree.where}: could not update {LEDGER_FILE} ({first_line(e)}); --overwrite will"
          " not delete what this command wrote there", file=sys.stderr, flush=True)


# -- what --overwrite may delete -------------------------------------------------------------------------------
def under_any(location: str, inputs: list[str]) -> bool:
    return any(location == i or location.startswith(i.rstrip("/") + "/") for i in inputs)


def deletable(tree: Tree, key: str, inputs: list[str] = (), under: str = "") -> list[str]:
    """The files under `under` (the whole tree by default) that --overwrite deletes: every one, or a one-line
    refusal naming what torchloom did not write (or changed since), and any input of the command among them."""
    from torchloom.errors import UserError

    inventory = content(tree)
    prefix = f"{under.strip('/')}/" if under else ""
    inventory = {rel: st for rel, st in inventory.items() if rel.startswith(prefix)}
    if not inventory:
        return []
    ours, ledger = known(tree, inventory)
    if ledger is None and not ours:
        raise UserError(f"{key} {tree.where}: not replaced: it is neither empty nor a torchloom run, prepared data or"
                        " study (no config.toml, manifest.json or study.json that torchloom wrote); pass another"
                        " --output.dir")
    wanted = [i if has_scheme(i) else os.path.realpath(i) for i in inputs if i]
    kept_inputs = sorted(rel for rel in inventory if under_any(tree.locate(rel), wanted))
    foreign = sorted(rel for rel, st in inventory.items() if ours.get(rel) != st and rel not in kept_inputs)
    if not kept_inputs and not foreign:
        return sorted(inventory)
    named = [f"{rel} (an input)" for rel in kept_inputs] + foreign
    more = f" and {len(named) - 3} more" if len(named) > 3 else ""
    why = "torchloom did not write (or changed since)" if ledger is not None else (
        "no marker of torchloom's vouches for (a run from before ledgers)")
    where = f"{tree.where}/{prefix.rstrip('/')}" if prefix else tree.where
    raise UserError(f"{key} {where}: not replaced, nothing deleted: it holds {', '.join(named[:3])}{more}, which"
                    f" {why}; move them away or pass another --output.dir")


def replace(tree: Tree, key: str, inputs: list[str] = (), under: str = "") -> list[str]:
    """--overwrite: delete what `deletable` allows (all of it or nothing); the tree's root stays. Returns them."""
    rels = deletable(tree, key, inputs, under)
    if rels:
        tree.delete(rels)
        settle(tree)
    return rels


def settle(tree: Tree) -> None:
    """Write the ledger as it stands now: what it vouches for that is still there, and the commands still open
    (a killed one is settled: what it wrote is listed; a file that comes later is nobody's but its owner's)."""
    ledger = parse(tree.read(LEDGER_FILE))
    if ledger is None:
        return
    ours = settled(ledger, content(tree))
    me = (os.getpid(), socket.gethostname())
    still = [o for o in ledger.open if (o.pid, o.host) == me or (not tree.exclusive and o.alive())]
    tree.write(LEDGER_FILE, Ledger(ours, still).dumps())


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
    rels = check_replaceable(path, key, inputs)
    if rels:
        LocalTree(path).delete(rels)
        settle(LocalTree(path))


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


# -- a local directory -----------------------------------------------------------------------------------------
class LocalTree:
    """A local directory as a Tree (symbolic links are entries of their own: never followed, never deleted
    through)."""

    exclusive = False  # several `tune` processes may share a study

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.where = str(root)

    def exists(self) -> bool:
        return self.root.is_dir()

    def inventory(self) -> dict[str, Stat]:
        out: dict[str, Stat] = {}
        if not self.root.is_dir():
            return out
        for folder, dirs, names in os.walk(self.root):
            here = Path(folder)
            for name in names + [d for d in dirs if (here / d).is_symlink()]:
                path = here / name
                try:
                    st = path.lstat()
                except FileNotFoundError:
                    continue
                out[path.relative_to(self.root).as_posix()] = (st.st_size, st.st_mtime_ns)
        return out

    def read(self, rel: str) -> bytes | None:
        path = self.root / rel
        try:
            return path.read_bytes() if path.is_file() else None
        except OSError:
            return None

    def write(self, rel: str, data: bytes) -> None:
        (self.root / rel).parent.mkdir(parents=True, exist_ok=True)
        write_atomic(self.root / rel, data)

    def locate(self, rel: str) -> str:
        return os.path.realpath(self.root / rel)

    def delete(self, rels: list[str]) -> None:
        parents = set()
        for rel in rels:
            (self.root / rel).unlink(missing_ok=True)
            parents.update(Path(rel).parents)
        for parent in sorted(parents, key=lambda p: len(p.parts), reverse=True):
            if parent.parts:  # never the root
                try:
                    (self.root / parent).rmdir()  # only when empty: a user's file keeps its directory
                except OSError:
                    pass
