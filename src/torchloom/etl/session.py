"""The Spark session prepare runs on: quiet, local-friendly defaults, the venv's Python on the workers."""

from __future__ import annotations

import hashlib
import os
import re
import sys
import warnings

from torchloom.config.schema import PrepareConfig
from torchloom.errors import UserError, first_line, install_hint, missing_extra
from torchloom.etl.jvm import JvmStderr, start_errors, start_failed
from torchloom.machine import usable_cores
from torchloom.private import private_file

# Only warnings and errors reach the console; the native-hadoop warning is noise on every start, and a failed
# task's shuffle files that are already gone are 200 lines of "Error deleting". A standalone Master logs in this
# JVM only under local-cluster[...], where it warns that an app "requires more resource than any of Workers could
# have" whenever the app registers before the in-process worker has (a start-up race, not a shortage).
_LOG4J2 = """\
rootLogger.level = warn
rootLogger.appenderRef.stdout.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{yy/MM/dd HH:mm:ss} %p %c{1}: %m%n%ex
logger.hadoop.name = org.apache.hadoop.util.NativeCodeLoader
logger.hadoop.level = error
logger.parquet.name = org.apache.parquet
logger.parquet.level = error
logger.sparkenv.name = org.apache.spark.SparkEnv
logger.sparkenv.level = error
logger.filesink.name = org.apache.spark.sql.execution.streaming.sinks.FileStreamSink
logger.filesink.level = error
logger.standalone.name = org.apache.spark.scheduler.cluster.StandaloneSchedulerBackend$StandaloneDriverEndpoint
logger.standalone.level = error
logger.dagscheduler.name = org.apache.spark.scheduler.DAGScheduler
logger.dagscheduler.level = error
logger.blas.name = dev.ludovic.netlib
logger.blas.level = error
logger.blockwriter.name = org.apache.spark.storage.DiskBlockObjectWriter
logger.blockwriter.level = error
logger.master.name = org.apache.spark.deploy.master.Master
logger.master.level = error
"""


# A local master runs its tasks in this JVM: a failed task's stack trace (Executor's ERROR, TaskSetManager's WARN
# and ERROR; for a write also Utils' "Aborting task" and FileFormatWriter's) came before the job's error, which
# holds the same trace and which torchloom turns into one line (a corrupt .gz input: 188 lines, then the line).
# On a cluster the driver's TaskSetManager says which host lost which task and retries it: kept there.
_LOCAL_TASKS = """\
logger.executor.name = org.apache.spark.executor.Executor
logger.executor.level = off
logger.tasksets.name = org.apache.spark.scheduler.TaskSetManager
logger.tasksets.level = off
logger.writer.name = org.apache.spark.sql.execution.datasources.FileFormatWriter
logger.writer.level = off
logger.utils.name = org.apache.spark.util.Utils
logger.utils.level = warn
logger.utils.filter.aborting.type = RegexFilter
logger.utils.filter.aborting.regex = Aborting task
logger.utils.filter.aborting.onMatch = DENY
logger.utils.filter.aborting.onMismatch = NEUTRAL
"""


def _log4j_file(local: bool = False) -> str:
    text = _LOG4J2 + (_LOCAL_TASKS if local else "")
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]  # a changed config gets a new file
    return str(private_file(f"torchloom-log4j2-{os.getuid()}-{digest}.properties", text))


def is_connect(master: str) -> bool:
    """sc://host:port: a Spark Connect server; this process is a client, with no JVM of its own."""
    return master.strip().startswith("sc://")


def conf_value(spark, key: str, default: str = "") -> str:
    """A Spark conf value from the session (classic or Connect: no SparkContext needed)."""
    try:
        value = spark.conf.get(key, default)
    except Exception:  # Connect raises for a key the server does not know, default or not
        return default
    return default if value is None else str(value)


def default_parallelism(spark, fallback: int) -> int:
    """The cluster's default parallelism; under Spark Connect (no SparkContext) spark.default.parallelism
    if the server sets it, else `fallback`."""
    try:
        return int(spark.sparkContext.defaultParallelism)
    except Exception:
        return int(conf_value(spark, "spark.default.parallelism", "0") or 0) or fallback


def is_local_master(master: str) -> bool:
    """local and local[N]: the tasks run in the driver's JVM (local-cluster has executor JVMs of its own)."""
    master = master.strip()
    return master == "local" or master.startswith("local[")


def local_cores(master: str) -> int:
    """Cores a local master uses (local[N], local[*], local); the cores this process may use for anything else."""
    m = re.fullmatch(r"local(?:\[(\d+|\*)(?:,\d+)?\])?", master.strip())
    if m and m.group(1) and m.group(1) != "*":
        return int(m.group(1))
    if m and m.group(1) is None:
        return 1
    return usable_cores()


def default_partitions(cfg: PrepareConfig) -> int:
    """Output shards per split (at most; see prepare) and the width of small jobs: prepare.partitions,
    else 2 x cores."""
    return cfg.partitions or 2 * local_cores(cfg.spark_master)


# Shuffles start this wide with prepare.partitions 0, and Spark's adaptive execution merges them to
# its advisory size (64 MB) at run time: a few tasks for a small input, many for a big one. A fixed
# 2 x cores made 10 million rows on 2 cores two 1.3 GB partitions, and the 1 GB local JVM ran out of
# heap (benchmarks/scale.py, docs/benchmarks.md "Scale").
SHUFFLE_PARTITIONS = 200


def shuffle_partitions(cfg: PrepareConfig) -> int:
    return cfg.partitions or max(SHUFFLE_PARTITIONS, 2 * local_cores(cfg.spark_master))


def local_heap_gb() -> int:
    """The local JVM's heap: a quarter of this machine's memory, 1 to 8 GB."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1
    return max(1, min(8, int(total / 4 / 2**30)))


ADAPTIVE = {"spark.sql.adaptive.enabled": "true", "spark.sql.adaptive.coalescePartitions.enabled": "true",
            # Else adaptive execution leaves a cached plan's shuffles at their 200 partitions: prepare caches
            # the cleaned rows, and every job over them ran 200 tasks (the demo's read and split jobs 2 tasks
            # each with this, 200 without; ~20 s of task overhead on 2 cores).
            "spark.sql.optimizer.canChangeCachedPlanOutputPartitioning": "true"}


def get_spark(cfg: PrepareConfig | None = None):
    """The active SparkSession, or a new one configured from `cfg` (app name torchloom)."""
    try:
        from pyspark.sql import SparkSession
    except ImportError:
        raise missing_extra("pyspark", "spark") from None

    cfg = cfg or PrepareConfig()
    active = SparkSession.getActiveSession()
    if active is not None:
        if cfg.partitions:
            active.conf.set("spark.sql.shuffle.partitions", str(cfg.partitions))
        return active

    # Spark's Python workers would run `python3` from PATH, not this interpreter (see PITFALLS.md).
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    if cfg.spark_here:
        # Else Spark binds the machine's external address (see PITFALLS.md). Never for a cluster master:
        # there the driver must advertise an address the executors can reach (its host name's, or the
        # SPARK_LOCAL_IP / spark.driver.host the user sets).
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")

    if is_connect(cfg.spark_master):
        return _connect(cfg)
    return _classic(cfg)


def stop_spark() -> None:
    """The active SparkSession stopped, if there is one: its JVM would keep memory and wake-ups from the workers."""
    try:
        from pyspark.sql import SparkSession
    except ImportError:
        return
    active = SparkSession.getActiveSession()
    if active is not None:
        active.stop()


def _classic_conf(cfg: PrepareConfig) -> dict[str, str]:
    log4j = _log4j_file(local=is_local_master(cfg.spark_master))
    conf = {
        "spark.app.name": "torchloom",
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.shuffle.partitions": str(shuffle_partitions(cfg)),
        **ADAPTIVE,
        "spark.sql.session.timeZone": "UTC",
        # Spark counts each file as 4 MB when packing files into tasks: a folder of small .txt files
        # became ~70 tasks for 5 MB (BBC News) and 6x slower; 64 KB packs them by their real size.
        "spark.sql.files.openCostInBytes": str(64 * 1024),
        "spark.driver.extraJavaOptions": f"-Dlog4j2.configurationFile=file:{log4j}",
    }
    if cfg.spark_here and not os.environ.get("PYSPARK_SUBMIT_ARGS"):
        # Spark's own default is a 1 GB heap for the local JVM, which holds the driver and every
        # executor: 10 million rows ran it out of memory while caching the cleaned rows
        # (docs/benchmarks.md, "Scale"). A quarter of the machine, 1 to 8 GB; spark_conf overrides.
        conf["spark.driver.memory"] = f"{local_heap_gb()}g"
    conf.update({str(k): str(v) for k, v in cfg.spark_conf.items()})
    return conf


def _stop_half_started(keys) -> None:
    """A start that failed once the JVM was up: a SparkContext it made stopped, and the settings it was launched
    with (pyspark hands them to the JVM as system properties, which every later SparkConf of this process reads)
    taken back, so the next session of this process starts with its own settings instead of failing on these."""
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    half = SparkSession._instantiatedSession  # made, then its SQL state refused a setting
    try:
        if half is not None:
            half.stop()  # its context too, and pyspark forgets both
        elif SparkContext._active_spark_context is not None:
            SparkContext._active_spark_context.stop()
    except Exception:  # noqa: BLE001 - a context that cannot stop is gone with its JVM anyway
        pass
    if SparkContext._jvm is not None:
        for key in keys:
            try:
                SparkContext._jvm.java.lang.System.clearProperty(key)
            except Exception:  # noqa: BLE001 - a JVM that is gone holds nothing
                break


def _classic(cfg: PrepareConfig):
    """A SparkSession with a JVM of its own; a JVM that does not start (no Java, a setting it refuses) is
    one line naming the setting, with the JVM's own reason."""
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.master(cfg.spark_master)
    conf = _classic_conf(cfg)
    for key, value in conf.items():
        builder = builder.config(key, value)
    jvm = JvmStderr()
    try:
        with warnings.catch_warnings(), jvm.attached():
            # pyspark imports its test helpers on start-up, which warn that pandas 3 is not fully supported.
            warnings.filterwarnings("ignore", "PySpark does not yet fully support pandas", FutureWarning)
            spark = builder.getOrCreate()
            spark.conf.get("spark.sql.session.timeZone")  # builds the SQL session state: a bad SQL setting fails here
    except start_errors() as e:
        _stop_half_started(conf)
        error = start_failed(cfg, e, jvm)
        if error is None:
            raise
        raise error from None
    finally:
        jvm.release()
    spark.sparkContext.setLogLevel("WARN")
    return spark


def _connect(cfg: PrepareConfig):
    """A Spark Connect session: the server owns the cluster and its static conf; only runtime (SQL)
    options can be set from here."""
    import inspect

    from pyspark.sql import SparkSession

    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "PySpark does not yet fully support pandas", FutureWarning)
            from pyspark.sql.connect.utils import check_dependencies

            check_dependencies(*(["torchloom"] if inspect.signature(check_dependencies).parameters else []))
    except ImportError as e:
        raise UserError(f"prepare.spark_master {cfg.spark_master}: Spark Connect needs its client libraries"
                        f" ({e}); install them with: {install_hint('spark')}") from None
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "PySpark does not yet fully support pandas", FutureWarning)
        spark = SparkSession.builder.remote(cfg.spark_master.strip()).getOrCreate()
    _check_answers(spark, cfg.spark_master)
    conf = {"spark.sql.shuffle.partitions": str(shuffle_partitions(cfg)), **ADAPTIVE,
            "spark.sql.session.timeZone": "UTC",
            "spark.sql.files.openCostInBytes": str(64 * 1024)}
    conf.update({str(k): str(v) for k, v in cfg.spark_conf.items()})
    for key, value in conf.items():
        try:
            spark.conf.set(key, value)
        except Exception as e:
            if key in cfg.spark_conf:
                raise UserError(f"prepare.spark_conf {key}: the Spark Connect server at {cfg.spark_master} does"
                                f" not take it from a client ({first_line(e)}); set it where the server starts"
                                ) from None
    return spark


# How long a new Spark Connect session waits for its server: about 6 s of retries (pyspark's own default
# retries for 10 minutes, so a wrong address looked like a hang).
CONNECT_RETRIES = {"max_retries": 5, "initial_backoff": 200, "backoff_multiplier": 2.0}


def _check_answers(spark, master: str) -> None:
    """The Spark Connect server at `master` answers a first request, within seconds; else one line."""
    from pyspark.errors.exceptions.connect import SparkConnectGrpcException
    from pyspark.sql.connect.client.retries import DefaultPolicy

    client = spark.client
    policies = client.get_retry_policies()
    client.set_retry_policies([DefaultPolicy(**CONNECT_RETRIES)])
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", r"\[RETRIES_EXCEEDED\]", UserWarning)
            spark.version  # noqa: B018 (a request to the server)
    except SparkConnectGrpcException as e:
        spark.release_session_on_close = False  # nobody to release it with: stop() would retry for seconds
        spark.stop()
        raise UserError(f"prepare.spark_master {master.strip()}: no Spark Connect server answered there"
                        f" ({_grpc_reason(e)}); start the server (sbin/start-connect-server.sh) or fix the host and"
                        " port") from None
    finally:
        client.set_retry_policies(policies)


def _grpc_reason(e: BaseException) -> str:
    """gRPC's status and details from a Spark Connect error (its message is a multi-line repr)."""
    text = str(e)
    status = re.search(r"status = StatusCode\.(\w+)", text)
    details = re.search(r'details = "([^"]*)"', text)
    if not (status or details):
        return first_line(e)[:150]
    reason = details.group(1) if details else ""
    reason = reason.split("last error: ")[-1]  # "failed to connect to all addresses; last error: UNKNOWN: ..."
    return f"{status.group(1) if status else 'error'}: {reason}"[:150]
