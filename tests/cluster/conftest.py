"""The namespace cluster tests run at a higher CPU priority than the rest of the suite."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="module", autouse=True)
def cluster_priority():
    """The suite's other worker shares these cores (scripts/test.sh), while a cluster's hosts stand for machines
    of their own: their heartbeats, health checks and collectives must not wait behind unrelated tests. So this
    worker, and every host process it starts (they inherit it), runs at niceness -10 while a cluster module
    runs (as root; otherwise as it is)."""
    before = os.getpriority(os.PRIO_PROCESS, 0)
    try:
        os.setpriority(os.PRIO_PROCESS, 0, -10)
    except PermissionError:
        yield
        return
    try:
        yield
    finally:
        os.setpriority(os.PRIO_PROCESS, 0, before)
