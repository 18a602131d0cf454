"""Storage URIs: which strings are one, their scheme, and the one rule for the credentials they may carry.
Standard library only, below everything that names a place (runs/rundir.py, store/storage.py, redaction.py, k8s/).

    has_scheme(s)   s starts with `scheme://` (file:// too): a URL, not a plain path
    is_uri(s)       a storage URI (s3://bucket/prefix, gs://, abfs://, hdfs://); file:// is a local path
    USERINFO        the `user:password@` after a scheme, wherever it stands in a text, found as URL parsers find
                    it (SQLAlchemy's, libpq's): the user up to the first `:`, the password up to the `@` before
                    the host (a `/`, `+`, `=` or quote in it, as base64-made passwords hold, is the password's);
                    an Azure URI's `container@` (abfs://container@account.dfs.core.windows.net/path) names a
                    container, no secret
    passwords(v)    the passwords a value holds in its URLs (a space in one too): what redaction.remember masks
    redact(uri)     a URI fit for a log line or a cache key: no userinfo, no query (presigned URLs carry keys)
    mask_userinfo   the same userinfo masked in free text (`scheme://***@host`: redaction.redact_text)
"""

from __future__ import annotations

import os
import re

SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")  # a URI's scheme, at its start
URI = SCHEME  # the name store/storage.py and store/errors.py read it by
# scheme://, then user:password (the password anything but whitespace, up to the `@` after which a host without
# `@` or `/` ends the authority), or a user alone; the lookahead is that host's end.
_HOST_END = r"@(?=[^/@\s'\"?#]*(?:[/?#\s'\",;)\]>]|$))"
USERINFO = re.compile(r"\b([A-Za-z][A-Za-z0-9+.-]*://)((?:[^:/@\s'\"]*:\S*?)|[^:/@\s'\"]+)" + _HOST_END)
_VALUE_USERINFO = re.compile(r"\b([A-Za-z][A-Za-z0-9+.-]*://)([^:/@\s'\"]*):(.*?)" + _HOST_END)
CONTAINER_SCHEMES = ("abfs://", "abfss://", "wasb://", "wasbs://")
_CONTAINER_NAME = re.compile(r"[a-z0-9-]{3,63}")


def has_scheme(path: str | os.PathLike | None) -> bool:
    """`scheme://...`, file:// included: a URL rather than a plain path."""
    return SCHEME.match(str(path or "")) is not None


def is_uri(path: str | os.PathLike | None) -> bool:
    """A storage URI (s3://bucket/prefix, gs://, abfs://, hdfs://), not a local path (file:// is local)."""
    m = SCHEME.match(str(path or ""))
    return bool(m) and m.group(1).lower() != "file"


def is_container(scheme: str, userinfo: str) -> bool:
    """The part before `@` of an Azure URI names its container (a name of letters, digits and dashes)."""
    return scheme.lower() in CONTAINER_SCHEMES and _CONTAINER_NAME.fullmatch(userinfo) is not None


def _userinfo(replace: str):
    def sub(m: re.Match) -> str:
        return m.group(0) if is_container(m.group(1), m.group(2)) else f"{m.group(1)}{replace}"
    return sub


def mask_userinfo(text: str, mask: str = "***") -> str:
    """Every URI's userinfo in `text` masked: `scheme://***@host` (a container's name kept)."""
    return USERINFO.sub(_userinfo(f"{mask}@"), text)


def passwords(value: str) -> list[str]:
    """The passwords in a value's URLs (`scheme://user:PASSWORD@host`; the password may hold spaces and quotes
    here, where the value is one URL), an Azure container's name never."""
    m = _VALUE_USERINFO.match(str(value))
    return [m.group(3)] if m and m.group(3) and not is_container(m.group(1), f"{m.group(2)}:{m.group(3)}") else []


def has_credentials(uri: str) -> bool:
    """A URI that carries `user:password@` (or `user@`) before its host; an Azure container's name is none."""
    m = USERINFO.match(str(uri))
    return m is not None and not is_container(m.group(1), m.group(2))


def redact(uri: str) -> str:
    """A URI fit for a log line: no user:password@ part, no query string (presigned URLs carry keys); the same
    URI with or without credentials redacts alike (a staging directory's key, rundir.staging_dir)."""
    return USERINFO.sub(_userinfo(""), str(uri), count=1).split("?", 1)[0]
