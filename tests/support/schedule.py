"""Which tests share an xdist worker, and which start first: a pytest plugin (tests/conftest.py loads it).

scripts/test.sh runs the suite on two xdist workers with `--dist loadgroup --no-loadscope-reorder`, scheduled
by this plugin. A unit of work runs on one worker, one test at a time. A module's tests are one unit (its
module fixtures are built once), and two groups, each marked in the test modules, are units across modules:

- "cluster" (`pytest.mark.cluster`): the namespace cluster tests (tests/cluster, at a higher CPU priority
  than the other worker: tests/cluster/conftest.py).
- "ray" (`pytest.mark.ray`): the tests that start a local Ray instance (they share torchloom's private Ray
  directory): test_ray_local.py and test_engines.py whole (its reference run, a module fixture, is then
  built once: ~1 min of a core), and in test_tune.py and test_serve.py the tests that start Ray; the other
  tests of those modules stay in their module's unit (a module fixture that both use is built on both
  workers). A test marked both is "cluster"'s.

Those two groups are the longest, so they go first, "cluster" then "ray"; then the modules by the time their tests
took when it was last recorded (tests/durations.json, support/durations.py), longest first; a module with no record
yet: where `pytest.mark.heavy(n)` marks it, before the recorded ones by n (1 first), else as one of DEFAULT_S; equal
times in collection order. The markers are registered in pyproject.toml.

The suite keeps 2 cores busy with two workers (their summed test time is ~97% of twice the wall time): a third
worker (or the two cluster modules at once on a fourth) ran at a load of 8-15 and starved time-bound steps
(Ray Serve's start, a cluster's not-visible check, a Ray node's step).

How the groups reach the scheduler: xdist schedules in the controller process, which collects nothing: it
gets each worker's list of node ids, never the items or their markers. (xdist's own loadgroup reads
`xdist_group` marks into the ids through `item._nodeid`, which pytest 9.2 no longer uses: every test was its
own unit, and multi-host tests ran two at a time.) So each worker writes the unit of every test it collected
({node id: unit}, JSON) into a directory that the controller made and named in the workers' input
(pytest_configure_node), before it reports its collection; the scheduler reads it when it splits the
collection into units, and stops with an error if a test has no unit there. Without xdist the order holds.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import tempfile

import pytest

from support.durations import unit_seconds

GROUPS = ("cluster", "ray")  # the units across modules, the longest: first, in this order
_UNITS = "torchloom_units_dir"  # the key of the units' directory in the workers' input
_UNITS_DIR = pytest.StashKey[str]()


def unit_of(item: pytest.Item) -> str:
    """The unit of work a test belongs to: its group, or its module."""
    for group in GROUPS:
        if item.get_closest_marker(group) is not None:
            return group
    return item.nodeid.partition("::")[0]


DEFAULT_S = 20.0  # a module with no recorded time and no heavy mark: about this long
_RECORDED = unit_seconds()


def _rank(item: pytest.Item) -> tuple[int, float, float]:
    """Where a test starts: the groups in GROUPS' order, then the modules by recorded time, longest first (the
    module docstring)."""
    unit = unit_of(item)
    if unit in GROUPS:
        return GROUPS.index(unit), 0.0, 0.0
    if unit in _RECORDED:
        return len(GROUPS), -_RECORDED[unit], 0.0
    heavy = item.get_closest_marker("heavy")
    if heavy is not None:
        return len(GROUPS), -float("inf"), heavy.args[0] if heavy.args else float("inf")
    return len(GROUPS), -DEFAULT_S, 0.0


@pytest.hookimpl(trylast=True)  # after the deselection by -m and -k: the tests that run
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=_rank)  # stable: the order within stays
    where = getattr(config, "workerinput", {}).get(_UNITS)
    if where:  # an xdist worker of a `--dist loadgroup` run
        path = os.path.join(where, f"{config.workerinput['workerid']}.json")
        with open(f"{path}.part", "w") as f:
            json.dump({item.nodeid: unit_of(item) for item in items}, f)
        os.replace(f"{path}.part", path)


def _loadgroup(config: pytest.Config) -> bool:
    return config.getvalue("dist") == "loadgroup"


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:
    """The controller names the units' directory in each worker's input."""
    config = node.config
    if not _loadgroup(config):
        return
    if _UNITS_DIR not in config.stash:
        where = config.stash[_UNITS_DIR] = tempfile.mkdtemp(prefix="torchloom-xdist-units-")
        config.add_cleanup(lambda: shutil.rmtree(where, ignore_errors=True))
    node.workerinput[_UNITS] = config.stash[_UNITS_DIR]


def read_units(config: pytest.Config) -> dict[str, str]:
    units: dict[str, str] = {}
    for path in sorted(glob.glob(os.path.join(config.stash.get(_UNITS_DIR, ""), "*.json"))):
        with open(path) as f:
            units.update(json.load(f))
    return units


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """--dist loadgroup: xdist's scope scheduler, a scope being a unit (a group of GROUPS or one module)."""
    if not _loadgroup(config):
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByUnit(LoadScopeScheduling):
        units: dict[str, str] = {}

        def _split_scope(self, nodeid: str) -> str:
            if nodeid not in self.units:
                self.units = read_units(config)  # the workers wrote them before they reported their collection
            if nodeid not in self.units:
                raise RuntimeError(f"no xdist unit for {nodeid}: the workers write them into "
                                   f"{config.stash.get(_UNITS_DIR, '(no directory)')} (tests/support/schedule.py)")
            return self.units[nodeid]

        def _assign_work_unit(self, node) -> None:
            # xdist gives a worker its next unit while it still has 2 tests to run: behind the last tests of a
            # long unit (minutes each), the next would wait, so it gets the queue's last one, a small module
            behind_long = any(unit in GROUPS and not all(done.values())
                              for unit, done in self.assigned_work.get(node, {}).items())
            if behind_long and len(self.workqueue) > 1:
                self.workqueue.move_to_end(next(reversed(self.workqueue)), last=False)
            super()._assign_work_unit(node)

    return ByUnit(config, log)
