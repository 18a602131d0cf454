"""A Java exception behind a Py4JJavaError, read for what a user can fix: its chain of causes, and the input
file a Spark task failed to read. Shared by prepare (etl/) and Spark batch scoring (serve/); py4j only, lazily."""

from __future__ import annotations

import re

from torchloom.errors import UserError, message_line

REASON_CHARS = 150  # of the JVM's reason in an error line: the input and the fix must fit beside it


def java_chain(e: BaseException) -> list[str]:
    """The Java exception behind a Py4JJavaError and its causes, outermost first, each as its class's simple
    name and its message's first line ("SparkException: [FAILED_READ_FILE.NO_HINT] ... reading file F. ...",
    ..., "EOFException: Unexpected end of input stream"); [] without a Java exception."""
    java = getattr(e, "java_exception", None)
    if java is None:
        return []
    from py4j.protocol import Py4JError

    chain: list[str] = []
    try:
        while java is not None and len(chain) < 20:
            message = java.getMessage()
            name = java.getClass().getSimpleName()
            chain.append(f"{name}: {message_line(str(message))}" if message else name)
            java = java.getCause()
    except Py4JError:  # the gateway went away
        pass
    return chain


def read_failure(chain: list[str]) -> str:
    """The file a Spark task failed to read (its FAILED_READ_FILE error) in a Java exception chain, or ""."""
    for line in chain:
        found = re.search(r"\[FAILED_READ_FILE\S*\] Encountered error while reading file (\S+?)\.?(?:\s|$)", line)
        if found:
            return found.group(1)
    return ""


def without_packages(line: str) -> str:
    """A Java error line with its exception classes by their simple names (java.io.EOFException: EOFException)."""
    return re.sub(r"\b(?:[a-z_$][\w$]*\.)+([A-Z][\w$]*(?:Exception|Error))\b", r"\1", line)


def unreadable_input(name: str, e: BaseException) -> UserError | None:
    """The one line for a Spark job that failed because a task could not read a file of the input `name`
    ("data.path D", "--input D") names (a .gz cut short, a damaged Parquet file): that file and the innermost
    cause, at most 90 characters. None for any other error."""
    chain = java_chain(e)
    failed = read_failure(chain)
    if not failed or len(chain) < 2:
        return None
    root = without_packages(chain[-1])
    root = root if len(root) <= 90 else root[:87] + "..."
    return UserError(f"{name}: Spark cannot read {failed} ({root}); replace that file (cut short, damaged, or not"
                     " what its name says) or move it out of the input")


def short(line: str) -> str:
    """A Java error line without package names, thread prefix or SQLSTATE, at most REASON_CHARS."""
    line = re.sub(r"^Exception in thread \"[^\"]*\" ", "", line.strip())
    line = re.sub(r"^\S*spark-class: line \d+: ", "", line)
    line = without_packages(line)
    line = re.sub(r"\s*SQLSTATE: \w+\.?$", "", line)
    return line if len(line) <= REASON_CHARS else line[:REASON_CHARS - 3] + "..."


def java_reason(e: BaseException) -> str:
    """The Java exception behind a Py4JJavaError (or pyspark's own copy of one) as one short line."""
    from py4j.protocol import Py4JError

    java = getattr(e, "java_exception", None)
    if java is not None:
        try:
            return short(message_line(java.toString()))
        except Py4JError:  # the gateway went away: the Python side's message says the same
            pass
    return short(message_line(str(e)))
