"""The suite's Spark JVMs (tests only: a user's long ETL wants C2, and the product's own settings are unchanged).

Every Spark JVM a test starts runs C1 only, with the serial GC, without verifying Spark's own bytecode, and maps
a class-data-sharing archive of the classes a `torchloom prepare` loads, so it neither parses nor links them
again. Measured here (AMD EPYC, 2 cores): a local[1] session took ~31 CPU s, 17 with C1 only, 13.5 without the
verification too; a local-cluster of two executors 74 against 42 with C1 only; a `prepare` of 120 rows 33.5
against 25 with the archive. The suite's data is tiny, so C2's faster code never pays.

Drivers (the pytest workers' sessions, the CLI's, a Spark Connect server) read SPARK_SUBMIT_OPTS, which carries the
executors' options as spark.executor.defaultJavaOptions (Spark reads spark.* system properties as its conf);
standalone masters and workers read SPARK_DAEMON_JAVA_OPTS. SPARK_CONF_DIR stays unset: the JVM's class path
starts with it, and a non-empty directory there rules a class-data-sharing archive out.

The archive is built once per Java, pyspark and set of options, in the background of the first test run that
lacks it (~60 s of a core), into the virtual environment: `python tests/support/spark_jvm.py build ARCHIVE`.
JVMs started before it is there, or whose class path differs (a test's own SPARK_CONF_DIR), run without it,
silently.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import threading

OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC -XX:+UnlockDiagnosticVMOptions -XX:-BytecodeVerificationRemote"
QUIET = "-Xlog:cds=off -Xlog:cds+dynamic=off"  # a missing or mismatched archive is no line on stderr


def archive_path() -> str:
    """Where this Java's and pyspark's archive is (or will be): in the virtual environment, keyed by both (an
    install of either makes a new key)."""
    java = shutil.which("java", path=os.path.join(os.environ["JAVA_HOME"], "bin")) if os.environ.get("JAVA_HOME") \
        else shutil.which("java")
    try:  # the JVM checks the jars' sizes and times against the archive's: a reinstall needs a new one
        import pyspark

        jars = os.path.join(os.path.dirname(pyspark.__file__), "jars")
        spark = f"{pyspark.__version__} {os.stat(jars).st_mtime_ns}"
    except Exception:
        spark = "none"
    real = os.path.realpath(java) if java else "none"
    stamp = os.stat(real).st_mtime_ns if java else 0
    key = hashlib.sha256(f"{real} {stamp} {spark} {OPTIONS}".encode()).hexdigest()[:16]
    return os.path.join(sys.prefix, "spark-cds", f"spark-{key}.jsa")


def environment(archive: str) -> dict[str, str]:
    """The variables that give every Spark JVM of the suite its options (use_in_this_run sets them)."""
    jvm = f"{OPTIONS} -XX:SharedArchiveFile={archive} {QUIET}"
    return {"SPARK_SUBMIT_OPTS": f'{jvm} -Dspark.executor.defaultJavaOptions="{jvm}"', "SPARK_DAEMON_JAVA_OPTS": jvm}


def build_in_background(archive: str) -> None:
    """Build the archive in a thread of this process (the pytest controller), unless it is there already."""
    if os.path.exists(archive) or not shutil.which("java"):
        return
    os.makedirs(os.path.dirname(archive), exist_ok=True)

    def build() -> None:
        with open(f"{archive}.log", "w") as log:
            subprocess.run([sys.executable, os.path.abspath(__file__), "build", archive], stdout=log,
                           stderr=subprocess.STDOUT, timeout=900, check=False)

    threading.Thread(target=build, name="spark-cds", daemon=True).start()


# This run's archive: the pytest controller's, which its xdist workers inherit (TORCHLOOM_TEST_SPARK_CDS), else
# this host's. JVM_ENV: its variables; tests that build an environment for other hosts (a cluster's, a Spark
# Connect server's) keep them: `from support.spark_jvm import JVM_ENV`.
ARCHIVE = os.environ.get("TORCHLOOM_TEST_SPARK_CDS") or archive_path()
JVM_ENV = environment(ARCHIVE)


def use_in_this_run() -> None:
    """Give every Spark JVM this process starts the suite's options (tests/conftest.py calls it). The pytest
    controller also names the archive for its xdist workers and builds it in the background when it is
    missing."""
    os.environ.pop("SPARK_CONF_DIR", None)  # first on the JVM's class path: a directory with files there rules CDS out
    os.environ.update(JVM_ENV)
    if "PYTEST_XDIST_WORKER" not in os.environ and not os.environ.get("TORCHLOOM_TEST_SPARK_CDS"):
        os.environ["TORCHLOOM_TEST_SPARK_CDS"] = ARCHIVE  # the workers take this one
        build_in_background(ARCHIVE)


def _build(archive: str) -> None:
    """A `torchloom prepare` of a small CSV with the embedded model's tokenizer; the JVM writes the classes it
    loaded when it exits (System.exit: a JVM that is killed writes nothing), then the archive takes its name."""
    import csv
    import tempfile

    part = f"{archive}.part-{os.getpid()}"
    os.environ.pop("SPARK_CONF_DIR", None)
    os.environ["SPARK_SUBMIT_OPTS"] = f"{OPTIONS} -XX:ArchiveClassesAtExit={part} {QUIET}"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from pyspark import SparkContext

    from torchloom import cli

    with tempfile.TemporaryDirectory(prefix="torchloom-cds-") as tmp:
        data = os.path.join(tmp, "texts.csv")
        words = {"sport": "match goal team win league", "money": "bank market price shares profit",
                 "music": "album song band concert guitar"}
        with open(data, "w", newline="", encoding="utf-8") as f:
            csv.writer(f).writerows([["text", "label"], *([f"{v} number {i}", k] for k, v in words.items()
                                                         for i in range(40))])
        code = cli.main(["prepare", "--data.path", data, "--output.dir", os.path.join(tmp, "run"),
                         "--prepare.spark_master", "local[2]", "--tracking.enabled", "false"])
        gateway = SparkContext._gateway
        if code != 0 or gateway is None:
            raise SystemExit(f"prepare exited {code}: no archive")
        try:
            gateway.jvm.System.exit(0)
        except Exception:  # the JVM is gone before it answers
            pass
        gateway.proc.wait(timeout=300)
    if os.path.exists(part):
        os.replace(part, archive)


if __name__ == "__main__" and sys.argv[1:2] == ["build"]:
    _build(sys.argv[2])
