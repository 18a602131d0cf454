"""The one exception type a user sees as a one-line message (exit code 2, no traceback), and the one-line
rendering of any exception."""

from __future__ import annotations

import argparse

from torchloom.redaction import redact_text


class UserError(Exception):
    """Bad input from the user: names the input, the problem and the fix."""

    exit_code = 2


LINE_LIMIT = 300  # an error line a terminal shows whole


def one_line(message: str, limit: int = LINE_LIMIT) -> str:
    """`message` as one line of at most `limit` characters: long embedded values (a path, a pasted text,
    a column name) are cut in their middle first, so the input, the problem and the fix all stay."""
    line = " ".join(redact_text(message).split())
    prefix = len("torchloom: error: ")
    if len(line) + prefix <= limit:
        return line
    words = line.split(" ")
    # First a long value said again (a path and a file under it): its first mention stays whole.
    seen: list[str] = []
    for i, w in enumerate(words):
        if len(w) > 40 and any(w.startswith(s[:40]) for s in seen):
            words[i] = f"{w[:12]}...{w[-24:]}"
        elif len(w) > 40:
            seen.append(w)
    line = " ".join(words)
    if len(line) + prefix <= limit:
        return line
    for width in (80, 48, 24):
        words = [w if len(w) <= width else f"{w[:width // 2 - 1]}...{w[-(width // 2 - 2):]}" for w in words]
        line = " ".join(words)
        if len(line) + prefix <= limit:
            return line
    keep = limit - prefix - 3
    return f"{line[:keep // 2]}...{line[-(keep - keep // 2):]}"


def clipped(text: str, limit: int = 160) -> str:
    """`text` of at most `limit` characters, cut at a word's end ("..." said), never inside a word."""
    text = " ".join(str(text).split())
    if len(text) <= limit:
        return text
    cut = text[:limit - 3].rsplit(" ", 1)[0] if " " in text[:limit - 3] else text[:limit - 3]
    return cut.rstrip(",;:") + "..."


def message_line(text: str) -> str:
    """The first line of a message ("" for an empty one)."""
    lines = str(text).strip().splitlines()
    return lines[0] if lines else ""


def first_line(e: BaseException) -> str:
    """An exception as one short line: its type and its message's first line, secrets masked."""
    line = message_line(redact_text(e))
    return f"{type(e).__name__}: {line}" if line else type(e).__name__


# What each extra of pyproject.toml installs (tests/test_cli.py holds them equal). Install hints name these
# packages, never `torchloom[extra]`: torchloom is not on PyPI, and a name there could be anyone's.
EXTRAS = {
    "spark": "'pyspark>=4.0,<5' 'pandas>=2.2' 'grpcio-status>=1.67' 'zstandard>=0.23'",
    "ray": "'ray[train,tune]>=2.40' 'optuna>=4.0'",
    "tune": "'optuna>=4.0'",
    "serve": "'fastapi>=0.110' 'uvicorn[standard]>=0.29' 'ray[serve]>=2.40' 'httpx>=0.27' 'aiohttp>=3.9'"
             " 'prometheus-client>=0.20'",
    "track": "'mlflow-skinny>=3.0' 'pandas>=2.2'",
    "onnx": "'onnxruntime>=1.20' 'onnx>=1.17' 'onnxscript>=0.5'",
    "k8s": "'kubernetes>=30'",
    "tables": "'deltalake>=1.0' 'pyiceberg[sql-sqlite]>=0.10'",
    "postgres": "'psycopg[binary]>=3.1'",
}


def install_hint(extra: str) -> str:
    """`pip install ...` of an extra's packages (from a checkout, `pip install -e '.[extra]'` does the same)."""
    return f"pip install {EXTRAS[extra]}"


def missing_extra(module: str, extra: str) -> UserError:
    """The error for an optional engine that is not installed."""
    return UserError(f"{module} is not installed: {install_hint(extra)}")


class OneLineArgs(argparse.ArgumentParser):
    """argparse whose usage errors are torchloom's one line: `<command>: <message>; see <prog> --help`."""

    def error(self, message: str):
        raise UserError(f"{self.prog.removeprefix('torchloom ')}: {message}; see {self.prog} --help")
