"""The JVM under a classic SparkSession: its stderr while it starts, and a failed start said in one line."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import threading

from torchloom.config.schema import PrepareConfig
from torchloom.errors import UserError
from torchloom.java_errors import java_reason, short

# Lines the JVM prints that say nothing about the user's job (Spark 4 loads an incubator module; MLlib
# looks for a native BLAS).
FOREIGN_LINES = (b"WARNING: Using incubator modules",
                 b"netlib-blas: JNI_OnLoad")  # MLlib falls back to Java BLAS without libblas: no harm
HELD_MOST = 200  # lines held while the JVM starts; a start that says more is not failing quietly
# What the JVM or spark-class prints after the reason of a failed start, saying nothing more.
_NOISE = ("Error: A fatal exception has occurred", "Error: Could not create the Java Virtual Machine",
          "CMD: bad array subscript")


class JvmStderr:
    """fd 2 of the JVM: a pipe whose lines a thread forwards to the real stderr, all but the foreign ones
    (the JVM, and every process it starts, keeps writing there for its whole life). While the JVM starts
    the lines are held: a good start lets them out (`release`), a failed one keeps them for its one-line
    error (`failed`) and drops the rest."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.held: list[bytes] | None = []
        self.dropped = False
        self.ended = threading.Event()
        self.real: int | None = None

    def _pump(self, read_end: int) -> None:
        with os.fdopen(read_end, "rb") as lines:
            for line in lines:
                if line.startswith(FOREIGN_LINES):
                    continue
                with self.lock:
                    if self.held is not None and len(self.held) < HELD_MOST:
                        self.held.append(line)
                        continue
                    if self.dropped:
                        continue
                    if not self._write(line):
                        return
        self.ended.set()

    def _write(self, line: bytes) -> bool:
        try:
            os.write(self.real, line)
        except OSError:
            return False
        return True

    @contextlib.contextmanager
    def attached(self):
        """fd 2 is the pipe inside this block: the JVM started here inherits it."""
        try:
            self.real = os.dup(2)
            read_end, write_end = os.pipe()
        except OSError:
            self.held = None
            yield
            return
        threading.Thread(target=self._pump, args=(read_end,), name="torchloom-jvm-stderr", daemon=True).start()
        sys.stderr.flush()
        ours = os.dup(2)
        os.dup2(write_end, 2)
        os.close(write_end)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(ours, 2)  # this process writes to the real stderr again; the JVM keeps the pipe
            os.close(ours)

    def release(self) -> None:
        """The JVM started: what it said goes out, and from now on each line as it comes."""
        with self.lock:
            held, self.held = self.held or [], None
            for line in held:
                if not self._write(line):
                    break

    def failed(self, wait: float) -> list[str]:
        """The start failed: the lines held (after up to `wait` s for a JVM that exited to say its last);
        later lines are dropped."""
        self.ended.wait(wait)
        with self.lock:
            held, self.held, self.dropped = self.held or [], None, True
        return [line.decode("utf-8", "replace").rstrip() for line in held]


def start_errors() -> tuple[type[BaseException], ...]:
    """What a classic SparkSession's start raises for a JVM that would not start or a setting it refused."""
    from py4j.protocol import Py4JJavaError
    from pyspark.errors import PySparkRuntimeError
    from pyspark.errors.exceptions.captured import CapturedException

    return PySparkRuntimeError, Py4JJavaError, CapturedException


def gateway_exited(e: BaseException) -> bool:
    """pyspark's JAVA_GATEWAY_EXITED: the JVM ended before it answered."""
    condition = getattr(e, "getCondition", None) or getattr(e, "getErrorClass", None)
    return bool(condition) and condition() == "JAVA_GATEWAY_EXITED"


def start_failed(cfg: PrepareConfig, e: BaseException, jvm: JvmStderr) -> UserError | None:
    """The one-line error for a SparkSession that did not start (None: not a start failure; raise `e`)."""
    from pyspark.errors import PySparkRuntimeError

    if isinstance(e, PySparkRuntimeError):
        if not gateway_exited(e):
            return None
        lines = jvm.failed(wait=3.0)
        missing = java_missing()
        if missing:
            return UserError(missing)
        reason = jvm_reason(lines) or "it exited without saying why"
    else:
        jvm.failed(wait=0)
        reason = java_reason(e)
    fix = ("fix or remove that setting" if cfg.spark_conf else
           "check the Java install (Java 17 or 21; JAVA_HOME) and the SPARK_* environment")
    return UserError(f"{conf_input(cfg, reason)}: Spark did not start ({reason}); {fix}")


def java_missing() -> str | None:
    """Why spark-submit found no java (as bin/spark-class looks: $JAVA_HOME/bin/java, else java on PATH)."""
    home = os.environ.get("JAVA_HOME")
    fix = "install Java 17 or 21 (e.g. apt install openjdk-17-jre-headless)"
    if home:
        if os.access(os.path.join(home, "bin", "java"), os.X_OK):
            return None
        return (f"JAVA_HOME {home}: no bin/java there, and Spark needs Java; point JAVA_HOME at a Java 17 or 21"
               " install, or unset it to use the java on PATH")
    if shutil.which("java"):
        return None
    return f"java: not found (JAVA_HOME is unset and no java is on PATH), and Spark needs it; {fix} and set JAVA_HOME"


def jvm_reason(lines: list[str]) -> str:
    """The line of a JVM that exited at start which says why (not a stack frame, not the closing words)."""
    for line in lines:
        text = line.strip()
        if (text and not text.startswith(("at ", "...")) and not text.startswith(_NOISE)
                and not line.startswith(("\t", " "))):
            return short(text)
    return ""


def conf_input(cfg: PrepareConfig, reason: str) -> str:
    """The setting a failed start's reason names: a prepare.spark_conf key (by its name or its value),
    prepare.spark_conf as a whole, or, without one, the master."""
    for key, value in cfg.spark_conf.items():
        if str(key) in reason or (len(str(value)) >= 3 and str(value) in reason):
            return f"prepare.spark_conf {key}"
    return "prepare.spark_conf" if cfg.spark_conf else f"prepare.spark_master {cfg.spark_master}"
