"""A local directory as the ledger sees it (ledger.Tree): its files listed with their size and modification time,
read, written whole and deleted (symbolic links are entries of their own: never followed, never deleted through).
store_tree.StoreTree is the same for a prefix on a store."""

from __future__ import annotations

import os
from pathlib import Path

from torchloom.jsonio import write_atomic

Stat = tuple[int, int | None]  # (size, modification time in ns; None where a store lists none)


class LocalTree:
    """A local directory as a Tree."""

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

    def touch(self, rel: str) -> None:
        """A file's modification time moved to now (a command's beat: ledger.py), written first if missing."""
        try:
            os.utime(self.root / rel)
        except FileNotFoundError:
            self.write(rel, b"")

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
