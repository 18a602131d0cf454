"""Readers per input format; each gives one DataFrame with columns text, label (strings, may be null), source.
What the input is (its format, whether it exists, its UTF-8 files) is inputs/locate.py's."""

from __future__ import annotations

import os
from urllib.parse import urlparse

from torchloom.config.schema import DataConfig
from torchloom.errors import UserError, message_line
from torchloom.inputs.encoding import RAW
from torchloom.inputs.locate import UTF8_CHECK_BUDGET, check_exists, is_local, local_files, pyarrow_opens, utf8_files
from torchloom.java_errors import unreadable_input
from torchloom.text.formats import (
    COMPRESSED_SUFFIXES,
    FORMATS,
    OTHER_SEPARATORS,
    TABLE_FORMATS,
    column_fix,
    column_named,
    default_separator,
    separator_in,
)
from torchloom.uri import is_uri


class _OtherSeparator(Exception):
    """A CSV whose header, split at the separator its name implies, is one column holding another: read it again."""

    def __init__(self, sep: str):
        super().__init__(sep)
        self.sep = sep


def _with_separator(read, path: str, say) -> object:
    """read(sep): first at the separator the file's name implies, then, where its header says so, at another."""
    try:
        return read(None)
    except _OtherSeparator as other:
        if say is not None:
            say(f"{path}: its fields are separated by {OTHER_SEPARATORS[other.sep]} (read from its header)")
        return read(other.sep)


def _strip_bom(df):
    """A UTF-8 BOM can stick to the first CSV column name; drop it so the column lookup works."""
    renamed = [c.replace("\ufeff", "").strip() for c in df.columns]
    return df.toDF(*renamed) if renamed != df.columns else df


def _some(names: list[str], most: int = 8, width: int = 30) -> str:
    """Column names for an error line: the first few, each clipped, and how many more."""
    shown = [n if len(n) <= width else n[:width - 3] + "..." for n in names[:most]]
    more = f" (and {len(names) - most} more)" if len(names) > most else ""
    return (", ".join(shown) or "none") + more


def _quoted(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


def _select(df, cfg: DataConfig, path: str, source: str = "_metadata.file_path", sniff: str | None = None):
    """text, label, source[, given] and codec (the encoding a reader chose with inputs/encoding.py, else null).
    sniff: the separator a CSV was read at, to be told (_OtherSeparator) where its header shows another."""

    from torchloom.inputs.store_read import CODEC

    if cfg.label_columns:
        return _select_flags(df, cfg, path, source, sniff)
    text, label = (column_named(df.columns, c) for c in (cfg.text_column, cfg.label_column))
    missing = [c for c, found in ((cfg.text_column, text), (cfg.label_column, label)) if found is None]
    if missing:
        names = [c for c in df.columns if c not in ("_corrupt_record", source, CODEC)]
        other = separator_in(names, sniff) if sniff else None
        if other:
            raise _OtherSeparator(other)
        if any(not c.isprintable() or "\ufffd" in c for c in names):
            raise UserError(f"data.path {path}: does not read as {'text' if not names else 'a table'} (its header"
                            " holds binary or wrongly encoded bytes); pass a UTF-8 CSV, JSON lines or Parquet file")
        which = " and ".join(f"{c!r}" for c in missing)
        keys = {key: kind for key, kind, found in (("data.text_column", "text", text),
                                                   ("data.label_column", "label", label)) if found is None}
        raise UserError(f"data.path {path}: no column {which}; columns found: {_some(names)};"
                        f" {column_fix(names, keys)}")
    return _columns(df, cfg, path, source, text, _label(df, cfg, label, path))


def _columns(df, cfg: DataConfig, path: str, source: str, text: str, label):
    from pyspark.sql import functions as F

    from torchloom.inputs.store_read import CODEC

    columns = [
        F.col(_quoted(text)).cast("string").alias("text"),
        label.alias("label"),
        F.col(source).alias("source"),
        (F.col(CODEC) if CODEC in df.columns else F.lit(None).cast("string")).alias("codec"),
    ]
    if cfg.split_column:
        given = column_named(df.columns, cfg.split_column)
        if given is None:
            names = [c for c in df.columns if c not in ("_corrupt_record", source, CODEC)]
            raise UserError(f"data.split_column {cfg.split_column!r}: no such column in {path}; columns found:"
                            f" {_some(names)}")
        columns.append(F.col(_quoted(given)).cast("string").alias("given"))
    return df.select(*columns)


# data.label_columns: the values that set a tag and those that do not (lower-cased, as text; null: not set)
FLAG_ON = ("1", "1.0", "true")
FLAG_OFF = ("0", "0.0", "false", "")


def _select_flags(df, cfg: DataConfig, path: str, source: str, sniff: str | None):
    """_select for data.label_columns: the label is the JSON list of the columns a row sets (text/tags.py reads it as
    tags); a value that is no flag becomes a nested list, which cleaning sets aside as invalid_tags."""
    import json

    from pyspark.sql import functions as F

    from torchloom.inputs.store_read import CODEC

    if cfg.task == "single_label":
        raise UserError("data.label_columns: one column per tag makes a multi-label run; leave data.task auto (or"
                        " multi_label), or give one column with data.label_column")
    names = [c for c in df.columns if c not in ("_corrupt_record", source, CODEC)]
    wanted = [cfg.text_column, *cfg.label_sources()]
    found = {c: column_named(df.columns, c) for c in wanted}
    missing = [c for c in wanted if found[c] is None]
    if missing:
        other = separator_in(names, sniff) if sniff else None
        if other:
            raise _OtherSeparator(other)
        which = ", ".join(f"{c!r}" for c in missing)
        key = "data.text_column" if missing == [cfg.text_column] else "data.label_columns"
        raise UserError(f"data.path {path}: no column {which}; columns found: {_some(names)}; check --{key}")
    parts = []
    for given in cfg.label_sources():
        value = F.lower(F.trim(F.col(_quoted(found[given])).cast("string")))
        parts.append(F.when(value.isNull() | value.isin(*FLAG_OFF), F.lit(None))
                     .when(value.isin(*FLAG_ON), F.lit(json.dumps(given, ensure_ascii=False)))
                     .otherwise(F.lit(json.dumps([given], ensure_ascii=False))))  # a nested list: invalid_tags
    label = F.concat(F.lit("["), F.concat_ws(", ", *parts), F.lit("]"))
    return _columns(df, cfg, path, source, found[cfg.text_column], label)


def _label(df, cfg: DataConfig, label: str, path: str):
    """The label column as a string: a list column (Parquet, JSON) as its JSON text, which text/tags.py reads as
    tags; a number where tags were asked for is one line."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import ArrayType, NumericType

    kind = df.schema[label].dataType
    if isinstance(kind, ArrayType):
        return F.to_json(F.col(_quoted(label)))
    if isinstance(kind, NumericType) and (cfg.task == "multi_label" or cfg.label_delimiter):
        raise UserError(f"data.label_column {label!r} of {path}: holds numbers ({kind.simpleString()}) where tags"
                        " belong; give the tags' names (a list, or a string with data.label_delimiter)")
    return F.col(_quoted(label)).cast("string")


def read_input(spark, cfg: DataConfig, path: str, fmt: str, reader: str = "auto", table=None, say=None):
    """Read `path` as `fmt` into columns text, label, source: with Spark's own readers, or for a URI on an
    object store with inputs/store_read.py (reader "pyarrow", or "auto" when Spark has no file system for the
    URI's scheme: a cluster without that Hadoop connector). A local path is always Spark's. A Delta or Iceberg
    table: `table`, pinned at its version (inputs/tables.py), read by the tasks. A CSV whose header shows fields
    separated by ";", tabs or "|" is read at that separator (`say` tells the user)."""
    from py4j.protocol import Py4JJavaError

    if fmt in TABLE_FORMATS:
        from torchloom.inputs import store_read, tables
        return _select(tables.read(spark, cfg, table), cfg, table.shown, source=store_read.SOURCE)
    check_exists(path)
    if who_reads(path, reader, spark=spark) == "pyarrow":
        return _with_separator(lambda sep: _read_from_store(spark, cfg, path, fmt, sep), path, say)
    try:
        return _with_separator(lambda sep: _read(spark, cfg, path, fmt, sep), path, say)
    except Py4JJavaError as e:  # the file system's own error: no connector for the scheme, no access, ...
        raise unreadable(path, e) from None


def who_reads(path: str, reader: str = "auto", *, table: bool = False, local_spark: bool = False,
              spark=None) -> str:
    """Who reads an input (or prepared shards), decided here alone (reader: prepare.input_reader):
      "tasks"    a Delta or Iceberg table (`table`): Spark's tasks, at its pinned version (inputs/tables.py);
      "spark"    Spark's own readers: a local path, or a URI with reader "spark" on a cluster;
      "pyarrow"  Spark's tasks stream a store's objects (inputs/store_read.py): reader "pyarrow", or "auto" where
                 this Spark has no file system for the URI's scheme (a cluster without that Hadoop connector);
      "copy"     a store's URI read by the embedded local Spark (`local_spark`), which has no Hadoop connector for it
                 (none is on PyPI): staged to this host first (inputs/locate.stage_input), then read as a local path.
    `spark`: the session asked whether it has the scheme's file system (reader "auto" on a cluster)."""
    if table:
        return "tasks"
    if is_local(path):
        return "spark"
    if reader == "pyarrow":
        return "pyarrow"
    if local_spark and is_uri(path):
        return "copy"
    if reader == "spark" or local_spark:  # a scheme that names no store: Spark says it has no file system for it
        return "spark"
    return "pyarrow" if pyarrow_opens(path) and not spark_reads(spark, path) else "spark"


def spark_reads(spark, path: str) -> bool:
    """Whether this Spark has a Hadoop file system for the URI's scheme (hdfs://; s3a:// or gs:// only with
    their connector jars). A Spark Connect server is not ours to ask: it is taken to read what it is given."""
    try:
        jvm, conf = spark._jvm, spark._jsc.hadoopConfiguration()
    except Exception:  # Spark Connect
        return True
    try:
        jvm.org.apache.hadoop.fs.FileSystem.getFileSystemClass(urlparse(path).scheme, conf)
        return True
    except Exception:  # none for the scheme
        return False


def _read_from_store(spark, cfg: DataConfig, path: str, fmt: str, sep: str | None = None):
    from torchloom.inputs import store_read
    from torchloom.store import storage

    storage.scheme(path)  # one line for a scheme pyarrow does not open
    if fmt == "folder" and cfg.split_column:
        raise _folder_has_no_split(cfg, storage.redact(path))
    df = store_read.read(spark, cfg, path, fmt, sep=sep or default_separator(path))
    if fmt == "folder":
        return df.withColumnRenamed(store_read.SOURCE, "source").withColumnRenamed(store_read.CODEC, "codec")
    sniff = default_separator(path) if fmt == "csv" and sep is None else None
    return _select(df, cfg, storage.redact(path), source=store_read.SOURCE, sniff=sniff)


def _folder_has_no_split(cfg: DataConfig, path: str) -> UserError:
    return UserError(f"data.split_column {cfg.split_column!r}: a folder input ({path}) has no columns; use"
                     " data.val_path / data.test_path for separate folders, or a CSV, JSON lines or Parquet"
                     " input with that column")


def unreadable(path: str, e: BaseException) -> UserError:
    """A Java error from reading `path` as one line: the exception's class and message, and the fix."""
    from torchloom.java_errors import java_chain, java_reason, short

    failed = unreadable_input(f"data.path {path}", e)  # a task's "error while reading file F", and why
    if failed:
        return failed
    reason = java_reason(e)
    chain = java_chain(e)
    root = short(chain[-1]) if len(chain) > 1 else ""
    if root and root not in reason:
        reason = f"{reason}; at the root: {root}"
    if "No FileSystem for scheme" in reason:
        scheme = urlparse(path).scheme
        fix = "prepare.input_reader pyarrow" if pyarrow_opens(path) else "copy the data to a local path"
        return UserError(f"data.path {path}: this Spark has no file system for {scheme}:// ({reason}); add its"
                         f" Hadoop connector (prepare.spark_conf spark.jars.packages) or {fix}")
    return UserError(f"data.path {path}: Spark cannot read it ({reason}); check the path and that Spark may read"
                     " it")


def _read_text_table(spark, cfg: DataConfig, path: str, fmt: str, sep: str | None = None):
    """A CSV or JSON lines input: Spark's own reader for files in UTF-8 (or not checked: see utf8_files),
    and the local files that are not (or all of them, with a codec other than UTF-8 forced) read whole
    and decoded as inputs/encoding.py decides (store_read.decoded_frame). sep: None for the one the name implies,
    told to the caller (_OtherSeparator) where the header shows another."""
    from torchloom.inputs import store_read

    sniff = default_separator(path) if fmt == "csv" and sep is None else None
    sep = sep or default_separator(path)
    if fmt == "csv":
        _same_local_headers(path, sep)
    spark_reads, decoded = _by_encoding(path, cfg.encoding)
    if not decoded:
        return _spark_text_table(spark, cfg, path, path, fmt, sep, sniff)
    df = _select(store_read.decoded_frame(spark, cfg, decoded, fmt, sep), cfg, path, store_read.SOURCE, sniff)
    if spark_reads:
        df = df.unionByName(_spark_text_table(spark, cfg, spark_reads, path, fmt, sep, sniff))
    return df


def _same_local_headers(path: str, sep: str) -> None:
    """The local CSV files of one input name the first file's columns in its order (store_read.same_header):
    Spark's readers take each file's columns by position, so a file whose header says "label,text" would give
    its labels as texts. A URI's files: the store reader checks each object (store_read.csv_task)."""
    import io

    from torchloom.inputs import store_tasks
    from torchloom.inputs.encoding import head_text

    if not is_local(path):
        return
    files = local_files(path)
    first: tuple[list[str], str] | None = None
    for f in files if len(files) > 1 else []:
        # the header in the file's own encoding, from its first 64 KB (a directory may hold many big files);
        # a gzip or bz2 file's from its first 64 KB decompressed
        try:
            text = head_text(f)
        except ValueError:  # a compression only Spark reads (.snappy, .zst, .lz4): not checked
            continue
        record = next(store_tasks.csv_records(io.StringIO(text, newline=""), sep), "")
        names = store_tasks.header_names(record, sep)
        if first is None:
            first = (names, f)
        else:
            store_tasks.same_header(names, first[0], f, first[1])


def _spark_text_table(spark, cfg: DataConfig, files: str | list[str], path: str, fmt: str, sep: str,
                      sniff: str | None = None):
    if fmt == "jsonl":
        return _select(spark.read.json(files), cfg, path)
    df = (spark.read.option("header", True).option("multiLine", True).option("escape", '"')
          .option("encoding", "UTF-8").option("sep", sep).csv(files))
    return _select(_strip_bom(df), cfg, path, sniff=sniff)


def _by_encoding(path: str, encoding: str) -> tuple[list[str], list[str]]:
    """The files of a CSV or JSON lines input that Spark's UTF-8 reader reads, and those read whole and
    decoded as data.encoding says (both empty: Spark reads the input as it is): none for strict; every
    file with a codec other than UTF-8 forced; with auto or utf-8 the local files utf8_files found not
    UTF-8 (a URI: none, as for local inputs too large to check)."""
    import codecs

    from torchloom.inputs.encoding import AUTO, STRICT

    if encoding == STRICT:
        return [], []
    if encoding != AUTO and codecs.lookup(encoding).name not in ("utf-8", "utf-8-sig"):
        # every file, wherever Spark reads it (Spark's text source decompresses .gz and .bz2 as its CSV reader does)
        return [], local_files(path) if is_local(path) else [path]
    if not is_local(path):
        return [], []  # the driver does not read a cluster's files: Spark's UTF-8 reader, bad bytes set aside
    files = local_files(path)
    checked = [f for f in files if not f.endswith(COMPRESSED_SUFFIXES)]
    if sum(os.path.getsize(f) for f in checked) > UTF8_CHECK_BUDGET:
        return [], []  # too much to check on the driver: Spark's reader, with U+FFFD for bytes not UTF-8
    valid = utf8_files(path)
    decoded = [f for f in checked if f not in valid]
    return ([f for f in files if f not in decoded], decoded) if decoded else ([], [])


def _read(spark, cfg: DataConfig, path: str, fmt: str, sep: str | None = None):
    from pyspark.errors import AnalysisException
    from pyspark.sql import functions as F

    reader = spark.read
    try:
        if fmt in ("csv", "jsonl"):
            return _read_text_table(spark, cfg, path, fmt, sep)
        if fmt == "parquet":
            return _select(reader.parquet(path), cfg, path)
        if fmt == "folder" and cfg.split_column:
            raise _folder_has_no_split(cfg, path)
        if fmt == "folder":
            # Recursive lookup of *.txt instead of a root/*/*.txt glob: same files, no partition
            # inference from "key=value" directory names, and no warning about the glob path.
            df = (
                reader.option("recursiveFileLookup", True)
                .option("pathGlobFilter", "*.txt")
                .text(path, wholetext=True)  # text()'s own wholetext argument overrides .option()
            )
            # file_path is a URI (percent-encoded); the label is the parent directory's name.
            parent = F.element_at(F.split(F.col("_metadata.file_path"), "/"), -2)
            label = F.url_decode(F.regexp_replace(parent, r"\+", "%2B"))
            return df.select(F.col("value").alias("text"), label.alias("label"),
                             F.col("_metadata.file_path").alias("source"), F.lit(RAW).alias("codec"))
    except AnalysisException as e:
        first = message_line(str(e))
        if "PATH_NOT_FOUND" in first or "does not exist" in first:
            raise UserError(f"data.path {path}: no such file or directory (nothing matched); check the path") from None
        if "UNABLE_TO_INFER_SCHEMA" in first:
            raise UserError(f"data.path {path}: no {fmt} data found there; check the path and --data.format") from None
        raise
    raise UserError(f"data.format {fmt!r}: unknown; use one of auto, {', '.join(FORMATS)}")
