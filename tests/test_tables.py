"""Delta Lake and Apache Iceberg tables as prepare's input: real tables written by deltalake and pyiceberg (an
update, a delete and a schema change between versions), read at one version; the rows prepared equal the table's
rows at that version; the manifest names it; bad tables, versions, catalogs and columns are one line."""

from __future__ import annotations

import json
import os
import struct
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from torchloom.config.schema import Config
from torchloom.errors import UserError
from torchloom.manifest import SPLITS
from torchloom.manifest import read as read_manifest

pytest.importorskip("pyspark")
deltalake = pytest.importorskip("deltalake")
pytest.importorskip("pyiceberg")

from torchloom.etl.prepare import prepare  # noqa: E402
from torchloom.inputs import tables  # noqa: E402

VOCAB = {"sport": "match goal team win league", "money": "bank market price shares profit"}


def first_rows() -> pa.Table:
    rows = [(f"{words} number {i}", label) for label, words in VOCAB.items() for i in range(30)]
    return pa.table({"text": [t for t, _ in rows], "label": [lb for _, lb in rows]})


def pairs(table: pa.Table) -> set[tuple[str, str]]:
    return set(zip(table.column("text").cast(pa.string()).to_pylist(),
                   table.column("label").cast(pa.string()).to_pylist(), strict=True))


def prepared(out: Path) -> set[tuple[str, str]]:
    """(text, label) of every prepared row, all splits."""
    m = read_manifest(out)
    return {(r["text"], r["label"]) for name in SPLITS for shard in m.splits[name].shards
            for r in pq.read_table(m.shard_uri(shard), columns=["text", "label"]).to_pylist()}


def cfg_for(path: str, model_dir: str, **data) -> Config:
    cfg = Config()
    cfg.data.path, cfg.model.path = str(path), model_dir
    for key, value in data.items():
        setattr(cfg.data, key, value)
    return cfg


@pytest.fixture(scope="module")
def delta_table(tmp_path_factory) -> tuple[str, dict[int, set]]:
    """A Delta table of 4 versions (0 write, 1 update, 2 delete, 3 append with a new column) and its rows at each,
    as delta-rs itself reads them."""
    from deltalake import DeltaTable, write_deltalake

    path = str(tmp_path_factory.mktemp("delta") / "docs")
    write_deltalake(path, first_rows())
    DeltaTable(path).update(updates={"text": "concat(text, ' updated')"}, predicate="text LIKE '%number 1%'")
    DeltaTable(path).delete("text LIKE '%number 2%'")
    time.sleep(0.05)  # a time between versions 2 and 3 to travel to
    write_deltalake(path, pa.table({"text": ["bank shares row added", "goal league row added"],
                                    "label": ["money", "sport"], "note": [1, 2]}), mode="append", schema_mode="merge")
    return path, {v: pairs(DeltaTable(path, version=v).to_pyarrow_table(columns=["text", "label"]))
                  for v in range(4)}


def test_a_delta_table_is_read_at_its_pinned_version_and_time_travels(spark, tiny_model_dir, tmp_path, delta_table,
                                                                      capsys):
    from mlflow import MlflowClient

    from torchloom import tracking
    from torchloom.stages.prepare import prepare_stage

    path, versions = delta_table
    assert len({frozenset(v) for v in versions.values()}) == 4  # every commit changed the rows
    cfg = cfg_for(path, tiny_model_dir, version="1")  # before the delete and the new column
    cfg.output.dir = str(tmp_path / "run")
    prepare_stage(cfg, spark=spark)
    m = read_manifest(tmp_path / "run")
    assert prepared(tmp_path / "run") == versions[1] and m.inputs["version"] == 1
    # data.format auto found the log, not the Parquet files of every version under it; no version: the current
    cfg.data.version, cfg.output.overwrite = "", True
    with tracking.start(cfg, "run") as tracker:
        prepare_stage(cfg, spark=spark, tracker=tracker)
    m = read_manifest(tmp_path / "run")
    assert prepared(tmp_path / "run") == versions[3]
    assert m.inputs["format"] == "delta" and m.inputs["version"] == 3 and m.inputs["committed"].endswith("Z")
    said = capsys.readouterr().err
    assert "(delta version 3 of " in said and f"{path} read at delta version 3 of" in said
    assert "a newer version than the delta version 1 of" in said  # one line
    run = MlflowClient(tracker.uri).get_run(tracker.run_id)
    dataset = run.inputs.dataset_inputs[0].dataset
    assert dataset.source_type == "delta_table" and json.loads(dataset.source)["delta_table_version"] == 3
    assert run.data.tags["data_version"] == "3" and run.data.tags["data_format"] == "delta"
    history = {c["version"]: c["timestamp"] for c in deltalake.DeltaTable(path).history()}
    ms = (history[2] + history[3]) // 2
    at = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ms / 1000)) + f".{ms % 1000:03d}Z"
    assert tables.pin(cfg_for(path, "").data, path, "delta", version=at).version == 2  # a timestamp


def z85(data: bytes) -> str:
    alphabet = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#"
    data += b"\0" * (-len(data) % 4)
    out = []
    for i in range(0, len(data), 4):
        v = int.from_bytes(data[i:i + 4], "big")
        out.append("".join(alphabet[v // 85 ** k % 85] for k in range(4, -1, -1)))
    return "".join(out)


def delete_with_a_vector(path: str, deleted: list[int]) -> None:
    """Commit a deletion vector of `deleted` (row positions) on the table's one data file, inline, as Databricks
    and Spark write them (delta-rs rewrites the file instead): serialized RoaringBitmapArray, Z85."""
    from pyroaring import BitMap

    data = struct.pack("<iqi", 1681511377, 1, 0) + BitMap(deleted).serialize()
    log = Path(path) / "_delta_log"
    last = sorted(log.glob("*.json"))[-1]
    add = next(json.loads(line)["add"] for line in last.read_text().splitlines() if '"add"' in line)
    now = int(time.time() * 1000)
    vector = {"storageType": "i", "pathOrInlineDv": z85(data), "sizeInBytes": len(data), "cardinality": len(deleted)}
    actions = [{"commitInfo": {"timestamp": now, "operation": "DELETE"}},
               {"remove": {"path": add["path"], "deletionTimestamp": now, "dataChange": True, "size": add["size"],
                           "partitionValues": add["partitionValues"]}},
               {"add": {**add, "deletionVector": vector, "modificationTime": now}}]
    (log / f"{int(last.stem) + 1:020d}.json").write_text("".join(json.dumps(a) + "\n" for a in actions))


def test_deletion_vectors_column_mapping_and_partitions_are_honoured(spark, tmp_path):
    from deltalake import DeltaTable, write_deltalake

    rows = first_rows()
    dv = str(tmp_path / "dv")
    write_deltalake(dv, rows, configuration={"delta.enableDeletionVectors": "true"})
    delete_with_a_vector(dv, [0, 5, 31, 59])
    mapped = str(tmp_path / "mapped")  # Parquet column names are physical ids, the log maps them to names
    write_deltalake(mapped, rows, configuration={"delta.columnMapping.mode": "name"})
    parted = str(tmp_path / "parted")  # label only in the directory names, some of them percent-encoded
    write_deltalake(parted, rows.set_column(1, "label", pa.array([f"{v} a/b %" for v in rows.column("label")])),
                    partition_by=["label"])
    data = Config().data
    for path in (dv, mapped, parted):
        table = tables.pin(data, path, "delta")
        got = pairs(pa.Table.from_pylist(tables.read(spark, data, table).toArrow().to_pylist()))
        assert got == pairs(pa.table(DeltaTable(path).scan(columns=["text", "label"]))), path
    assert len(got) == 60 and len(pairs(pa.table(DeltaTable(dv).scan(columns=["text", "label"])))) == 56


@pytest.fixture(scope="module")
def iceberg_table(tmp_path_factory):
    """An Iceberg table in a SQLite catalog: snapshots of an append, a delete, an overwrite (an update), a new
    column and an append; its catalog settings and rows at each snapshot, as pyiceberg reads them."""
    from pyiceberg.catalog.sql import SqlCatalog
    from pyiceberg.types import LongType

    root = tmp_path_factory.mktemp("iceberg")
    settings = {"uri": f"sqlite:///{root}/catalog.db", "warehouse": f"file://{root}/warehouse"}
    catalog = SqlCatalog("lake", **settings)
    catalog.create_namespace("docs")
    table = catalog.create_table("docs.news", schema=first_rows().schema)
    table.append(first_rows())
    table.delete("text == 'bank market price shares profit number 3'")
    table.overwrite(pa.table({"text": ["match goal team win league updated"], "label": ["sport"]}),
                    overwrite_filter="text == 'match goal team win league number 4'")
    with table.update_schema() as update:
        update.add_column("note", LongType())
    table.append(pa.table({"text": ["bank shares row added"], "label": ["money"], "note": [1]},
                          schema=table.schema().as_arrow()))
    snapshots = [s.snapshot_id for s in table.snapshots()]
    return settings, {s: pairs(table.scan(snapshot_id=s, selected_fields=("text", "label")).to_arrow())
                      for s in snapshots}


def test_an_iceberg_table_in_a_sql_catalog_at_a_snapshot(spark, tiny_model_dir, tmp_path, iceberg_table):
    settings, snapshots = iceberg_table
    ids = list(snapshots)
    cfg = cfg_for("iceberg://lake/docs.news", tiny_model_dir, catalogs={"lake": settings})
    m = prepare(cfg, str(tmp_path / "now"), spark=spark)
    assert prepared(tmp_path / "now") == snapshots[ids[-1]] and len(snapshots[ids[-1]]) == 60
    assert m.inputs["format"] == "iceberg" and m.inputs["version"] == ids[-1]
    cfg.data.version = str(ids[1])  # after the delete, before the update and the new column
    m = prepare(cfg, str(tmp_path / "then"), spark=spark)
    assert prepared(tmp_path / "then") == snapshots[ids[1]] and m.inputs["version"] == ids[1]


def test_split_column_and_val_test_tables(spark, tiny_model_dir, tmp_path):
    from deltalake import write_deltalake

    rows = first_rows()
    parts = ["test" if i % 10 == 0 else "val" if i % 10 == 1 else "train" for i in range(rows.num_rows)]
    write_deltalake(str(tmp_path / "split"), rows.append_column("part", pa.array(parts)))
    m = prepare(cfg_for(tmp_path / "split", tiny_model_dir, split_column="part"), str(tmp_path / "a"), spark=spark)
    assert m.counts["splits"] == {"train": 48, "val": 6, "test": 6} and m.inputs["version"] == 0
    for name, rows_of in (("train", range(0, 50)), ("val", range(50, 55)), ("test", range(55, 60))):
        write_deltalake(str(tmp_path / name), rows.take(list(rows_of)))
    cfg = cfg_for(tmp_path / "train", tiny_model_dir, val_path=str(tmp_path / "val"), test_path=str(tmp_path / "test"))
    m = prepare(cfg, str(tmp_path / "b"), spark=spark)
    assert m.counts["splits"]["test"] == 5 and m.inputs["val_version"] == 0 and m.inputs["test_version"] == 0


def test_bad_tables_versions_catalogs_and_columns_are_one_line(tmp_path, delta_table, iceberg_table):
    path, _ = delta_table
    settings, snapshots = iceberg_table
    data = Config().data

    def fails(path, fmt, *fragments, **changes):
        d = Config().data
        for key, value in changes.items():
            setattr(d, key, value)
        with pytest.raises(UserError) as e:
            tables.pin(d, path, fmt)
        line = str(e.value)
        assert "\n" not in line and "Traceback" not in line, line
        for fragment in fragments:
            assert fragment in line, line

    empty = tmp_path / "empty"
    (empty / "_delta_log").mkdir(parents=True)
    fails(str(empty), "delta", "not a Delta table", "without a commit")
    broken = tmp_path / "broken"
    (broken / "_delta_log").mkdir(parents=True)
    (broken / "_delta_log" / f"{0:020d}.json").write_text("{not json\n")
    fails(str(broken), "delta", "cannot read this Delta table's log")
    fails(str(tmp_path), "delta", "not a Delta table")
    fails(path, "delta", "has no version 9", "from 0 to 3", version="9")
    fails(path, "delta", "did not exist yet", version="2001-01-01")
    fails(path, "delta", "neither a version number nor an ISO timestamp", version="yesterday")
    fails(path, "delta", "no column 'body'", "columns found: text, label, note", text_column="body")
    fails(path, "delta", "data.split_column 'part'", split_column="part")
    fails("iceberg://lake/docs.news", "iceberg", "no snapshot 5", version="5", catalogs={"lake": settings})
    fails("iceberg://lake/docs.nope", "iceberg", "no table docs.nope", catalogs={"lake": settings})
    fails("iceberg://lake/docs.news", "iceberg", "no column 'body'", "columns found: text, label, note",
          text_column="body", catalogs={"lake": settings})
    fails("iceberg://lake/docs.news", "iceberg", "data.path iceberg://lake/docs.news: the Iceberg catalog 'lake'",
          "does not answer", "sqlite:////nonexistent/c.db", catalogs={"lake": {"uri": "sqlite:////nonexistent/c.db"}})
    # the catalog answers, but the metadata file it names is gone: said so, not "does not answer"
    from pyiceberg.catalog.sql import SqlCatalog

    moved = {"uri": f"sqlite:///{tmp_path}/moved.db", "warehouse": f"file://{tmp_path}/moved"}
    SqlCatalog("moved", **moved).create_namespace("docs")
    SqlCatalog("moved", **moved).create_table("docs.gone", schema=first_rows().schema).append(first_rows())
    for metadata in (tmp_path / "moved").rglob("*.metadata.json"):
        metadata.unlink()
    fails("iceberg://moved/docs.gone", "iceberg", "data.path iceberg://moved/docs.gone", "answers, but the table's"
          " metadata file it names is not there", catalogs={"moved": moved})
    fails("iceberg://rest/docs.news", "iceberg", "does not answer", "127.0.0.1:9",
          catalogs={"rest": {"type": "rest", "uri": "http://127.0.0.1:9"}})
    fails("iceberg://lake/news", "iceberg", "iceberg://CATALOG/NAMESPACE.TABLE")
    from torchloom.inputs.locate import pin_tables, resolve_format

    data.version = "3"
    csv = tmp_path / "x.csv"
    csv.write_text("text,label\na,b\n")
    with pytest.raises(UserError, match="is not a table"):
        pin_tables(data, str(csv))
    data.version, data.format = "", "csv"
    with pytest.raises(UserError, match="iceberg://CATALOG"):
        resolve_format(data, "iceberg://lake/docs.news")


def test_a_tables_columns_are_matched_without_case_as_a_csvs(spark, tiny_model_dir, tmp_path, delta_table,
                                                            iceberg_table):
    # a config written for a CSV's "Text" and "Label" reads a table's text and label, as Spark and the CSV do
    path, versions = delta_table
    settings, snapshots = iceberg_table
    newest = list(snapshots.values())[-1]
    for source, extra, rows in ((path, {}, versions[3]),
                                ("iceberg://lake/docs.news", {"catalogs": {"lake": settings}}, newest)):
        out = tmp_path / ("delta" if source == path else "iceberg")
        prepare(cfg_for(source, tiny_model_dir, text_column="Text", label_column="LABEL", **extra), str(out),
                spark=spark)
        assert prepared(out) == rows


def test_without_the_tables_extra_a_table_says_what_to_install(monkeypatch, delta_table):
    import sys

    monkeypatch.setitem(sys.modules, "deltalake", None)  # import deltalake: ImportError
    monkeypatch.setitem(sys.modules, "pyiceberg.catalog", None)
    with pytest.raises(UserError, match="reading a Delta table needs the tables extra: pip install 'deltalake"):
        tables.pin(Config().data, delta_table[0], "delta")
    with pytest.raises(UserError, match="needs the tables extra: pip install .*pyiceberg"):
        tables.pin(Config().data, "iceberg://lake/docs.news", "iceberg")


def run_tasks(task, count: int, **kwargs) -> pa.Table:
    """A table_tasks reader over all its work items, in this process, as a Spark task runs it."""
    schema = pa.schema([("text", pa.string()), ("label", pa.string()), ("__torchloom_source", pa.string())])
    ids = [pa.record_batch([pa.array(range(count), pa.int64())], names=["id"])]
    return pa.Table.from_batches(list(task(ids, schema=schema, **kwargs)), schema)


def test_tables_on_the_s3_test_server(tmp_path):
    """delta-rs and pyiceberg on the driver and the tasks' readers (run here in-process: Spark's Python workers
    would need the store's variables from their start) against a real S3 server: the rows each library reads;
    AWS_ENDPOINT_URL is the endpoint for both, as for files."""
    from deltalake import DeltaTable, write_deltalake
    from support.s3 import s3_server

    from torchloom.inputs import table_tasks

    credentials = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing-secret",
                   "AWS_DEFAULT_REGION": "us-east-1"}
    with s3_server(tmp_path, "lake", credentials):
        uri = "s3://lake/tables/docs"
        where, options = tables.delta_location(uri)
        options["AWS_S3_ALLOW_UNSAFE_RENAME"] = "true"  # one writer: no locking needed
        write_deltalake(where, first_rows(), storage_options=options)
        DeltaTable(where, storage_options=options).delete("text LIKE '%number 2%'")
        expected = pairs(DeltaTable(where, storage_options=options).to_pyarrow_table(columns=["text", "label"]))
        data = Config().data
        from torchloom.inputs.locate import resolve_format

        assert resolve_format(data, uri) == "delta"  # the prefix's _delta_log/ says so
        table = tables.pin(data, "s3a://lake/tables/docs", "delta")
        ranges = tables.byte_ranges(table.plan.files, 2)
        got = run_tasks(table_tasks.delta_task, len(ranges), plan=table.plan, ranges=ranges,
                        physical={"text": "text", "label": "label"})
        assert table.version == 1 and pairs(got) == expected and len(expected) == 38
        assert all(s.startswith("s3://lake/tables/docs/") for s in got.column("__torchloom_source").to_pylist())

        from pyiceberg.catalog.sql import SqlCatalog

        settings = {"uri": f"sqlite:///{tmp_path}/catalog.db", "warehouse": "s3://lake/warehouse"}
        writer = {"s3.endpoint": os.environ["AWS_ENDPOINT_URL"], "s3.region": "us-east-1"}  # prepare: the variables
        catalog = SqlCatalog("store", **settings, **writer)
        catalog.create_namespace("docs")
        written = catalog.create_table("docs.news", schema=first_rows().schema)
        written.append(first_rows())
        written.delete("text == 'bank market price shares profit number 3'")
        data.catalogs = {"store": settings}
        table = tables.pin(data, "iceberg://store/docs.news", "iceberg")
        got = run_tasks(table_tasks.iceberg_task, len(table.plan.tasks), plan=table.plan)
        assert pairs(got) == pairs(written.scan(selected_fields=("text", "label")).to_arrow()) and len(got) == 59


def test_a_delta_table_on_azurite_reads_the_variables_of_every_abfs_input(tmp_path):
    """AZURE_STORAGE_CONNECTION_STRING (Azurite's account, its endpoint on a free port), as for files: delta-rs is
    given them (it reads only its own names, and no emulator's endpoint); the tasks read the rows."""
    from deltalake import DeltaTable, write_deltalake
    from support.clouds import azurite_server

    from torchloom.inputs import table_tasks

    with azurite_server(tmp_path, "lake"):
        uri = "abfs://lake/tables/docs"
        where, options = tables.delta_location(uri)
        assert options["azure_storage_endpoint"].startswith("http://127.0.0.1:")
        write_deltalake(where, first_rows(), storage_options=options)
        DeltaTable(where, storage_options=options).delete("text LIKE '%number 2%'")
        table = tables.pin(Config().data, uri, "delta")
        ranges = tables.byte_ranges(table.plan.files, 2)
        got = run_tasks(table_tasks.delta_task, len(ranges), plan=table.plan, ranges=ranges,
                        physical={"text": "text", "label": "label"})
        assert table.version == 1 and len(got) == 38
        assert pairs(got) == pairs(DeltaTable(where, storage_options=options).to_pyarrow_table(
            columns=["text", "label"]))


def iceberg_on(tmp_path: Path, name: str, warehouse: str) -> tuple[dict, set]:
    """An Iceberg table in a SQL catalog whose warehouse is on a store (written as torchloom reads it: the store's
    own variables), a delete after the append; the catalog's settings and the rows pyiceberg reads."""
    from pyiceberg.catalog.sql import SqlCatalog

    settings = {"uri": f"sqlite:///{tmp_path}/{name}.db", "warehouse": warehouse}
    catalog = SqlCatalog(name, **settings, **{"py-io-impl": tables.STORE_FILE_IO})
    catalog.create_namespace("docs")
    written = catalog.create_table("docs.news", schema=first_rows().schema)
    written.append(first_rows())
    written.delete("text == 'bank market price shares profit number 3'")
    return settings, pairs(written.scan(selected_fields=("text", "label")).to_arrow())


def iceberg_reads_back(tmp_path: Path, name: str, warehouse: str) -> None:
    """An Iceberg table written on the store (iceberg_on) read by the tasks' readers: the rows pyiceberg reads."""
    from torchloom.inputs import table_tasks

    settings, rows = iceberg_on(tmp_path, name, warehouse)
    data = Config().data
    data.catalogs = {name: settings}
    table = tables.pin(data, f"iceberg://{name}/docs.news", "iceberg")
    got = run_tasks(table_tasks.iceberg_task, len(table.plan.tasks), plan=table.plan)
    assert pairs(got) == rows and len(got) == 59


def test_tables_on_the_gcs_and_azure_emulators_read_the_variables_of_every_input(tmp_path):
    """A Delta table on gs:// (fake-gcs-server: delta-rs speaks GCS's XML API) and Iceberg tables on gs:// and
    abfs:// (Azurite), with only what every other input on those stores reads (STORAGE_EMULATOR_HOST,
    AZURE_STORAGE_CONNECTION_STRING): the rows the tasks read are the table's, from the store's files."""
    from deltalake import DeltaTable, write_deltalake
    from pyarrow import fs as pafs
    from support.clouds import azurite_server, fake_gcs_server

    from torchloom.inputs import table_tasks
    from torchloom.store import storage

    local = str(tmp_path / "delta")
    write_deltalake(local, first_rows())
    DeltaTable(local).delete("text LIKE '%number 2%'")
    expected = pairs(DeltaTable(local).to_pyarrow_table(columns=["text", "label"]))
    with fake_gcs_server(tmp_path, "lake"):
        fs, root = storage.resolve("gs://lake/tables/docs")
        pafs.copy_files(local, root, destination_filesystem=fs)  # as a Spark job or gsutil would have put it
        table = tables.pin(Config().data, "gcs://lake/tables/docs", "delta")
        ranges = tables.byte_ranges(table.plan.files, 2)
        got = run_tasks(table_tasks.delta_task, len(ranges), plan=table.plan, ranges=ranges,
                        physical={"text": "text", "label": "label"})
        assert table.version == 1 and pairs(got) == expected and len(got) == 38
        assert all(s.startswith("gs://lake/tables/docs/") for s in got.column("__torchloom_source").to_pylist())

        iceberg_reads_back(tmp_path, "gcs", "gs://lake/warehouse")
    with azurite_server(tmp_path, "lake"):
        iceberg_reads_back(tmp_path, "azure", "abfs://lake/warehouse")


def test_a_delta_data_file_that_is_gone_is_one_line(spark, tiny_model_dir, tmp_path):
    """A data file the log names and the store no longer has (vacuumed, deleted by hand): one line naming it."""
    from deltalake import write_deltalake

    path = tmp_path / "gone"
    write_deltalake(str(path), first_rows())
    (victim,) = path.glob("*.parquet")
    victim.unlink()
    with pytest.raises(UserError) as e:
        prepare(cfg_for(path, tiny_model_dir), str(tmp_path / "out"), spark=spark)
    line = str(e.value)
    assert "\n" not in line and "Traceback" not in line and f"{victim.name} is gone (vacuumed" in line, line
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").rglob("*.parquet"))
