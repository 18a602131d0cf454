"""Files and directories under the temp directory that only this user can have made.

A fixed name in a shared /tmp can be planted by another local user (a symlink, a file of theirs, a
world-writable directory) before torchloom first runs. These helpers reuse a fixed name only when it
is a real file or directory owned by this user that nobody else can write; otherwise they make a new
one with mkstemp / mkdtemp, which no one else can have made.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path


def _ours(path: Path, kind: int, forbidden: int) -> bool:
    st = os.lstat(path)  # lstat: a symlink is never ours to follow
    return stat.S_IFMT(st.st_mode) == kind and st.st_uid == os.getuid() and not st.st_mode & forbidden


def private_dir(name: str) -> Path:
    """tempdir/name, made now (mode 0700) or made earlier by this user and private; else a new mkdtemp."""
    path = Path(tempfile.gettempdir()) / name
    try:
        path.mkdir(mode=0o700)
        return path
    except FileExistsError:
        pass
    if _ours(path, stat.S_IFDIR, 0o077):
        return path
    return Path(tempfile.mkdtemp(prefix=f"{name}-"))


def private_file(name: str, content: str) -> Path:
    """tempdir/name holding `content`, reused only if this user wrote it, no one else can write it and
    it holds `content`; else `content` in a new mkstemp file (a new name each time)."""
    path = Path(tempfile.gettempdir()) / name
    try:
        if _ours(path, stat.S_IFREG, 0o022) and path.read_text() == content:
            return path
    except (FileNotFoundError, UnicodeDecodeError):
        pass
    if not os.path.lexists(path):
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            f.write(content)
        os.chmod(tmp, 0o644)
        try:
            os.link(tmp, path)  # fails if someone made the name meanwhile: then use our own file
            os.unlink(tmp)
            return path
        except FileExistsError:
            return Path(tmp)
    fd, tmp = tempfile.mkstemp(prefix=f"{name}-")
    with os.fdopen(fd, "w") as f:
        f.write(content)
    return Path(tmp)
