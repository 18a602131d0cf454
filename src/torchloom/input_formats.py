"""The inputs torchloom reads (prepare's data.path, predict's --input): the formats prepare knows, one spelling
each, and the format each file name suffix means. Imports nothing, so config/, etl/ and serve/ (which may not
import etl/) share the one table."""

from __future__ import annotations

SUFFIX_FORMATS = {
    ".csv": "csv", ".tsv": "csv",
    ".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl",
    ".parquet": "parquet", ".pq": "parquet",
}
# Versioned tables: a Delta Lake table (a directory or store prefix holding DELTA_LOG/), an Apache Iceberg table
# named by its catalog (ICEBERG_SCHEME catalog/namespace.table); read at one version (data.version): etl/tables.py
TABLE_FORMATS = ("delta", "iceberg")
FORMATS = ("csv", "jsonl", "parquet", "folder", *TABLE_FORMATS)  # what data.format may say, besides auto
DELTA_LOG = "_delta_log"
ICEBERG_SCHEME = "iceberg://"


def is_iceberg(path: str) -> bool:
    return path[:len(ICEBERG_SCHEME)].lower() == ICEBERG_SCHEME
