"""The one exception type a user sees as a one-line message (exit code 2, no traceback), and the one-line
rendering of any exception."""

from __future__ import annotations

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


def message_line(text: str) -> str:
    """The first line of a message ("" for an empty one)."""
    lines = str(text).strip().splitlines()
    return lines[0] if lines else ""


def first_line(e: BaseException) -> str:
    """An exception as one short line: its type and its message's first line, secrets masked."""
    line = message_line(redact_text(e))
    return f"{type(e).__name__}: {line}" if line else type(e).__name__


def missing_extra(module: str, extra: str) -> UserError:
    """The error for an optional engine that is not installed."""
    return UserError(f"{module} is not installed: pip install 'torchloom[{extra}]'")
