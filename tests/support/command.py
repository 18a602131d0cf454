"""The torchloom command as the tests run it: one runner, in this process by default.

`torchloom(*args)` is `cli.main(args)` with the environment and working directory it is given, its stdout and
stderr captured at the file descriptors (what the workers, the JVM and torchrun print is caught too) and its exit
code, as a `subprocess.CompletedProcess`. A command in this process costs no interpreter start, no torch import
and no JVM launch (pyspark keeps its gateway between SparkContexts), and whatever it changes of the process (the
environment, the working directory, signal handlers, warnings filters, the root logger, the store clients it
cached) is put back after it, as a fresh process would not have seen it.

`process=True` runs it as `python -m torchloom` instead: only where the process boundary is the subject (signals
sent to the command, two commands at once, a host's own start-up, what a fresh interpreter imports).
"""

from __future__ import annotations

import contextlib
import faulthandler
import io
import logging
import os
import signal
import subprocess
import sys
import tempfile
import traceback
import warnings
from pathlib import Path

BASE_ENV = {"HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def torchloom(*args: str, cache: Path | str | None = None, env: dict | None = None, cwd: Path | str | None = None,
              timeout: float = 600, process: bool = False, **more_env: str) -> subprocess.CompletedProcess:
    """`torchloom ARGS` with TORCHLOOM_CACHE=cache where given (a host that has seen only what that cache holds),
    the environment read now (a store fixture may have set AWS_*) plus `env` and `more_env` (a value None: that
    variable unset)."""
    extra = {**BASE_ENV, **(env or {}), **more_env}
    if cache is not None:
        extra["TORCHLOOM_CACHE"] = str(cache)
    if process:
        merged = {k: v for k, v in {**os.environ, **extra}.items() if v is not None}
        return subprocess.run([sys.executable, "-m", "torchloom", *args], capture_output=True, text=True,
                              timeout=timeout, env=merged, cwd=cwd)
    return in_process(list(args), extra, cwd, timeout)


def in_process(argv: list[str], env: dict, cwd, timeout: float) -> subprocess.CompletedProcess:
    from torchloom import cli

    with fresh_process_state(env, cwd), captured_fds() as (out, err):
        # a command that hangs prints every thread's stack and ends the test run, instead of the CI's clock
        faulthandler.dump_traceback_later(timeout, exit=True, file=sys.__stderr__)
        try:
            code = cli.main(argv)
        except SystemExit as e:  # argparse's usage errors, a sys.exit deep down
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:  # what an interpreter would print, and its exit status
            traceback.print_exc()
            code = 1
        finally:
            faulthandler.cancel_dump_traceback_later()
    return subprocess.CompletedProcess(["torchloom", *argv], code, out.getvalue(), err.getvalue())


@contextlib.contextmanager
def fresh_process_state(env: dict, cwd):
    saved_env = dict(os.environ)
    saved_cwd = os.getcwd()
    saved_signals = {s: signal.getsignal(s) for s in SIGNALS}
    root = logging.getLogger()
    saved_root = (root.level, list(root.handlers))
    saved_tempdir = tempfile.tempdir
    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = str(v)
    tempfile.tempdir = None  # TMPDIR read again, as a new process reads it
    forget_clients()
    stop_sessions()
    try:
        if cwd is not None:
            os.chdir(cwd)
        with warnings.catch_warnings():
            yield
    finally:
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
        for s, handler in saved_signals.items():
            if handler is not None:
                signal.signal(s, handler)
        root.setLevel(saved_root[0])
        root.handlers[:] = saved_root[1]
        tempfile.tempdir = saved_tempdir
        forget_clients()
        release_studies()


def stop_sessions() -> None:
    """A SparkSession a test left active stopped (the next one starts in the same JVM, in a second or two): a
    command would take it as its own, with its master and settings instead of those the command was given."""
    if "pyspark" in sys.modules:
        from torchloom.etl.session import stop_spark

        stop_spark()


def release_studies() -> None:
    """The shared locks a tune command holds on its studies until its process exits (tune/study.py's _HELD)."""
    study = sys.modules.get("torchloom.tune.study")
    while study is not None and study._HELD:
        study._HELD.pop().close()


def forget_clients() -> None:
    """The store clients a command cached (configured from the environment then: another test's S3 server)."""
    from torchloom.store import storage

    storage._filesystem.cache_clear()


class Captured:
    """What one descriptor received, read when the capture ends."""

    def __init__(self, f):
        self.f = f
        self.text = ""

    def read(self) -> None:
        self.f.seek(0)
        self.text = self.f.read().decode("utf-8", errors="replace")

    def getvalue(self) -> str:
        return self.text


@contextlib.contextmanager
def captured_fds():
    """fd 1 and 2 (and sys.stdout, sys.stderr over them) into two files for the duration."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        saved_fds = os.dup(1), os.dup(2)
        saved_streams = sys.stdout, sys.stderr
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        sys.stdout = io.TextIOWrapper(open(os.dup(1), "wb", buffering=0), encoding="utf-8", line_buffering=True,
                                      write_through=True)
        sys.stderr = io.TextIOWrapper(open(os.dup(2), "wb", buffering=0), encoding="utf-8", line_buffering=True,
                                      write_through=True)
        captured = Captured(out), Captured(err)
        try:
            yield captured
        finally:
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
                    stream.close()
            sys.stdout, sys.stderr = saved_streams
            os.dup2(saved_fds[0], 1)
            os.dup2(saved_fds[1], 2)
            os.close(saved_fds[0])
            os.close(saved_fds[1])
            for c in captured:
                c.read()
