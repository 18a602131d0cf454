"""A command's record in a tree's ledger (runs/ledger.py): opened before it writes anything, its beat touched while
it runs, closed with what it wrote when it ends, however it ends. A command killed before its end is settled by
the next one from that record alone.

    with recording(tree):            # begin: open in the ledger (pid, host, claims, what was someone else's)
        ...                          # the beat file touched every beat_s seconds (its entry's) from a thread
                                     # end: what it wrote (under its claims, not someone else's) listed
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from torchloom.runs.ledger import (
    ALL,
    LEDGER_FILE,
    Ledger,
    LocalTree,
    Open,
    Stat,
    Tree,
    killed_line,
    known,
    me,
    parse,
    snapshot,
)

_open: dict[str, int] = {}  # the trees a command of this process is recording, and how deeply nested
_open_lock = threading.Lock()


@contextmanager
def recording(tree: Tree, claims: tuple[str, ...] = (ALL,)) -> Iterator[None]:
    """Around a command that writes into `tree`: it is open in the ledger before it writes, and what it wrote is
    listed when it ends, whether it ends well or not. Nested uses on one tree (`run`'s stages) record once, at the
    outermost."""
    key = tree.where
    with _open_lock:
        depth = _open.get(key, 0)
        _open[key] = depth + 1
    try:
        if depth:
            yield
            return
        stock = begin(tree, claims)
        beat = Beat(tree, stock.me.beat, stock.me.beat_s) if stock.entry else None
        try:
            yield
        finally:
            if beat is not None:
                beat.stop()
            end(tree, stock)
    finally:
        with _open_lock:
            _open[key] -= 1
            if not _open[key]:
                del _open[key]


class Beat:
    """The open command's beat file, touched every `every` seconds (its entry's beat_s) from a thread until stop():
    the record that a killed command's files are judged by (written no later than its last beat, plus a slack)."""

    def __init__(self, tree: Tree, name: str, every: float):
        self.tree, self.name, self.every = tree, name, every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="torchloom-ledger-beat", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.every):
            try:
                self.tree.touch(self.name)
            except Exception:  # a store that does not answer for a moment: the next beat tries again
                pass

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


@dataclass
class Stock:
    """What a command found when it began (begin), for its end."""

    before: dict[str, Stat] = field(default_factory=dict)  # every file there
    ours: dict[str, Stat] = field(default_factory=dict)  # those the ledger (or markers) vouched for then
    me: Open = field(default_factory=me)  # this command as the ledger holds it (its foreign files, its claims)
    started: bool = False  # the ledger was begun by this command (the tree was new or empty)
    entry: bool = False  # this command is open in the tree's ledger (its beat runs)
    made: list[Path] = field(default_factory=list)  # the local directories its begin made, innermost first
    taken: bool = True  # False: the tree could not be read then (a store that did not answer)


def begin(tree: Tree, claims: tuple[str, ...] = (ALL,)) -> Stock:
    """Take stock, and open this command in the ledger at once, before it writes (a command killed before its end
    is settled by the next): in a tree that has a ledger, or a new or empty one; nothing is written into a tree that
    holds files but no ledger (it may be someone else's, and the command may yet refuse it). Killed commands found
    open are settled now: what their record covers is torchloom's, the rest is named in one line and left."""
    try:
        inventory, beats = snapshot(tree)
        found = known(tree, inventory, beats)
        foreign = {rel: st for rel, st in inventory.items() if found.ours.get(rel) != st}
        started = found.ledger is None and not inventory
        made = []
        if isinstance(tree, LocalTree):
            made = [p for p in (tree.root.absolute(), *tree.root.absolute().parents) if not p.exists()]
        this = me(claims, foreign)
        stock = Stock(inventory, found.ours, this, started, False, made)
        if found.ledger is not None or started:
            opened = found.ledger.open if found.ledger else []
            live = [o for o in opened if o.alive(beats, tree.exclusive)]
            tree.touch(this.beat)  # the beat first: a command that reads the ledger next finds it alive
            tree.write(LEDGER_FILE, Ledger(found.ours, [*live, this]).dumps())
            stock.entry = True
            gone = [o.beat for o in opened if o not in live and o.beat in beats]
            if gone:
                tree.delete(gone)
            if found.late:
                print(f"torchloom: note: {killed_line(tree.where, found.late, beats)}", file=sys.stderr, flush=True)
        return stock
    except Exception:  # a store that does not answer: the stage's own check says so, in one line
        return Stock(taken=False)


def end(tree: Tree, stock: Stock) -> None:
    """List what this command wrote: every file under its claims that was not someone else's at its begin. Nothing
    is left where the command wrote nothing (a refusal leaves a user's directory as it was; a ledger this command
    began in an empty tree goes again)."""
    if not stock.taken:
        return
    try:
        if not tree.exists():
            return
        inventory, beats = snapshot(tree)
        ledger = parse(tree.read(LEDGER_FILE))
        mine = stock.me
        if inventory == stock.before and (stock.started or ledger is None):
            if stock.started and ledger is not None and all(o.same(mine) for o in ledger.open):
                tree.delete([LEDGER_FILE, mine.beat])
                for made in stock.made:  # innermost first; only where nothing else came meanwhile
                    try:
                        made.rmdir()
                    except OSError:
                        break
            return
        others = [o for o in (ledger.open if ledger else []) if not o.same(mine)]
        base = ledger.files if ledger is not None else stock.ours  # before ledgers: what its markers vouched for
        files = {rel: st for rel, st in base.items() if inventory.get(rel) == st}
        files |= {rel: st for rel, st in inventory.items() if rel not in files and mine.writes(rel, st)}
        tree.write(LEDGER_FILE, Ledger(files, others).dumps())
        if mine.beat in beats:
            tree.delete([mine.beat])
    except Exception as e:
        _warn(tree, e)


def _warn(tree: Tree, e: Exception) -> None:
    from torchloom.errors import first_line

    print(f"torchloom: warning: {tree.where}: could not update {LEDGER_FILE} ({first_line(e)}); --overwrite will"
          " not delete what this command wrote there", file=sys.stderr, flush=True)
