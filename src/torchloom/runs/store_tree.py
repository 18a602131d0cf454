"""A run's prefix on a store as the ledger sees it (ledger.Tree): its objects listed, read, written and deleted
through the store client. RunFiles.place.tree hands it to the ledger for a run on a store."""

from __future__ import annotations

from torchloom.runs import ledger
from torchloom.store import storage
from torchloom.uri import redact


class StoreTree:
    """A run's prefix on a store as the ledger sees it (ledger.Tree)."""

    exclusive = True  # the driver that writes it holds its lease (runs/lease.py)

    def __init__(self, remote: str):
        self.remote = remote
        self.where = redact(remote)

    def exists(self) -> bool:
        return True

    def inventory(self) -> dict[str, ledger.Stat]:
        return storage.list_objects(self.remote)

    def read(self, rel: str) -> bytes | None:
        try:
            return storage.read_bytes(storage.join(self.remote, rel))
        except FileNotFoundError:
            return None

    def write(self, rel: str, data: bytes) -> None:
        storage.write_bytes(storage.join(self.remote, rel), data)

    def touch(self, rel: str) -> None:
        """An object's modification time moved to the store's now (a command's beat: ledger.py): written again."""
        storage.write_bytes(storage.join(self.remote, rel), b"")

    def locate(self, rel: str) -> str:
        return storage.join(self.remote, rel)

    def delete(self, rels: list[str]) -> None:
        for rel in rels:
            storage.delete(storage.join(self.remote, rel))
