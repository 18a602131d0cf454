"""The owner of a run's files, wherever the run lives: the code that trains never asks where they are.

RunDir (runs/rundir.py) names the paths of a run; RunFiles moves them. A run in a local directory (or one every host
mounts at the same path) has nothing to move: every verb returns at once. A run on a store (`output.dir`
s3://..., gs://..., abfs://..., hdfs://..., or `file+store:///path`, a directory used as a store) lives there, and
each host works in a staging copy (RunDir.root); these verbs are the fixed points where files cross:

    ensure(paths)              before a stage reads: what this copy lacks, once the copy is of the store's run
    pull(paths)                the store's copy of these (a file of the same size is kept)
    refresh(files)             small files rewritten in place (a rank's heartbeat), downloaded again
    push(paths)                after a stage writes (a directory's meta.json / manifest.json last)
    push_as(file, path)        a local file to the store as the run's `path` (a rank's part of a checkpoint)
    write_through(path, text)  a small file on the store first, then here (a host cut off right after loses none)
    read(path) / write(path, data)   the file where the run lives (the store's object, not this copy's)
    delete(path)               here and on the store
    listing(path)              {name: size} of what the store holds under a path ({} for a local run)
    checkpoints.steps / .pull  the complete checkpoints where the run lives (runs/runfiles_checkpoints.py)
    streamed(manifest)         prepared data whose shards are read from the store (ranged reads)
    sync_copy / new_identity   the copy counts only while its record equals the store's (rundir.RUN_RECORD)
    drop_copy                  a fresh run on a store: this host's copy emptied
    adopt / pushing            a run worked on in this host's copy (a tune study): the store's taken, and pushed
                               as it goes and at the end
    checkpoints.uploader / .publish_part   rank 0's checkpoint uploads in the background, a rank's own part of
                               a checkpoint; None / nothing on a local run
    place.holds / .check_own / .replace / .tree / .recording   what the run holds where it lives, the own-prefix
                               rule, --overwrite (ledger.py: what torchloom wrote) and the ledger's view of the run
                               (runs/runfiles_prefix.py)

The two parts (`checkpoints`, `place`) are objects of their own that RunFiles holds, each over this run's verbs.

quiet=True: a failure is one warning line instead of an error (the driver judges the store by what it then sees);
wait=False: no retrying (the caller asks again within seconds anyway), and a quiet failure is not even a warning.

store/storage.py is the object-store client below this module; nothing outside RunFiles moves a run's files with it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from torchloom.errors import UserError, first_line
from torchloom.jsonio import write_atomic
from torchloom.runs import ledger
from torchloom.runs.rundir import RunDir
from torchloom.runs.runfiles_checkpoints import StoredCheckpoints
from torchloom.runs.runfiles_prefix import Place, check_local_dir
from torchloom.runs.runrecord import write_record
from torchloom.store import storage
from torchloom.store.errors import retrying_for, what_to_check
from torchloom.uri import has_scheme

# The file that says a directory is complete, uploaded after every other file of it.
COMPLETE_LAST = ("meta.json", "manifest.json")
# The files that say which version of a directory a copy holds: prepared data's manifest, an export's own record.
SUMMARIES = ("manifest.json", "torchloom.json")


class RunFiles:
    """A run's files (see the module's docstring). Cheap to make, and picklable: a worker makes its own."""

    def __init__(self, rd: RunDir | str | os.PathLike):
        self.rd = rd if isinstance(rd, RunDir) else RunDir(rd)
        self._remote = self.rd.remote
        self.checkpoints = StoredCheckpoints(self)  # the complete checkpoints where the run lives, their uploads
        self.place = Place(self)  # whose the place is: what it holds, the ledger's view, --overwrite

    def __repr__(self) -> str:
        return f"RunFiles({self.rd.where!r})"

    @classmethod
    def of(cls, run: RunFiles | RunDir | str | os.PathLike) -> RunFiles:
        """A run's files as they are, or those of a RunDir or a location (a Python caller of an engine's train)."""
        return run if isinstance(run, RunFiles) else cls(run)

    @property
    def on_store(self) -> bool:
        """The run lives on a store, and this host holds a copy of it (the protocol's few rules that differ:
        heartbeats carry their time, a worker that cannot see the data is told about credentials)."""
        return self._remote is not None

    def uri(self, path: str | Path) -> str:
        """Where the run's `path` lives on the store (for a client that reads it there: Spark's executors)."""
        assert self._remote is not None
        rel = Path(path).resolve().relative_to(self.rd.root).as_posix()
        return self._remote if rel == "." else storage.join(self._remote, rel)

    def stored(self, path: str | Path) -> str | None:
        """The store's URI of the run's `path`, for a client that writes or reads it there itself (a Spark cluster's
        executors, which do not see this host's copy); None for a local run, whose directory they share."""
        return None if self._remote is None else self.uri(path)

    # -- moving files -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _guard(self, action: str, paths, quiet: bool, wait: bool) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            if not wait:
                stack.enter_context(retrying_for(0))
            try:
                yield
            except Exception as e:
                if not quiet:
                    raise
                if wait:
                    print(f"torchloom: warning: could not {action} {', '.join(self.rd.home(p) for p in paths)}"
                          f" ({first_line(e)})", file=sys.stderr, flush=True)

    def push(self, *paths: str | Path, quiet: bool = False, wait: bool = True) -> int:
        """Upload these files or directories of the working copy to the store; returns the bytes sent."""
        sent = 0
        if self._remote is None:
            return sent
        with self._guard("upload", paths, quiet, wait):
            for p in map(Path, paths):
                if p.is_dir():  # never the run's ledger: the store's is the driver's (ledger.py), a copy's is stale
                    skip = ledger.SKIPPED if p.resolve() == self.rd.root.resolve() else ()
                    sent += storage.push_tree(p, self.uri(p), last=COMPLETE_LAST, skip=skip)
                elif p.is_file():
                    storage.upload(p, self.uri(p))
                    sent += p.stat().st_size
        return sent

    def push_as(self, local: str | Path, path: str | Path) -> None:
        """One local file to the store as the run's `path` (which this host need not hold)."""
        if self._remote is not None:
            storage.upload(local, self.uri(path))

    def pull(self, *paths: str | Path, quiet: bool = False, wait: bool = True) -> None:
        """Download these files or directories from the store into the working copy (what the store does not
        hold is left as it is; a file of the same size is kept)."""
        if self._remote is None:
            return
        with self._guard("read", paths, quiet, wait):
            for p in map(Path, paths):
                uri = self.uri(p)
                if storage.list_files(uri):  # never the run's ledger or lease: the store's, the driver's
                    storage.pull_tree(uri, p, skip=ledger.SKIPPED if p.resolve() == self.rd.root.resolve()
                                      else ())
                else:
                    with contextlib.suppress(FileNotFoundError):
                        storage.download(uri, p)

    def refresh(self, *files: str | Path, quiet: bool = False, wait: bool = True) -> None:
        """Download these small files again, whatever this copy holds (rewritten in place at the same size);
        a file the store does not hold is left as it is."""
        if self._remote is None:
            return
        with self._guard("read", files, quiet, wait):
            for p in map(Path, files):
                with contextlib.suppress(FileNotFoundError):
                    storage.download(self.uri(p), p)

    def ensure(self, *paths: str | Path) -> None:
        """Before a stage reads these: this copy holds the store's, once the copy is of the store's run. A file or
        directory the copy lacks is pulled; a directory it has is checked file by file against the store's listing
        (a host that streamed its shards holds data/ with the manifest alone), and taken again whole where its
        summary (manifest.json, torchloom.json) differs from the store's (a re-export made on another host)."""
        if self._remote is None:
            return
        self.sync_copy()
        for p in map(Path, paths):
            if not p.exists():
                self.pull(p)
            elif p.is_dir():
                self._mirror(p)

    def _mirror(self, local: Path) -> None:
        uri = self.uri(local)
        listing = storage.list_files(uri)
        if not listing:
            return  # the store holds none of it: the copy is what there is
        def differs(name: str) -> bool:
            mine = local / name
            return not mine.is_file() or mine.read_bytes() != storage.read_bytes(storage.join(uri, name))

        if any(differs(name) for name in SUMMARIES if name in listing):
            # another version of the directory: taken whole, then put in place
            tmp = local.with_name(f".{local.name}.{os.getpid()}.pull")
            shutil.rmtree(tmp, ignore_errors=True)
            storage.pull_tree(uri, tmp, only_if_changed=False)
            shutil.rmtree(local, ignore_errors=True)
            os.replace(tmp, local)
        elif any(not (local / rel).is_file() or (local / rel).stat().st_size != size for rel, size in listing.items()):
            storage.pull_tree(uri, local)  # what the copy lacks, or holds at another size

    def write_through(self, path: str | Path, text: str) -> None:
        """A small file on the store first, then in this copy: once the local file is there, so is the store's."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        if self._remote is None:
            path.write_text(text)
            return
        staged = path.with_name(f".{path.name}.{os.getpid()}.pending")
        staged.write_text(text)
        try:
            storage.upload(staged, self.uri(path))
            os.replace(staged, path)
        finally:
            staged.unlink(missing_ok=True)

    def delete(self, path: str | Path, here: bool = True) -> None:
        """A file or directory of the run, here and on the store (here=False: on the store alone, the copy's is
        kept: prepare's new data replacing the store's earlier shards, whatever their names)."""
        path = Path(path)
        if self._remote is not None:
            uri = self.uri(path)
            if storage.list_files(uri):
                storage.delete_tree(uri)
            else:
                storage.delete(uri)
        if not here:
            return
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)

    def listing(self, path: str | Path, quiet: bool = False, wait: bool = True) -> dict[str, int]:
        """{name relative to `path`: size} of what the store holds under the run's `path` ({} for a local run)."""
        if self._remote is None:
            return {}
        with self._guard("list", [path], quiet, wait):
            return storage.list_files(self.uri(path))
        return {}

    def read(self, path: str | Path) -> bytes | None:
        """The run's file `path` where the run lives (the store's object, never this copy's), or None."""
        if self._remote is None:
            return Path(path).read_bytes() if Path(path).is_file() else None
        try:
            return storage.read_bytes(self.uri(path))
        except FileNotFoundError:
            return None

    def write(self, path: str | Path, data: bytes) -> None:
        """The run's file `path` where the run lives, whole (the store's object; this copy is not written)."""
        if self._remote is None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, data)
        else:
            storage.write_bytes(self.uri(path), data)

    def check_writable(self, key: str = "output.dir") -> None:
        """Before any work: the store answers and these credentials may write and delete there, or a local
        directory can be made and written by this user (one line otherwise, within seconds; nothing is created to
        find out)."""
        if self._remote is not None:
            storage.check_writable(self._remote, key)
        else:
            check_local_dir(self.rd.root, key)

    def what_to_check(self) -> str:
        """For a line telling a host without access what to give it: this store's kind of credentials and endpoint
        (S3's, Google's or Azure's variables)."""
        return what_to_check(self._remote or "")

    def reachable(self, path: str | Path) -> bool:
        """Does this host reach the run's `path`: on the store (a host without its credentials does not), or for
        a local run in the directory (a host that does not mount it does not)?"""
        if self._remote is None:
            return Path(path).exists()
        try:
            return storage.exists(self.uri(path))
        except Exception:
            return False

    def modified(self, path: str | Path) -> dict[str, int | None]:
        """{name: modification time in ns} of what the store holds under the run's `path` ({} for a local run)."""
        if self._remote is None:
            return {}
        return {rel: mtime for rel, (_, mtime) in storage.list_objects(self.uri(path)).items()}

    def download(self, path: str | Path, into: str | Path, wait: bool = True) -> Path:
        """The store's copy of the run's file `path`, written to `into` (a private mirror, not the working copy)."""
        with self._guard("read", [path], False, wait):
            return storage.download(self.uri(path), into)

    # -- the run's identity ----------------------------------------------------------------------------
    def sync_copy(self) -> None:
        """This host's copy counts only for the run it was made from: when the store's record (made anew by every
        prepare, --overwrite and fresh train) differs from the copy's, the copy is emptied and takes the store's,
        so what a stage needs next is pulled again instead of an earlier run's files being trusted."""
        if self._remote is None:
            return
        rd = self.rd
        try:
            remote = storage.read_bytes(self.uri(rd.record))
        except FileNotFoundError:
            remote = None
        rd.root.parent.mkdir(parents=True, exist_ok=True)
        # The ranks of one host share its copy: one of them empties it, the others then find the store's record.
        with open(rd.root.with_name(f".{rd.root.name}.lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            local = rd.record.read_bytes() if rd.record.is_file() else None
            if remote == local:
                return
            if rd.root.is_dir():
                for entry in rd.root.iterdir():
                    if entry.is_dir() and not entry.is_symlink():
                        shutil.rmtree(entry, ignore_errors=True)
                    else:
                        entry.unlink(missing_ok=True)
            if remote is not None:
                rd.root.mkdir(parents=True, exist_ok=True)
                write_atomic(rd.record, remote)

    def adopt(self, overwrite: bool, inputs: list[str] = ()) -> None:
        """A run whose work happens in this host's copy (a tune study, whose trials are local runs in it): the copy
        takes the store's (a study resumed on another host goes on from what the store holds); overwrite: the
        store's own objects of the run are replaced instead (replace). A local run is its own copy: nothing."""
        if self._remote is None:
            return
        if overwrite:
            self.place.replace(inputs=inputs)
            return
        self.sync_copy()
        self.pull(self.rd.root)

    @contextlib.contextmanager
    def pushing(self, every_s: Callable[[], float], one_round: Callable[[], None],
                pushed: Callable[[], None] = lambda: None) -> Iterator[None]:
        """Around work done in this host's copy of a run on a store (a tune study): one_round() every every_s()
        seconds meanwhile (what has finished goes up as it goes), and the whole copy pushed when the block ends,
        whether it finished or not, then pushed(). A local run's block just runs."""
        if self._remote is None:
            yield
            return
        stop = threading.Event()

        def loop() -> None:
            while not stop.wait(every_s()):
                one_round()

        pusher = threading.Thread(target=loop, name="torchloom-push", daemon=True)
        pusher.start()
        try:
            yield
        finally:
            stop.set()
            pusher.join()
            self.push(self.rd.root)
            pushed()

    def drop_copy(self, path: str | Path | None = None, inputs: list[str] = ()) -> None:
        """A run on a store begun afresh: this host's staging copy (of `path`: a directory of the run, else all of
        it) is emptied, its files an earlier run's (the store's side is replaced by then, or refused). Only the
        copy in torchloom's private cache, never an input of the command (`inputs`: one there is refused in one
        line, nothing deleted). A local run's directory is the run itself: nothing happens (what replaces it there
        is the ledger's business)."""
        path = Path(path).resolve() if path is not None else self.rd.root.resolve()
        if self._remote is None or not path.exists():
            return
        path.relative_to(self.rd.root.resolve())  # a directory of this host's copy, nothing else
        held = [i for i in inputs if i and not has_scheme(i) and ledger.under_any(os.path.realpath(i), [str(path)])]
        if held:
            raise UserError(f"output.dir {self.rd.where}: not started afresh: this host's copy of it at {path} holds"
                            f" an input of the command ({held[0]}); move that input out of torchloom's cache")
        shutil.rmtree(path)

    def push_anew(self, path: str | Path, overwrite: bool, inputs: list[str] = ()) -> None:
        """A directory made anew in this copy (prepared data) goes up to the store (its manifest last); overwrite:
        it replaces the store's, whose earlier objects under it (only what torchloom wrote: replace) go first. A
        local run's directory is the new one already."""
        if self._remote is None:
            return
        if overwrite:
            self.place.replace(inputs=inputs, under=path)
        self.push(path)

    def new_identity(self) -> None:
        """A new record for the run (runrecord.write_record), on the store too: every other host's copy is void."""
        write_record(self.rd.root)
        self.push(self.rd.record)

    def catch_up_metrics(self, step: int) -> None:
        """Resumed at `step`: this copy's metrics.jsonl becomes the store's when it lacks the lines up to that step
        (they were written on another host), so the history is appended to, never replaced."""
        if self._remote is None:
            return
        steps = [r.get("step") or 0 for r in self.rd.metric_records()]
        if not steps or max(steps) < step:
            self.refresh(self.rd.metrics)

    def streamed(self, manifest):
        """Prepared data's manifest with the shards read from the store (ranged reads of the row groups asked
        for, never a whole download); a local run's manifest as it is."""
        if self._remote is None:
            return manifest
        from dataclasses import replace

        return replace(manifest, root=self.uri(self.rd.data))
