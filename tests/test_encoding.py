"""data.encoding: the per-file decision (inputs/encoding.py), and prepare reading folders, CSV files and objects of a
store in the encoding they were written in, counting what was not UTF-8."""

from __future__ import annotations

import codecs
from pathlib import Path

import pytest

from torchloom.errors import UserError
from torchloom.inputs.encoding import Undecodable, decode, detect

WORDS = ["apple pie recipe", "garden tools sale", "train timetable change", "football score tonight",
         "piano lesson booked", "river walk photos", "tax form reminder", "birthday party plans"]


@pytest.mark.parametrize("raw, text, codec", [
    ("café €".encode(), "café €", "utf-8"),
    (codecs.BOM_UTF8 + "café".encode(), "café", "utf-8"),  # the BOM is dropped
    ("café €".encode("cp1252"), "café €", "cp1252"),
    ("café".encode("latin-1") + b"\x81", "café\x81", "latin-1"),  # 0x81 is undefined in cp1252
    ("café €".encode("utf-16"), "café €", "utf-16"),  # a BOM, either byte order
    (codecs.BOM_UTF16_BE + "café €".encode("utf-16-be"), "café €", "utf-16"),
    # UTF-8 with a stray byte: as many good multi-byte characters as bad bytes, so the bad one becomes U+FFFD
    # (in cp1252 the good "é" would read "Ã©"); a UTF-8 BOM counts as a good one, and is dropped
    (b"caf\xc3\xa9 and a stray \xff byte", "café and a stray \ufffd byte", "utf-8-replaced"),
    (codecs.BOM_UTF8 + b"a stray \xff", "a stray \ufffd", "utf-8-replaced"),
    (b"caf\xe9 \xe0 la cr\xe8me, caf\xc3\xa9", "café à la crème, cafÃ©", "cp1252"),  # more bad bytes than good
    (b"", "", "utf-8"),
])
def test_auto_decides_per_file_from_all_its_bytes(raw, text, codec):
    assert decode(raw, "auto") == (text, codec)
    # streamed in chunks of any size (the object store reader), the same decision
    for size in (1, 3):
        chunks = [raw[i:i + size] for i in range(0, len(raw), size)]
        assert decode(raw, "auto")[1] == decode(b"".join(chunks), "auto")[1]
        assert codecs.lookup(detect(chunks, "auto")).name == codecs.lookup(detect([raw], "auto")).name


def test_a_forced_codec_reads_every_file_in_it_or_says_where_it_cannot():
    assert decode("café".encode(), "cp1252") == ("cafÃ©", "cp1252")  # no guessing past what is forced
    assert decode("café".encode("latin-1"), "latin1") == ("café", "latin-1")
    assert decode("naïve".encode("utf-16-le"), "utf-16-le") == ("naïve", "utf-16-le")
    with pytest.raises(Undecodable, match=r"not valid cp1252 at byte 4 \("):
        decode(b"caf\xe9\x81", "cp1252")
    with pytest.raises(Undecodable, match="not valid utf-8 at byte 3"):
        detect([b"caf", b"\xe9 x"], "utf-8")


def test_an_unknown_encoding_is_one_config_line_before_spark():
    from torchloom.config.load import build

    assert build(None, ["--data.encoding", "cp1252"]).data.encoding == "cp1252"
    for value, problem in (("latin-9000", "no such encoding"), ("rot13", "not a text encoding")):
        with pytest.raises(UserError) as e:
            build(None, ["--data.encoding", value])
        line = str(e.value)
        assert line.startswith(f"config data.encoding: '{value}' is {problem}; use auto, strict") and "\n" not in line


def test_cleaning_decodes_the_files_the_text_source_passed_undecoded():
    # a folder's files reach cleaning as bytes (codec RAW); a typed string (Parquet, codec null) and a row a
    # reader decoded already (codec named) are never decoded again
    import pyarrow as pa

    from torchloom.etl.clean import RAW, clean_batches

    texts = ["café".encode(), "café".encode("cp1252"), "typed café".encode(), "decoded €".encode()]
    batch = pa.record_batch([pa.array(texts, pa.binary()).cast(pa.string(), safe=False), pa.array(["a"] * 4),
                             pa.array(["file:/x/a/1.txt", "file:/x/a/2.txt", "p.parquet", "c.csv"]),
                             pa.array([RAW, RAW, None, "cp1252"])], ["text", "label", "source", "codec"])

    def clean(encoding):
        rows = pa.Table.from_batches(clean_batches(1, 0, encoding=encoding)(iter([batch]))).to_pylist()
        return [(r["text"], r["reason"], r["codec"]) for r in rows]

    assert clean("auto") == [("café", None, None), ("café", None, "cp1252"), ("typed café", None, None),
                             ("decoded €", None, "cp1252")]
    # a forced codec reads every file in it, valid UTF-8 or not
    assert clean("cp1252")[:3] == [("cafÃ©", None, "cp1252"), ("café", None, "cp1252"), ("typed café", None, None)]
    assert clean("strict")[:2] == [("café", None, None), ("caf\ufffd", "invalid_utf8", None)]
    with pytest.raises(RuntimeError, match=r"data.path /x/a/2.txt: not valid utf-8 at byte 3 .* data.encoding utf-8"):
        clean("utf-8")


def test_the_store_reader_decides_per_object(tmp_path, monkeypatch):
    # the tasks of inputs/store_tasks.py, without a store: pyarrow opens the local files as it would the objects
    import pyarrow as pa

    from torchloom.inputs import store_tasks

    monkeypatch.setattr(store_tasks.storage, "open_input", lambda uri: pa.OSFile(uri))
    monkeypatch.setattr(store_tasks.storage, "redact", lambda uri: uri)
    files = {"a/1.txt": "café €".encode("cp1252"), "a/2.txt": b"plain", "b/3.txt": "naïve".encode("utf-16"),
             "b/4.txt": codecs.BOM_UTF8 + b"stray \xff"}
    for rel, raw in files.items():
        (tmp_path / rel).parent.mkdir(exist_ok=True)
        (tmp_path / rel).write_bytes(raw)
    uris = [str(tmp_path / rel) for rel in files]
    ids = [pa.record_batch([pa.array([0, 1, 2, 3])], ["id"])]
    rows = pa.Table.from_batches(store_tasks.folder_task(iter(ids), uris, "auto")).to_pylist()
    assert [(r["text"], r["label"], r[store_tasks.CODEC]) for r in rows] == [
        ("café €", "a", "cp1252"), ("plain", "a", "utf-8"), ("naïve", "b", "utf-16"),
        ("stray \ufffd", "b", "utf-8-replaced")]
    strict = pa.Table.from_batches(store_tasks.folder_task(iter(ids), uris)).to_pylist()
    assert strict[0]["text"] == "caf\ufffd \ufffd" and strict[0][store_tasks.CODEC] is None  # as Spark decodes

    csv = tmp_path / "t.csv"
    csv.write_bytes("text,label\ncrème brûlée,a\n\"two\nlines €\",b\n".encode("cp1252"))
    one = [pa.record_batch([pa.array([0])], ["id"])]
    rows = pa.Table.from_batches(store_tasks.csv_task(iter(one), [str(csv)], ",", "auto")).to_pylist()
    assert [(r["record"], r[store_tasks.CODEC]) for r in rows] == [
        ("crème brûlée,a", "cp1252"), ('"two\nlines €",b', "cp1252")]
    with pytest.raises(RuntimeError, match=r"torchloom-input-error: data.path .*t.csv: not valid utf-8 at byte 13"
                                           r" \(invalid continuation byte\), so data.encoding utf-8 cannot read it;"
                                           r" set data.encoding to the file's encoding, or auto"):
        list(store_tasks.csv_task(iter(one), [str(csv)], ",", "utf-8"))


# -- prepare on the shared local Spark -----------------------------------------------------------------


def write_folder(root: Path) -> dict[str, str]:
    """root/<label>/*.txt in UTF-8 (with and without a BOM), cp1252, latin-1, UTF-16 and UTF-8 with a stray
    byte; returns each file's text as it should be read."""
    texts = {}
    for i, words in enumerate(WORDS * 2):
        texts[f"{'ab'[i % 2]}/u{i}.txt"] = (f"{words} number {i}", "utf-8")
    texts["a/bom.txt"] = ("with a bom", "utf-8-sig")
    texts["a/cp.txt"] = ("café costs 5 €", "cp1252")
    texts["b/cp.txt"] = ("“quoted” reply", "cp1252")
    texts["b/latin.txt"] = ("naïve\x81 latin one", "latin-1")  # a byte cp1252 leaves undefined
    texts["a/wide.txt"] = ("wide Ünïcode text", "utf-16")
    for rel, (text, codec) in texts.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(text.encode(codec))
    (root / "b" / "stray.txt").write_bytes(b"mostly utf-8 caf\xc3\xa9 but one \xff")
    return {**{rel: text for rel, (text, _) in texts.items()}, "b/stray.txt": "mostly utf-8 café but one \ufffd"}


def texts_of(out: Path) -> set[str]:
    import pyarrow.parquet as pq

    from torchloom.manifest import SPLITS
    from torchloom.manifest import read as read_manifest

    m = read_manifest(out)
    return {r["text"] for name in SPLITS for shard in m.splits[name].shards
            for r in pq.read_table(m.shard_uri(shard), columns=["text"]).to_pylist()}


def prepared(spark, model_dir: str, path: Path, out: Path, encoding: str, lines: list | None = None):
    from torchloom.config.schema import Config
    from torchloom.etl.prepare import prepare

    cfg = Config()
    cfg.data.path, cfg.data.encoding, cfg.model.path = str(path), encoding, model_dir
    cfg.prepare.val_fraction = cfg.prepare.test_fraction = 0.0  # every kept text in train, to read back
    return prepare(cfg, str(out), spark=spark, progress=(lines if lines is not None else []).append)


def test_a_folder_of_mixed_encodings_is_read_whole_and_counted(spark, tiny_model_dir, tmp_path):
    pytest.importorskip("pyspark")
    expected = write_folder(tmp_path / "mail")
    lines: list[str] = []
    m = prepared(spark, tiny_model_dir, tmp_path / "mail", tmp_path / "auto", "auto", lines)
    assert m.counts["rows_read"] == m.counts["rows_kept"] == len(expected) == 22
    assert m.counts["rows_rejected"]["invalid_utf8"] == 0
    assert m.counts["decoded"] == {"cp1252": 2, "latin-1": 1, "utf-16": 1, "utf-8-replaced": 1}
    assert ("decoded as cp1252: 2 files, latin-1: 1 files, utf-16: 1 files, utf-8-replaced: 1 files (data.encoding"
            " auto; the rest UTF-8)") in lines, lines
    assert texts_of(tmp_path / "auto") == {" ".join(t.replace("\x81", "").split()) for t in expected.values()}

    # strict: today's rule, every file that is not UTF-8 set aside
    m = prepared(spark, tiny_model_dir, tmp_path / "mail", tmp_path / "strict", "strict")
    assert m.counts["rows_rejected"]["invalid_utf8"] == 5 and m.counts["rows_kept"] == 17
    assert "decoded" not in m.counts

    # a forced codec that one file is not in: one line naming the file, and nothing written
    with pytest.raises(UserError) as e:
        prepared(spark, tiny_model_dir, tmp_path / "mail", tmp_path / "forced", "utf-8")
    assert "\n" not in str(e.value) and "not valid utf-8 at byte" in str(e.value), e.value
    assert str(e.value).endswith("set data.encoding to the file's encoding, or auto to decide per file")
    assert not (tmp_path / "forced").exists()


def test_csv_files_in_cp1252_and_utf16_beside_utf8_ones(spark, tiny_model_dir, tmp_path):
    pytest.importorskip("pyspark")
    d = tmp_path / "csv"
    d.mkdir()
    utf8 = [(f"{w} in utf-8", "ab"[i % 2]) for i, w in enumerate(WORDS)]
    cp = [("café au lait", "a"), ("a price of 5 €", "b"), ('"quoted, with a comma" ÿ', "a")]
    wide = [("naïve résumé", "b"), ("über straße", "a")]
    for name, rows, codec in (("u.csv", utf8, "utf-8"), ("cp.csv", cp, "cp1252"), ("w.csv", wide, "utf-16")):
        body = "text,label\r\n" + "".join('"' + t.replace('"', '""') + f'",{lb}\r\n' for t, lb in rows)
        (d / name).write_bytes(body.encode(codec))
    lines: list[str] = []
    m = prepared(spark, tiny_model_dir, d, tmp_path / "auto", "auto", lines)
    assert m.counts["rows_read"] == m.counts["rows_kept"] == 13
    assert m.counts["decoded"] == {"cp1252": 3, "utf-16": 2}
    assert any(line.startswith("decoded as cp1252: 3 rows, utf-16: 2 rows") for line in lines), lines
    assert texts_of(tmp_path / "auto") == {t for t, _ in utf8 + cp + wide}

    # cp1252 forced: the UTF-8 file is read in cp1252 too (its text changes, as asked), every row counted
    (d / "w.csv").unlink()
    m = prepared(spark, tiny_model_dir, d, tmp_path / "forced", "cp1252")
    assert m.counts["decoded"] == {"cp1252": 11} and m.counts["rows_kept"] == 11
    assert "café au lait" in texts_of(tmp_path / "forced")
