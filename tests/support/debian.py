"""Debian's servers and tools for the tests that need them (Prometheus, Chromium, PostgreSQL): installed with
apt-get when missing, as CI's fresh machine needs; one install at a time across xdist workers."""

from __future__ import annotations

import fcntl
import shutil
import subprocess

import pytest

LOCK = "/tmp/torchloom-tests-apt.lock"


def ensure(binary: str, package: str) -> str:
    """The path of `binary`, installing Debian's `package` first when it is missing."""
    found = shutil.which(binary)
    if found:
        return found
    install(package, lambda: shutil.which(binary) is not None, binary)
    found = shutil.which(binary)
    assert found, f"{package} installed, yet no {binary} on PATH"
    return found


def install(package: str, present, what: str) -> None:
    """apt-get install `package` unless `present()` says it is there (asked again once this process holds the lock:
    another xdist worker may have installed it meanwhile)."""
    with open(LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if present():
            return
        env = {"DEBIAN_FRONTEND": "noninteractive", "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
        command = ["apt-get", "install", "-y", "-q", package]  # with its recommends, as verified (fonts)
        done = subprocess.run(command, capture_output=True, text=True, env=env)
        if done.returncode != 0:  # a fresh machine's package lists may be missing or stale
            subprocess.run(["apt-get", "update", "-q"], capture_output=True, text=True, env=env)
            done = subprocess.run(command, capture_output=True, text=True, env=env)
        if done.returncode != 0:
            pytest.fail(f"apt-get install {package} failed (the test needs {what}):\n{done.stderr[-2000:]}")
