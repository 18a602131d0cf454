"""The input files torchloom reads as tables (prepare's data.path, predict's --input): the format each name
suffix means. Imports nothing, so etl/ and serve/ (which may not import etl/) share the one table."""

from __future__ import annotations

SUFFIX_FORMATS = {
    ".csv": "csv", ".tsv": "csv",
    ".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl",
    ".parquet": "parquet", ".pq": "parquet",
}
