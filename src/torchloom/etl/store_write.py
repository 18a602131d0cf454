"""Spark's Parquet output for a run on an object store, prepared by a Spark cluster whose hosts share no
directory and need no Hadoop connector for it: each task writes its rows as Parquet with pyarrow and uploads
the files itself; the driver downloads the files of the tasks that succeeded into its working copy, where
prepare goes on exactly as after Spark's own writer (the same files, rows in the same order, the same row
groups), and deletes the temporary prefix.

Spark's writer would write to the driver's working copy's path on each executor's own disk, where the driver
never sees the rows.
"""

from __future__ import annotations

import secrets
import shutil
import tempfile
from functools import partial
from pathlib import Path

from torchloom.store import storage

WRITTEN_SCHEMA = "file string, rows long"


def write_parquet(df, local_dir: Path, store_prefix: str, rows_per_group: int,
                  partition_by: str | None = None) -> int:
    """Write `df` into local_dir as Spark's `write.partitionBy(partition_by).parquet` would, through the
    store under store_prefix. Returns the number of rows written."""
    prefix = storage.join(store_prefix, f".spark-write-{secrets.token_hex(6)}")
    task = partial(write_task, prefix=prefix, rows_per_group=rows_per_group, partition_by=partition_by)
    try:
        written = df.mapInArrow(task, WRITTEN_SCHEMA).collect()
        local_dir.mkdir(parents=True, exist_ok=True)
        for row in written:
            storage.download(storage.join(prefix, row["file"]), local_dir / row["file"])
    finally:
        try:
            storage.delete_tree(prefix)
        except Exception:  # the files are in local_dir or the job failed anyway; a leftover prefix is harmless
            pass
    return sum(row["rows"] for row in written)


def write_task(batches, prefix: str, rows_per_group: int, partition_by: str | None):
    """A mapInArrow function: this task's rows to part-<partition>.parquet under each value's directory
    (`<partition_by>=<value>/`), row groups of rows_per_group rows as Spark's writer makes them, uploaded;
    yields one (file, rows) per file."""
    import pyarrow as pa
    import pyarrow.compute as pc
    from pyspark import TaskContext

    context = TaskContext.get()
    name = f"part-{context.partitionId() if context is not None else 0:05d}.parquet"
    scratch = Path(tempfile.mkdtemp(prefix="torchloom-write-"))
    files: dict[str, _GroupedWriter] = {}
    try:
        for batch in batches:
            if not batch.num_rows:
                continue
            table = pa.Table.from_batches([batch])
            if partition_by is None:
                parts = {"": table}
            else:
                column = table.column(partition_by)
                parts = {f"{partition_by}={value}/": table.filter(pc.equal(column, value)).drop([partition_by])
                         for value in pc.unique(column).to_pylist()}
            for directory, part in parts.items():
                rel = directory + name
                if rel not in files:
                    files[rel] = _GroupedWriter(scratch / rel, part.schema, rows_per_group)
                files[rel].add(part)
        out = []
        for rel, writer in files.items():
            rows = writer.close()
            storage.upload(writer.path, storage.join(prefix, rel))
            out.append((rel, rows))
        if out:
            yield pa.RecordBatch.from_pydict({"file": [r for r, _ in out], "rows": [n for _, n in out]})
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


class _GroupedWriter:
    """A Parquet file whose row groups hold `rows_per_group` rows each (the last fewer), whatever the sizes
    of the tables added: Spark's `parquet.block.row.count.limit`."""

    def __init__(self, path: Path, schema, rows_per_group: int):
        import pyarrow.parquet as pq

        path.parent.mkdir(parents=True, exist_ok=True)
        self.path, self.per_group = path, max(1, rows_per_group)
        self.writer = pq.ParquetWriter(path, schema)
        self.pending: list = []
        self.pending_rows = 0
        self.rows = 0

    def add(self, table) -> None:
        self.pending.append(table)
        self.pending_rows += table.num_rows
        while self.pending_rows >= self.per_group:
            self._flush(self.per_group)

    def _flush(self, rows: int) -> None:
        import pyarrow as pa

        whole = pa.concat_tables(self.pending)
        self.writer.write_table(whole.slice(0, rows), row_group_size=rows)
        rest = whole.slice(rows)
        self.pending, self.pending_rows = ([rest] if rest.num_rows else []), rest.num_rows
        self.rows += rows

    def close(self) -> int:
        if self.pending_rows:
            self._flush(self.pending_rows)
        self.writer.close()
        return self.rows
