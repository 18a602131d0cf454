"""In the Spark tasks: a pinned table version's data files read with pyarrow (Delta) or pyiceberg (Iceberg), only
their live rows, in the columns prepare asks for (inputs/tables.py plans what each task reads)."""

from __future__ import annotations

import zlib

from torchloom.inputs.store_tasks import SOURCE, reading
from torchloom.store import storage
from torchloom.uri import has_scheme


def _ids(batches):
    for batch in batches:
        yield from batch.column(0).to_pylist()


def _open(uri: str):
    """A data file: a local path (or file://), else an object on a store (store/storage.py's client)."""
    import pyarrow as pa

    if not has_scheme(uri):
        return pa.OSFile(uri)
    if uri.startswith("file://"):
        from urllib.parse import urlparse

        return pa.OSFile(urlparse(uri).path)
    return storage.open_input(uri)


def keep_mask(packed: bytes | None):
    """The rows a Delta deletion vector keeps (tables._delta_plan packs it), as numpy booleans; None: all."""
    if packed is None:
        return None
    import numpy as np

    n = int.from_bytes(packed[-8:], "little")
    return np.unpackbits(np.frombuffer(zlib.decompress(packed[:-8]), dtype=np.uint8), count=n).astype(bool)


def _starts(meta) -> list[int]:
    """The first byte of each row group of a Parquet file (its first column chunk's first page)."""
    out = []
    for g in range(meta.num_row_groups):
        rg = meta.row_group(g)
        firsts = []
        for c in range(rg.num_columns):
            col = rg.column(c)
            firsts.append(col.dictionary_page_offset if col.has_dictionary_page and col.dictionary_page_offset
                          else col.data_page_offset)
        out.append(min(firsts) if firsts else 0)
    return out


def delta_task(batches, plan, ranges, schema, physical: dict[str, str]):
    """mapInArrow over indices into `ranges` ((file, first byte, end)): the row groups of each file that begin in
    the range, in `schema` (the table's columns, then SOURCE): partition columns from the log, columns a file
    lacks (added to the table after it was written) null, rows its deletion vector deletes left out."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns = [f for f in schema if f.name != SOURCE]
    for i in _ids(batches):
        index, lo, hi = ranges[i]
        uri, _, partition, packed = plan.files[index]
        source = storage.redact(uri)
        with reading(uri, in_task=True), _open(uri) as f:
            pf = pq.ParquetFile(f)
            present = set(pf.schema_arrow.names)
            keep = keep_mask(packed)
            read = [physical[c.name] for c in columns if c.name not in partition and physical[c.name] in present]
            first_row = 0
            for g, start in enumerate(_starts(pf.metadata)):
                n = pf.metadata.row_group(g).num_rows
                if lo <= start < hi:
                    part = pf.read_row_group(g, columns=read) if read else None
                    arrays = [_column(c, part, physical[c.name], partition, n) for c in columns]
                    table = pa.Table.from_arrays([*arrays, pa.array([source] * n, pa.string())], schema=schema)
                    if keep is not None:
                        mask = keep[first_row:first_row + n]
                        if len(mask) < n:  # a vector shorter than the file keeps the rows past its end
                            import numpy as np

                            mask = np.concatenate([mask, np.ones(n - len(mask), dtype=bool)])
                        table = table.filter(pa.array(mask))
                    yield from table.to_batches()
                first_row += n


def _column(field, part, name: str, partition: dict, n: int):
    """One output column of a row group: read, a partition value, or nulls."""
    import pyarrow as pa

    if field.name in partition:
        value = partition[field.name]
        return pa.nulls(n, field.type) if value is None else pa.array([value] * n).cast(field.type)
    if part is None or name not in part.column_names:
        return pa.nulls(n, field.type)
    return part.column(name).cast(field.type)


def iceberg_task(batches, plan, schema):
    """mapInArrow over indices into plan.tasks: each data file's rows less its delete files (pyiceberg's own
    reader: schema evolution by field id, positional and equality deletes), in `schema`, with the file as SOURCE."""
    import pyarrow as pa
    from pyiceberg.expressions import AlwaysTrue
    from pyiceberg.io.pyarrow import ArrowScan

    scan = ArrowScan(plan.metadata, plan.io, plan.projection, AlwaysTrue())
    columns = [f for f in schema if f.name != SOURCE]
    for i in _ids(batches):
        task = plan.tasks[i]
        source = storage.redact(task.file.file_path)
        with reading(task.file.file_path, in_task=True):
            for batch in scan.to_record_batches([task]):
                n = batch.num_rows
                arrays = [batch.column(c.name).cast(c.type) if c.name in batch.schema.names else pa.nulls(n, c.type)
                          for c in columns]
                yield pa.RecordBatch.from_arrays([*arrays, pa.array([source] * n, pa.string())], schema=schema)
