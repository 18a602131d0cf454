"""Tests that measure themselves: every run records each test's time (setup, call and teardown) and each unit's
(a module, or a group of support/schedule.py) in `.pytest-durations.json` at the repo's root; the scheduler orders
the units by the times recorded in tests/durations.json, longest first; the summary prints the 20 slowest units and
one line when the suite's total test time is over the budget recorded there (a line, never a failure).

    python tests/support/durations.py update     # the last run's times become tests/durations.json (commit it)
    python tests/support/durations.py show       # the recorded units, slowest first

A pytest plugin (tests/conftest.py loads it after schedule.py); standard library only.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RECORDED = ROOT / "tests" / "durations.json"  # committed: what the scheduler and the budget read
MEASURED = ROOT / ".pytest-durations.json"  # every run's own, not committed
SLACK = 1.10  # the budget: the recorded total plus 10 %


def recorded() -> dict:
    try:
        return json.loads(RECORDED.read_text())
    except (OSError, ValueError):
        return {}


def unit_seconds() -> dict[str, float]:
    """{unit: seconds} as recorded (empty before the first record)."""
    return {u: float(s) for u, s in recorded().get("units", {}).items()}


def cpu() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        fields = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in out.splitlines())}
        flags = fields.get("Flags", "").split()
        kind = "AMX" if "amx_bf16" in flags else "AVX512-BF16" if "avx512_bf16" in flags else "AVX2 only"
        return (f"{fields['Model name']} (family {fields.get('CPU family')}, model {fields.get('Model')}, {kind},"
                f" {os.cpu_count()} cores)")
    except (OSError, KeyError, subprocess.SubprocessError):
        return platform.processor() or platform.machine()


class Timer:
    """The controller's (or a lone process's) record of every test's time, by the reports it receives."""

    def __init__(self) -> None:
        self.tests: dict[str, float] = {}
        self.started = time.monotonic()

    def add(self, report) -> None:
        self.tests[report.nodeid] = self.tests.get(report.nodeid, 0.0) + float(getattr(report, "duration", 0.0))

    def units(self, unit_of) -> dict[str, float]:
        out: dict[str, float] = {}
        for nodeid, seconds in self.tests.items():
            unit = unit_of(nodeid)
            out[unit] = out.get(unit, 0.0) + seconds
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))


_TIMER = pytest.StashKey[Timer]()


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # the controller, or a run without xdist
        config.stash[_TIMER] = Timer()


def pytest_runtest_logreport(report) -> None:
    timer = _timer()
    if timer is not None:
        timer.add(report)


_CONFIG: list[pytest.Config] = []


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    _CONFIG[:] = [session.config]


def _timer() -> Timer | None:
    return _CONFIG[0].stash.get(_TIMER, None) if _CONFIG else None


def _unit_of(config: pytest.Config):
    from support.schedule import read_units

    units = read_units(config)
    return lambda nodeid: units.get(nodeid, nodeid.partition("::")[0])


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    timer = session.config.stash.get(_TIMER, None)
    if timer is None or not timer.tests:
        return
    units = timer.units(_unit_of(session.config))
    data = {"recorded": time.strftime("%Y-%m-%d"), "cpu": cpu(), "cores": os.cpu_count(),
            "workers": os.environ.get("PYTEST_XDIST_WORKER_COUNT") or session.config.getoption("numprocesses", None),
            "wall_s": round(time.monotonic() - timer.started, 1), "total_s": round(sum(units.values()), 1),
            "tests_run": len(timer.tests), "units": {u: round(s, 1) for u, s in units.items()},
            "tests": {t: round(s, 2) for t, s in sorted(timer.tests.items(), key=lambda kv: -kv[1])}}
    MEASURED.write_text(json.dumps(data, indent=1) + "\n")


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    timer = config.stash.get(_TIMER, None)
    if timer is None or len(timer.tests) < 50:  # a whole suite's run, not one module's
        return
    units = timer.units(_unit_of(config))
    write = terminalreporter.write_line
    write("slowest 20 units (module or group; seconds of test time, the sum of their tests' setup, call, teardown):")
    for unit, seconds in list(units.items())[:20]:
        write(f"  {seconds:8.1f}  {unit}")
    total = sum(units.values())
    budget = recorded().get("total_s")
    if budget and len(timer.tests) >= 0.9 * float(recorded().get("tests_run") or 0):  # the whole suite ran
        over = total - float(budget) * SLACK
        state = f"over the budget by {over:.0f} s" if over > 0 else "within the budget"
        write(f"torchloom: test time {total:.0f} s, {state} ({float(budget) * SLACK:.0f} s: {RECORDED.name}'s"
              f" {float(budget):.0f} s recorded {recorded().get('recorded')} on {recorded().get('cpu')}, plus"
              f" {round((SLACK - 1) * 100)} %); times of this run in {MEASURED.name}")


def main(argv: list[str]) -> int:
    if argv[:1] == ["update"]:
        if not MEASURED.is_file():
            print(f"{MEASURED}: no run recorded yet; run bash scripts/test.sh first", file=sys.stderr)
            return 2
        RECORDED.write_text(MEASURED.read_text())
        print(f"{RECORDED}: {json.loads(RECORDED.read_text())['total_s']} s of test time recorded")
        return 0
    if argv[:1] == ["show"]:
        data = recorded()
        print(f"recorded {data.get('recorded')} on {data.get('cpu')}: {data.get('total_s')} s of test time,"
              f" {data.get('wall_s')} s wall")
        for unit, seconds in data.get("units", {}).items():
            print(f"{seconds:8.1f}  {unit}")
        return 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
