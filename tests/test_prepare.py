"""The prepare stage on a real local SparkSession: inputs, cleaning, rejects, split, tokens, layout, errors."""

from __future__ import annotations

import itertools
import json
import unicodedata
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from torchloom.config.schema import Config
from torchloom.errors import UserError
from torchloom.manifest import COLUMNS, SPLITS, Manifest
from torchloom.manifest import read as read_manifest

pytest.importorskip("pyspark")

from torchloom.etl.prepare import prepare  # noqa: E402

FILLER = {label: [f"{label} filler sentence number {i} for the split" for i in range(10)] for label in ("pos", "neg")}


def make_cfg(path, model_dir: str, **prepare_overrides) -> Config:
    cfg = Config()
    cfg.data.path = str(path)
    cfg.model.path = model_dir
    for key, value in prepare_overrides.items():
        setattr(cfg.prepare, key, value)
    return cfg


def split_rows(out: Path) -> dict[str, list[dict]]:
    """Every prepared row per split, read back from the shards the manifest lists."""
    m = read_manifest(out)
    rows = {}
    for name in SPLITS:
        rows[name] = []
        for shard in m.splits[name].shards:
            rows[name].extend(pq.read_table(m.shard_uri(shard)).to_pylist())
    return rows


def leftovers(parent: Path, keep: set[str]) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name not in keep)


def write_csv(path: Path) -> None:
    q = '"'

    def line(text: str | bytes, label: str) -> bytes:
        t = text if isinstance(text, bytes) else text.encode()
        return q.encode() + t.replace(b'"', b'""') + q.encode() + b"," + label.encode() + b",x\n"

    data = "\ufefftext,label,extra\n".encode()
    data += line("Hello   world,\tagain", "pos")
    data += line('Line one\nline "two"', " neg ")  # quoted multi-line field, quotes escaped by doubling
    data += line("   \n  ", "pos")  # empty after cleaning
    data += b",pos,x\n"  # no text at all
    data += line("A text without a label", "")
    data += line("Dup text here", "pos")
    data += line("Dup  text here", "pos")
    data += line("Dup text\nhere", "pos")
    data += line("Ambiguous text", "pos")
    data += line(" Ambiguous text ", "neg")
    data += line(b"Bad \xff\xfe bytes here", "neg")
    data += line("ab", "pos")  # too short for min_chars=3
    data += line("x" * 300, "neg")  # too long for max_chars=200
    data += line("Cafe\u0301 cre\u0300me", "neg")  # decomposed accents -> NFC
    data += line("ctl\x00char\x07s here", "neg")
    data += line("A rare one", "rare")  # 2 rows: too few for a row in each of train/val/test
    data += line("Another rare one", "rare")
    for label, texts in FILLER.items():
        for text in texts:
            data += line(text, label)
    path.write_bytes(data)


EXPECTED_REJECTS = {
    "   \n  ": "empty_text",
    None: "null_text",
    "A text without a label": "null_label",
    "Ambiguous text": "conflicting_labels",
    " Ambiguous text ": "conflicting_labels",
    "Bad \ufffd\ufffd bytes here": "invalid_utf8",
    "ab": "too_short",
    "x" * 300: "too_long",
    "A rare one": "class_too_small",
    "Another rare one": "class_too_small",
}


def test_held_out_splits_are_capped_by_the_rows_a_metric_needs_and_a_chosen_fraction_is_kept():
    from torchloom.etl.split import CLASS_FLOOR, HELDOUT_ROWS, heldout_cap, heldout_record, plan_split

    assert (HELDOUT_ROWS, CLASS_FLOOR) == (153_664, 385)
    rows = {"big": 9_000_000, "mid": 990_000, "rare": 10_000, "tiny": 2_000}
    plans, small = plan_split(rows, 0.1, 0.1, "x.csv", "auto")
    by = {p.label: p for p in plans}
    assert not small and sum(p.val for p in plans) == pytest.approx(HELDOUT_ROWS, rel=0.01)
    assert by["big"].val == round(900_000 * HELDOUT_ROWS / 1_000_200)  # in proportion
    assert by["rare"].val == CLASS_FLOOR and by["tiny"].val == 200  # a rare class keeps its floor, or all it had
    assert by["big"].train == 9_000_000 - 2 * by["big"].val  # the rest trains
    record = heldout_record(plans, 0.1, 0.1, "auto")
    assert record["val"]["by_fraction"] == 1_000_200 and "+-0.25 points" in record["why"]
    # a fraction the user chose is kept as given; a number caps it; small data is never capped
    assert heldout_cap("auto", 0.2) == 0 and heldout_cap(1000, 0.2) == 1000 and heldout_cap(0, 0.1) == 0
    chosen, _ = plan_split(rows, 0.2, 0.1, "x.csv", "auto")
    assert sum(p.val for p in chosen) == 2_000_400 and sum(p.test for p in chosen) < 160_000
    plain, _ = plan_split({"a": 5000, "b": 3000}, 0.1, 0.1, "x.csv", "auto")
    assert [(p.val, p.test) for p in plain] == [(500, 500), (300, 300)]
    assert heldout_record(plain, 0.1, 0.1, "auto") is None


@pytest.mark.parametrize("rows_per_file", [None, 3])
def test_csv_cleaning_rejects_and_split(spark, tiny_model_dir, tmp_path, monkeypatch, rows_per_file):
    if rows_per_file:  # the rejected rows written by a Spark job (3 files), as for large inputs
        from torchloom.etl import write_splits

        monkeypatch.setattr(write_splits, "REJECTED_ROWS_PER_FILE", rows_per_file)
    src = tmp_path / "in.csv"
    write_csv(src)
    out = tmp_path / "data"
    cfg = make_cfg(src, tiny_model_dir, min_chars=3, max_chars=200)
    cfg.data.encoding = "strict"  # the row with bytes that are not UTF-8 set aside (auto would read the file in cp1252)
    lines = []
    m = prepare(cfg, str(out), spark=spark, progress=lines.append)

    assert m.labels == ["neg", "pos"]
    assert m.counts["rows_read"] == 37
    assert m.counts["rows_rejected"] == {
        "null_text": 1, "empty_text": 1, "null_label": 1, "invalid_utf8": 1,
        "too_short": 1, "too_long": 1, "conflicting_labels": 2, "class_too_small": 2,
        "unknown_split": 0, "label_not_in_train": 0, "leaked": 0,  # reasons of the user's own split
        "no_tags": 0, "invalid_tags": 0,  # a multi-label run's
    }
    assert m.counts["duplicates_removed"] == 2
    assert m.counts["rows_kept"] == 37 - 10 - 2 == 25
    # the tiny class is named where the user reads, and the others go on without it
    assert any("class_too_small" in line and "'rare' 2" in line for line in lines), lines
    assert sum(m.counts["splits"].values()) == 25
    assert m.inputs == {"path": str(src), "format": "csv", "text_column": "text", "label_column": "label"}
    assert m.tokenizer["max_length"] == 128 and m.tokenizer["vocab_size"] == 30522
    assert any("rejected" in line for line in lines)
    # every kept row is in the length sample (fewer than LENGTH_SAMPLE); the texts are short
    lengths = m.tokenizer["lengths"]
    assert lengths["sample"] == 25 and 3 <= lengths["p50"] <= lengths["p99"] < 128
    assert lengths["truncated_share"] == 0.0
    assert any(line.startswith("token lengths (a sample of 25 rows): p50 ") for line in lines), lines

    rejected = pq.read_table(out / "rejected").to_pylist()
    assert {r["text"]: r["reason"] for r in rejected} == EXPECTED_REJECTS
    assert all(r["source"].endswith("in.csv") for r in rejected)

    rows = split_rows(out)
    texts = sorted(r["text"] for split in rows.values() for r in split)
    assert "Hello world, again" in texts
    assert 'Line one line "two"' in texts
    assert "Café crème" in texts and unicodedata.is_normalized("NFC", "Café crème")
    assert "ctlchars here" in texts
    assert texts.count("Dup text here") == 1
    for split in rows.values():
        for r in split:
            assert r["text"] == " ".join(r["text"].split())  # collapsed, stripped
            assert unicodedata.is_normalized("NFC", r["text"])
            assert not any(unicodedata.category(c) == "Cc" for c in r["text"])
            assert r["label_id"] == m.labels.index(r["label"])
            assert r["length"] == len(r["input_ids"]) <= 128
    for name in SPLITS:
        split = m.splits[name]
        assert split.rows == len(rows[name]) == sum(split.per_class.values())
        assert {lb: sum(r["label"] == lb for r in rows[name]) for lb in split.per_class} == split.per_class
    # 13 pos and 12 neg rows kept: 1 val and 1 test row per class at 0.1
    assert m.counts["splits"] == {"train": 21, "val": 2, "test": 2}

    table = pq.read_table(m.shard_uri(m.splits["train"].shards[0]))
    assert [f.name for f in table.schema] == list(COLUMNS)
    assert table.schema.field("label_id").type == pa.int32()
    assert table.schema.field("input_ids").type.value_type == pa.int32()
    assert json.loads((out / "manifest.json").read_text())["fingerprint"] == m.fingerprint
    assert leftovers(tmp_path, {"in.csv", "data"}) == []
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "rejected", "test", "torchloom-ledger.json",
                                                     "train", "val"]  # the ledger: what a later --overwrite may delete


def test_jsonl_parquet_and_folder_inputs(spark, tiny_model_dir, tmp_path):
    texts = [f"document number {i} about things" for i in range(12)]
    # JSONL with numeric labels and custom column names
    jsonl = tmp_path / "in.jsonl"
    jsonl.write_text("".join(json.dumps({"body": t, "cat": i % 2 + 1}) + "\n" for i, t in enumerate(texts)))
    cfg = make_cfg(jsonl, tiny_model_dir)
    cfg.data.text_column, cfg.data.label_column = "body", "cat"
    m = prepare(cfg, str(tmp_path / "j"), spark=spark)
    assert m.labels == ["1", "2"] and m.counts["rows_kept"] == 12 and m.inputs["format"] == "jsonl"
    nothing_rejected = pq.read_table(tmp_path / "j" / "rejected")  # written without a Spark job, same schema
    assert nothing_rejected.num_rows == 0 and nothing_rejected.column_names == ["text", "label", "reason", "source"]

    # Parquet, read through a directory (format decided by its contents)
    pdir = tmp_path / "pq"
    pdir.mkdir()
    pq.write_table(pa.table({"text": texts, "label": ["a", "b", "c"] * 4}), pdir / "part.parquet")
    m = prepare(make_cfg(pdir, tiny_model_dir), str(tmp_path / "p"), spark=spark)
    assert m.labels == ["a", "b", "c"] and m.counts["rows_kept"] == 12 and m.inputs["format"] == "parquet"
    assert m.counts["splits"] == {"train": 6, "val": 3, "test": 3}

    # folder per label: label = directory name (with a space), text = whole file
    root = tmp_path / "folder"
    for i, t in enumerate(texts):
        d = root / ("sci fi" if i % 2 else "news")
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{i:03d}.txt").write_text(f"{t}\nsecond line\n")
    m = prepare(make_cfg(root, tiny_model_dir), str(tmp_path / "f"), spark=spark)
    assert m.labels == ["news", "sci fi"] and m.inputs["format"] == "folder"
    rows = [r for split in split_rows(tmp_path / "f").values() for r in split]
    assert sorted(r["text"] for r in rows) == sorted(f"{t} second line" for t in texts)
    assert all(r["label"] == ("sci fi" if int(r["text"].split()[2]) % 2 else "news") for r in rows)


def test_csv_exports_separated_by_semicolons_or_tabs_are_read_at_their_separator(spark, tiny_model_dir, tmp_path):
    # Excel in much of Europe writes ";" into a .csv, other tools tabs: the header, one column holding the
    # separator, says which; UTF-8 (Spark's reader) and cp1252 (read whole and decoded) alike, one line each.
    rows = [(f"document number {i}; about things, {w}", "ab"[i % 2]) for i, w in enumerate(["tea", "café"] * 6)]
    for name, sep, codec, word in (("semi.csv", ";", "utf-8", "semicolons"), ("cp.csv", ";", "cp1252", "semicolons"),
                                   ("tabs.csv", "\t", "utf-8", "tabs")):
        body = f"text{sep}label\n" + "".join(f'"{t}"{sep}{lb}\n' for t, lb in rows)
        (tmp_path / name).write_bytes(body.encode(codec))
        lines: list[str] = []
        m = prepare(make_cfg(tmp_path / name, tiny_model_dir), str(tmp_path / f"out-{name}"), spark=spark,
                    progress=lines.append)
        assert m.counts["rows_kept"] == 12 and m.labels == ["a", "b"], (name, m.counts)
        assert f"{tmp_path / name}: its fields are separated by {word} (read from its header)" in lines, lines
        kept = [r["text"] for split in split_rows(tmp_path / f"out-{name}").values() for r in split]
        assert sorted(kept) == sorted(t for t, _ in rows), name
    # other column names: the error lists the columns as the separator splits them
    (tmp_path / "named.csv").write_text("body;topic\nsome text;a\n")
    with pytest.raises(UserError, match=r"no column 'text' and 'label'; columns found: body, topic; set"
                                        r" --data.text_column body --data.label_column topic$"):
        prepare(make_cfg(tmp_path / "named.csv", tiny_model_dir), str(tmp_path / "named"), spark=spark)
    # a comma-separated header with a ";" in a column's name is left as it is
    (tmp_path / "comma.csv").write_text("text,label;kind\nsome text,a\n")
    with pytest.raises(UserError, match=r"no column 'label'; columns found: text, label;kind"):
        prepare(make_cfg(tmp_path / "comma.csv", tiny_model_dir), str(tmp_path / "comma"), spark=spark)


def test_csv_files_of_one_input_with_other_headers_are_one_line_not_columns_read_by_position(
        spark, tiny_model_dir, tmp_path, monkeypatch):
    # Spark's CSV reader takes each file's columns by position: a file whose header says "label,text" gave its
    # labels as texts, silently. Now one line names the file and both headers, and nothing is written.
    import pyarrow as pa

    from torchloom.inputs import store_tasks

    d = tmp_path / "parts"
    d.mkdir()
    (d / "a.csv").write_text("\ufefftext,label\n" + "".join(f"alpha text {i},a\n" for i in range(6)), encoding="utf-8")
    (d / "b.csv").write_text("TEXT,Label\n" + "".join(f"beta text {i},b\n" for i in range(6)))  # same, in other case
    (d / "c.csv").write_bytes(("label,text\n" + "".join(f"a,gamma café {i}\n" for i in range(6))).encode("cp1252"))
    with pytest.raises(UserError) as e:
        prepare(make_cfg(d, tiny_model_dir), str(tmp_path / "out"), spark=spark)
    assert str(e.value) == (f"data.path {d / 'c.csv'}: its header (label, text) differs from that of {d / 'a.csv'}"
                            " (text, label), and columns are read by position; give every file of one input the"
                            " same header, in the same order")
    assert not (tmp_path / "out").exists()
    (d / "c.csv").unlink()
    # compressed files too (gzip, bz2): their header is read decompressed
    import bz2
    import gzip

    gz = tmp_path / "gz"
    gz.mkdir()
    with gzip.open(gz / "a.csv.gz", "wt") as f:
        f.write("text,label\n" + "".join(f"alpha text {i},a\n" for i in range(6)))
    (gz / "b.csv.bz2").write_bytes(bz2.compress(("label,text\n" + "".join(f"b,beta {i}\n" for i in range(6))).encode()))
    with pytest.raises(UserError, match=r"b.csv.bz2: its header \(label, text\) differs from that of .*a.csv.gz"):
        prepare(make_cfg(gz, tiny_model_dir), str(tmp_path / "out"), spark=spark)
    m = prepare(make_cfg(d, tiny_model_dir), str(tmp_path / "out"), spark=spark)
    assert m.counts["rows_kept"] == 12
    # one header written in UTF-8 and in cp1252 is one header
    fr = tmp_path / "fr"
    fr.mkdir()
    for name, codec, label in (("u.csv", "utf-8", "a"), ("w.csv", "cp1252", "b")):
        (fr / name).write_bytes(("texte,catégorie\n" + "".join(f"texte {name} {i},{label}\n" for i in range(6)))
                                .encode(codec))
    cfg = make_cfg(fr, tiny_model_dir)
    cfg.data.text_column, cfg.data.label_column = "texte", "catégorie"
    assert prepare(cfg, str(tmp_path / "out-fr"), spark=spark).counts["rows_kept"] == 12

    # the store reader's tasks check each object's header against the first's
    monkeypatch.setattr(store_tasks.storage, "open_input", lambda uri: pa.OSFile(uri))
    monkeypatch.setattr(store_tasks.storage, "redact", lambda uri: uri)
    (d / "c.csv").write_text("label,text\na,x\n")
    uris = [str(d / n) for n in ("a.csv", "b.csv", "c.csv")]
    ids = [pa.record_batch([pa.array([0, 1, 2])], ["id"])]
    with pytest.raises(RuntimeError, match=r"^torchloom-input-error: data.path .*c.csv: its header \(label, text\)"
                                           r" differs from that of .*a.csv \(text, label\)"):
        list(store_tasks.csv_task(iter(ids), uris, ",", "auto", names=["text", "label"]))


def test_labels_written_two_ways_stay_classes_and_one_warning_names_them(spark, tiny_model_dir, tmp_path):
    from torchloom.etl.clean import look_alike

    assert look_alike(["Sports", "sports", '["sports"]', "tech", "US", "u.s.", "-", "?"]) == [
        ["Sports", '["sports"]', "sports"], ["US", "u.s."]]
    src = tmp_path / "labels.csv"
    labels = ["Sport", "sport", "Tech"]
    src.write_text("text,label\n" + "".join(f"text number {i},{labels[i % 3]}\n" for i in range(30)))
    lines: list[str] = []
    m = prepare(make_cfg(src, tiny_model_dir), str(tmp_path / "out"), spark=spark, progress=lines.append)
    assert m.labels == ["Sport", "Tech", "sport"]  # as written: a warning, not a guess
    assert ("warning: 2 labels differ only in case, spaces or punctuation and are separate classes: 'Sport' and"
            " 'sport'; if each group is one class, write it one way in the data") in lines, lines


def test_columns_named_in_another_case_are_found(spark, tiny_model_dir, tmp_path):
    # pandas' to_csv of a frame with "Text" and "Label" columns: found as text and label (Spark resolves
    # names so too); "text" and "Text" both there: the exact one
    texts = [f"document number {i}" for i in range(12)]
    (tmp_path / "caps.csv").write_text("Text,LABEL\n" + "".join(f"{t},{'ab'[i % 2]}\n" for i, t in enumerate(texts)))
    (tmp_path / "caps.jsonl").write_text("".join(json.dumps({"TEXT": t, "Label": "ab"[i % 2]}) + "\n"
                                                 for i, t in enumerate(texts)))
    for name in ("caps.csv", "caps.jsonl"):
        m = prepare(make_cfg(tmp_path / name, tiny_model_dir), str(tmp_path / f"out-{name}"), spark=spark)
        assert m.labels == ["a", "b"] and m.counts["rows_kept"] == 12, name
        kept = [r["text"] for split in split_rows(tmp_path / f"out-{name}").values() for r in split]
        assert sorted(kept) == sorted(texts), name


def membership(out: Path) -> dict[str, set]:
    return {name: {(r["text"], r["label"]) for r in rows} for name, rows in split_rows(out).items()}


def test_split_is_deterministic_across_partitioning(spark, tiny_model_dir, tmp_path):
    rows = sorted(((f"row {i} says {'yes' if i % 3 else 'no'} to item {i * 7 % 13}", "abc"[i % 3]) for i in range(60)),
                  key=lambda r: r[1])  # sorted by label
    one = tmp_path / "one"
    one.mkdir()
    pq.write_table(pa.table({"text": [t for t, _ in rows], "label": [lb for _, lb in rows]}), one / "a.parquet")
    many = tmp_path / "many"
    many.mkdir()
    shuffled = rows[::-1]
    for k in range(4):
        chunk = shuffled[k::4]
        pq.write_table(pa.table({"text": [t for t, _ in chunk], "label": [lb for _, lb in chunk]}),
                       many / f"{k}.parquet")
    m1 = prepare(make_cfg(one, tiny_model_dir), str(tmp_path / "o1"), spark=spark)
    old = spark.conf.get("spark.sql.shuffle.partitions")
    spark.conf.set("spark.sql.shuffle.partitions", "7")
    try:
        m2 = prepare(make_cfg(many, tiny_model_dir), str(tmp_path / "o2"), spark=spark)
    finally:
        spark.conf.set("spark.sql.shuffle.partitions", old)
    assert membership(tmp_path / "o1") == membership(tmp_path / "o2")
    assert m1.fingerprint == m2.fingerprint
    # not just the same rows: the same shards, rows in the same order
    assert split_rows(tmp_path / "o1") == split_rows(tmp_path / "o2")
    # and that order mixes the classes (the loader shuffles only within bounded windows): the input
    # is sorted by label within each file, the shards must not be
    for shard_rows in split_rows(tmp_path / "o1").values():
        labels = [r["label"] for r in shard_rows]
        longest = max(len(list(run)) for _, run in itertools.groupby(labels))
        assert longest <= 6, labels
    assert m1.counts["splits"] == {"train": 48, "val": 6, "test": 6} and "heldout" not in m1.counts
    # prepare.heldout_rows: the held-out splits capped (each class still in them), the rest trains, and said why
    capped = prepare(make_cfg(one, tiny_model_dir, heldout_rows=3), str(tmp_path / "capped"), spark=spark)
    assert capped.counts["splits"] == {"train": 54, "val": 3, "test": 3}
    assert capped.counts["heldout"]["test"] == {"rows": 3, "by_fraction": 6, "cap": 3}
    assert "--prepare.heldout_rows 0" in capped.counts["heldout"]["why"]
    assert {r["label"] for r in split_rows(tmp_path / "capped")["val"]} == {"a", "b", "c"}
    assert membership(tmp_path / "capped")["test"] < membership(tmp_path / "o1")["test"]  # a subset: the same ranks
    # another seed moves rows between splits and changes the fingerprint
    m3 = prepare(make_cfg(one, tiny_model_dir, seed=7), str(tmp_path / "o3"), spark=spark)
    assert m3.fingerprint != m1.fingerprint
    assert membership(tmp_path / "o3") != membership(tmp_path / "o1")


@pytest.mark.parametrize("strategy", ["head", "head_tail"])
def test_token_ids_match_transformers_and_row_groups_are_bounded(spark, tiny_model_dir, tmp_path, strategy):
    from transformers import AutoTokenizer

    from torchloom.text.truncation import cut

    long_text = " ".join(f"word{i} Ünïcödé, punctuation!" for i in range(200))
    texts = ["Short one.", "Crème brûlée at the café", long_text, "x" * 3000, "tokenization " * 40]
    texts += [f"extra text {i}" for i in range(25)]
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"text": texts, "label": ["a", "b"] * 15}), src)
    out = tmp_path / "data"
    m = prepare(make_cfg(src, tiny_model_dir, max_length=32, rows_per_group=4, val_fraction=0.0,
                         truncation=strategy), str(out), spark=spark)
    hf = AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)
    rows = [r for split in split_rows(out).values() for r in split]
    assert len(rows) == 30
    for r in rows:  # the oracle: transformers' own truncation, or the whole encoding cut by head_tail's rule
        expected = (hf(r["text"], truncation=True, max_length=32)["input_ids"] if strategy == "head" else
                    cut(hf(r["text"])["input_ids"], 32, "head_tail"))
        assert r["input_ids"] == expected, r["text"][:40]
    assert max(r["length"] for r in rows) == 32
    assert m.splits["val"].rows == 0 and m.splits["val"].shards == []
    for name in SPLITS:
        for shard in m.splits[name].shards:
            meta = pq.ParquetFile(m.shard_uri(shard)).metadata
            groups = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
            assert groups == shard.row_groups and sum(groups) == shard.rows > 0
            assert max(groups) <= 4


def test_input_errors_are_one_line_and_leave_nothing(spark, tiny_model_dir, tmp_path):
    work = tmp_path / "w"
    work.mkdir()
    out = work / "data"

    def fails(cfg, *fragments):
        with pytest.raises(UserError) as e:
            prepare(cfg, str(out), spark=spark)
        msg = str(e.value)
        assert "\n" not in msg
        for fragment in fragments:
            assert fragment in msg, msg
        assert list(work.iterdir()) == []  # no out_dir, no temp dir
        return msg

    fails(make_cfg(tmp_path / "nope.csv", tiny_model_dir), "nope.csv", "no such file")
    fails(make_cfg(tmp_path / "nope" / "*.csv", tiny_model_dir), "nothing matched")
    present = tmp_path / "present.csv"
    present.write_text("text,label\nhello there,a\n")
    for key in ("val_path", "test_path"):  # the line names the option that holds the missing path
        cfg = make_cfg(present, tiny_model_dir)
        setattr(cfg.data, key, str(tmp_path / f"no_{key}.csv"))
        msg = fails(cfg, f"data.{key} ", f"no_{key}.csv", "no such file")
        assert "data.path" not in msg, msg

    csv = tmp_path / "cols.csv"
    csv.write_text("body,label\nhello there,a\n")
    fails(make_cfg(csv, tiny_model_dir), "'text'", "columns found: body, label", "--data.text_column")

    empty = tmp_path / "empty.csv"
    empty.write_text("text,label\n   ,a\n\"\",b\n,c\n")
    fails(make_cfg(empty, tiny_model_dir), "no usable rows", "empty_text")

    small = tmp_path / "small.csv"
    small.write_text("text,label\n" + "".join(f"text {i},big\n" for i in range(10)) + "one,tiny\ntwo,tiny\n")
    # set aside, 'tiny' would leave one class: nothing to classify
    fails(make_cfg(small, tiny_model_dir), "only 'big' has the 3 usable rows", "too small: 'tiny' (2)",
          "--prepare.val_fraction")
    single = tmp_path / "single.csv"
    single.write_text("text,label\n" + "".join(f"text {i},only\n" for i in range(10)))
    fails(make_cfg(single, tiny_model_dir), "every usable row (10) has the label 'only'", "at least 2 classes",
          "--data.label_column")

    out.mkdir()
    (out / "keep.txt").write_text("old")
    with pytest.raises(UserError, match="--output.overwrite true"):
        prepare(make_cfg(small, tiny_model_dir), str(out), spark=spark)
    assert sorted(p.name for p in work.iterdir()) == ["data"]
    assert (out / "keep.txt").read_text() == "old"


def test_overwrite_replaces_output(spark, tiny_model_dir, tmp_path):
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"text": [f"text {i}" for i in range(6)], "label": ["a", "b"] * 3}), src)
    out = tmp_path / "data"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    cfg = make_cfg(src, tiny_model_dir)
    cfg.output.overwrite = True
    with pytest.raises(UserError, match="not replaced: it is neither empty nor a torchloom"):
        prepare(cfg, str(out), spark=spark)  # not prepared data: --overwrite leaves it alone
    Manifest(labels=["a", "b"], splits={}, tokenizer={}, fingerprint="x").write(out)  # an earlier prepare's
    with pytest.raises(UserError, match="not replaced, nothing deleted: it holds stale.txt, which no marker"):
        prepare(cfg, str(out), spark=spark)  # prepared data, but beside something of someone else's
    (out / "stale.txt").rename(out / "train")  # a name prepared data uses proves nothing
    with pytest.raises(UserError, match="it holds train, which no marker of torchloom's vouches for"):
        prepare(cfg, str(out), spark=spark)
    (out / "train").unlink()
    m = prepare(cfg, str(out), spark=spark)
    assert (out / "train").is_dir() and m.counts["rows_kept"] == 6
    assert leftovers(tmp_path, {"in.parquet", "data"}) == []
    assert read_manifest(out).fingerprint == m.fingerprint
    # prepared data lists its own files (its ledger): prepared again over itself, and never over a file of yours
    again = prepare(cfg, str(out), spark=spark)
    assert again.fingerprint == m.fingerprint
    (out / "train" / "mine.csv").write_text("text,label\n")
    with pytest.raises(UserError, match=r"it holds train/mine.csv, which torchloom did not write"):
        prepare(cfg, str(out), spark=spark)
    assert (out / "train" / "mine.csv").read_text() == "text,label\n"


@pytest.mark.slow
def test_bbc_news_demo(spark, tiny_model_dir, tmp_path):
    cfg = make_cfg("", tiny_model_dir)
    m = prepare(cfg, str(tmp_path / "data"), spark=spark)
    assert len(m.labels) == 5 and m.labels == sorted(m.labels)
    assert m.counts["rows_read"] == 2225
    # sports/199.txt holds a Latin-1 byte: read in cp1252 (data.encoding auto), not set aside
    assert m.counts["rows_rejected"]["invalid_utf8"] == 0 and m.counts["decoded"] == {"cp1252": 1}
    assert m.counts["duplicates_removed"] == 100
    assert m.counts["rows_kept"] == 2125 == sum(m.counts["splits"].values())
    # news articles are long: the token lengths say most are cut at 128
    lengths = m.tokenizer["lengths"]
    assert lengths["sample"] == 2000 and 128 < lengths["p50"] < lengths["p90"] <= lengths["p99"]
    assert lengths["truncated_share"] > 0.9


def window_split_oracle(kept, plans, seed: int) -> dict:
    """The split by definition: rank every class in one window ordered by (seeded hash, text)."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    ends = {p.label: (p.test, p.test + p.val) for p in plans}
    order = Window.partitionBy("label").orderBy(F.xxhash64(F.lit(seed), F.col("text")), F.col("text"))
    out = {}
    for r in kept.withColumn("rank", F.row_number().over(order)).collect():
        test_end, val_end = ends[r.label]
        out[(r.text, r.label)] = "test" if r.rank <= test_end else "val" if r.rank <= val_end else "train"
    return out


@pytest.mark.parametrize("bits", [None, 2])
def test_bucketed_split_ranks_equal_one_window_per_class(spark, monkeypatch, bits):
    from torchloom.etl import split as split_mod

    if bits is not None:  # 4 buckets per class: many rows share a bucket, so offsets and in-bucket order both count
        monkeypatch.setattr(split_mod, "RANK_BUCKET_BITS", bits)
    sizes = {"a": 151, "b": 40, "c": 9}
    rows = [(f"{label} text number {i} with words {i * 31 % 17}", label) for label, n in sizes.items()
            for i in range(n)]
    kept = spark.createDataFrame(rows, "text string, label string").repartition(5)
    plans, small = split_mod.plan_split(sizes, 0.1, 0.2, "test")
    assert small == {}
    got = {(r.text, r.label): r.split for r in split_mod.assign_splits(kept, plans, seed=3).collect()}
    assert got == window_split_oracle(kept, plans, seed=3)
    for p in plans:
        mine = [s for (_, label), s in got.items() if label == p.label]
        assert (mine.count("train"), mine.count("val"), mine.count("test")) == (p.train, p.val, p.test)


def given_rows() -> list[tuple[str, str, str]]:
    """Train rows of two labels, test rows the user chose (split values in any case), no val rows."""
    rows = []
    for i in range(30):
        rows += [(f"apple text number {i}", "fruit", "train"), (f"car text number {i}", "auto", "Train")]
    for i in range(5):
        rows += [(f"apple test {i}", "fruit", "TEST"), (f"car test {i}", "auto", " test ")]
    return rows


def test_a_split_column_is_kept_and_a_leaked_text_is_found(spark, tiny_model_dir, tmp_path):
    import csv

    rows = given_rows() + [
        ("apple text number 3", "fruit", "test"),  # also in train: leaked
        ("mystery row", "fruit", "holdout"),  # no split of ours: unknown_split
        ("a boat", "boat", "test"),  # a label no train row has
    ]
    src = tmp_path / "given.csv"
    with src.open("w", newline="") as f:
        csv.writer(f).writerows([("text", "label", "part"), *rows])
    given_test = {text for text, _, part in rows if part.strip().lower() == "test" and text != "a boat"}

    lines = []
    cfg = make_cfg(src, tiny_model_dir)
    cfg.data.split_column = "part"
    m = prepare(cfg, str(tmp_path / "report"), spark=spark, progress=lines.append)
    got = split_rows(tmp_path / "report")
    assert {r["text"] for r in got["test"]} == given_test  # the user's test rows, all and only them
    assert m.counts["leaked"] == {"val": 0, "test": 1}
    assert m.counts["rows_rejected"]["unknown_split"] == 1 and m.counts["rows_rejected"]["label_not_in_train"] == 1
    # no val rows given: carved from the train rows by val_fraction (0.1 of 30 per class)
    train_given = {text for text, _, part in rows if part.strip().lower() == "train"}
    assert len(got["val"]) == 6 and {r["text"] for r in got["val"]} <= train_given
    assert {r["text"] for r in got["train"]} | {r["text"] for r in got["val"]} == train_given
    assert any(line.startswith("leakage: 1 test and 0 val texts also appear in train (kept") for line in lines), lines
    assert m.inputs["split_column"] == "part" and m.counts["split"] == "column 'part'"

    cfg.prepare.leakage = "drop"
    m = prepare(cfg, str(tmp_path / "drop"), spark=spark)
    assert {r["text"] for r in split_rows(tmp_path / "drop")["test"]} == given_test - {"apple text number 3"}
    assert m.counts["rows_rejected"]["leaked"] == 1 and m.counts["leaked"] == {"val": 0, "test": 1}
    rejected = {r["text"]: r["reason"] for r in pq.read_table(tmp_path / "drop" / "rejected").to_pylist()}
    assert rejected["apple text number 3"] == "leaked" and rejected["mystery row"] == "unknown_split"


def test_separate_val_and_test_inputs_are_kept(spark, tiny_model_dir, tmp_path):
    import csv

    rows = given_rows()
    train = tmp_path / "train.csv"
    with train.open("w", newline="") as f:
        csv.writer(f).writerows([("text", "label"), *[(t, lb) for t, lb, part in rows if "rain" in part]])
    test = tmp_path / "test.jsonl"  # another format: each input's own is found
    test.write_text("".join(json.dumps({"text": t, "label": lb}) + "\n" for t, lb, part in rows if "est" in part))
    val = tmp_path / "val.csv"
    val.write_text("text,label\nan apple for val,fruit\na car for val,auto\n")
    cfg = make_cfg(train, tiny_model_dir)
    cfg.data.val_path, cfg.data.test_path = str(val), str(test)
    m = prepare(cfg, str(tmp_path / "out"), spark=spark)
    got = split_rows(tmp_path / "out")
    assert {r["text"] for r in got["test"]} == {t for t, _, part in rows if "est" in part}
    assert {r["text"] for r in got["val"]} == {"an apple for val", "a car for val"}  # given: nothing carved
    assert len(got["train"]) == 60 and m.counts["leaked"] == {"val": 0, "test": 0}
    from torchloom.config import build

    with pytest.raises(UserError, match="set only one"):
        build(None, ["--data.split_column", "part", "--data.test_path", str(test)])


def test_a_replacement_character_in_valid_utf8_is_text_not_a_decoding_error(spark, tiny_model_dir, tmp_path):
    # U+FFFD written on purpose in a valid UTF-8 file (or a Parquet string) is kept; only a file with bytes
    # that are not UTF-8 makes it a decoding error (the CSV test above: invalid_utf8)
    rows = [(f"plain text {i}", "a" if i % 2 else "b") for i in range(20)] + [("mojibake \ufffd kept", "a")]
    src = tmp_path / "valid.csv"
    src.write_text("text,label\n" + "".join(f"{t},{lb}\n" for t, lb in rows), encoding="utf-8")
    m = prepare(make_cfg(src, tiny_model_dir), str(tmp_path / "csv"), spark=spark)
    assert m.counts["rows_rejected"]["invalid_utf8"] == 0 and m.counts["rows_kept"] == 21
    pq.write_table(pa.table({"text": [t for t, _ in rows], "label": [lb for _, lb in rows]}), tmp_path / "v.parquet")
    m = prepare(make_cfg(tmp_path / "v.parquet", tiny_model_dir), str(tmp_path / "pq"), spark=spark)
    assert m.counts["rows_rejected"]["invalid_utf8"] == 0 and m.counts["rows_kept"] == 21
