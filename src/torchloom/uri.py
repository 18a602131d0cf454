"""Storage URIs: which strings are one, their scheme, and the one rule for the credentials they may carry.
Standard library only, below everything that names a place (runs/rundir.py, store/storage.py, redaction.py, k8s/).

    has_scheme(s)   s starts with `scheme://` (file:// too): a URL, not a plain path
    is_uri(s)       a storage URI (s3://bucket/prefix, gs://, abfs://, hdfs://); file:// is a local path
    USERINFO        the `user:password@` after a scheme, wherever it stands in a text; an Azure URI's
                    `container@` (abfs://container@account.dfs.core.windows.net/path) names a container, no secret
    redact(uri)     a URI fit for a log line or a cache key: no userinfo, no query (presigned URLs carry keys)
    mask_userinfo   the same userinfo masked in free text (`scheme://***@host`: redaction.redact_text)
"""

from __future__ import annotations

import os
import re

SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")  # a URI's scheme, at its start
URI = SCHEME  # the name store/storage.py and store/errors.py read it by
USERINFO = re.compile(r"\b([A-Za-z][A-Za-z0-9+.-]*://)([^/@\s'\"]+)@")
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


def redact(uri: str) -> str:
    """A URI fit for a log line: no user:password@ part, no query string (presigned URLs carry keys); the same
    URI with or without credentials redacts alike (a staging directory's key, rundir.staging_dir)."""
    return USERINFO.sub(_userinfo(""), str(uri), count=1).split("?", 1)[0]
