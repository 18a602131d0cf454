"""Which encoding a file's bytes are read in (data.encoding): the one decision every reader of prepare makes.

Spark's text source (folder inputs) hands the bytes over undecoded, and the CSV/JSON lines readers either
read files the driver found to be UTF-8 or hand the bytes of the others over whole (inputs/read.py), and the
object store reader streams them (inputs/store_read.py): each then calls `detect` or `decode` here, so a file
is read in the same encoding on the local Spark, a cluster's executors or from a store. `predict --input`
reads its files by the same rule (model/predict.py, batch/files.py), so a file prepare reads is one
predict reads. Pure Python, no imports beyond the standard library: it runs inside Spark's Python workers.

data.encoding:
- "auto": UTF-8 (a BOM dropped); UTF-16 with its BOM (either byte order); UTF-8 with its few bad bytes as
  U+FFFD ("utf-8-replaced") where the file holds at least as many well-formed multi-byte UTF-8 characters as bad bytes
  (a UTF-8 file with stray bytes: in cp1252 each of its good characters would turn into two or three wrong
  ones); else cp1252 where every byte is defined in it, else latin-1 (which decodes any byte). One decision
  per file, from all of its bytes.
- a Python codec name: that codec for every file; a file it cannot decode raises Undecodable (never read
  with replaced characters).
- "strict": not decided here; the readers keep UTF-8 with U+FFFD for bad bytes, set aside as invalid_utf8.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable

AUTO = "auto"
STRICT = "strict"
UTF8 = "utf-8"
# Bytes cp1252 leaves undefined: a file holding one is latin-1 (which maps them to C1 controls).
CP1252_UNDEFINED = (b"\x81", b"\x8d", b"\x8f", b"\x90", b"\x9d")
REPLACED = "utf-8-replaced"  # a codec of our own: UTF-8 whose bytes that are not UTF-8 decode as U+FFFD

# An input's `codec` for a row whose text is its file's bytes, not yet decoded (Spark's text source: a folder)
RAW = ""


def _search(codec: str) -> codecs.CodecInfo | None:
    """REPLACED for codecs.lookup, so every reader (bytes.decode, io.TextIOWrapper) takes it as a codec name."""
    if codec.replace("_", "-") != REPLACED:
        return None
    utf8 = codecs.lookup(UTF8)
    return codecs.CodecInfo(name=REPLACED, encode=utf8.encode,
                            decode=lambda data, errors="strict": utf8.decode(data, "replace"),
                            incrementalencoder=utf8.incrementalencoder,
                            incrementaldecoder=lambda errors="strict": utf8.incrementaldecoder("replace"),
                            streamreader=utf8.streamreader, streamwriter=utf8.streamwriter)


codecs.register(_search)


class Undecodable(ValueError):
    """A file's bytes are not valid in the codec data.encoding forces."""

    def __init__(self, codec: str, position: int, reason: str):
        super().__init__(f"not valid {codec} at byte {position} ({reason})")
        self.codec, self.position = codec, position


def name(codec: str) -> str:
    """A codec's name in lines and the manifest: Python's own (cp1252, utf-16), latin-1 for iso8859-1."""
    canonical = codecs.lookup(codec).name
    return {"iso8859-1": "latin-1", "utf-8-sig": UTF8}.get(canonical, canonical)


def detect(chunks: Iterable[bytes], encoding: str) -> str:
    """The codec to decode a whole file with, from its bytes in order (any chunking), as data.encoding says;
    raises Undecodable where a forced codec cannot decode them. UTF-8 is "utf-8-sig" (drops a BOM)."""
    forced = None if encoding == AUTO else codecs.lookup(encoding).name
    if forced == UTF8:
        forced = "utf-8-sig"
    main = _Check(forced or "utf-8-sig", forced is not None)
    evidence = _Utf8Evidence() if forced is None else None
    utf16: _Check | None = None
    cp1252, head = True, b""
    for chunk in chunks:
        if evidence is not None:
            evidence.feed(chunk)
        rest = chunk
        if len(head) < 2:  # the UTF-16 decoder wants its BOM whole in its first input
            taken = chunk[:2 - len(head)]
            head, rest = head + taken, chunk[len(taken):]
            if forced is None and head in (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE):
                utf16 = _Check("utf-16", False)
                rest = head + rest
        main.feed(chunk)
        if utf16 is not None:
            utf16.feed(rest)
        cp1252 = cp1252 and not any(b in chunk for b in CP1252_UNDEFINED)
    if main.feed(b"", final=True) or forced:
        return main.codec
    if utf16 is not None and utf16.feed(b"", final=True):
        return "utf-16"
    if evidence is not None and evidence.mostly_utf8():
        return REPLACED
    return "cp1252" if cp1252 else "latin-1"


class _Utf8Evidence:
    """How many well-formed multi-byte UTF-8 characters and how many bad bytes the bytes fed in order hold."""

    def __init__(self) -> None:
        self.decoder = codecs.getincrementaldecoder(UTF8)("replace")
        self.good = self.bad = 0

    def feed(self, chunk: bytes) -> None:
        text = self.decoder.decode(chunk)
        bad = text.count("\ufffd")
        self.bad += bad
        self.good += sum(1 for ch in text if ord(ch) > 127) - bad

    def mostly_utf8(self) -> bool:
        self.feed(b"")
        self.bad += self.decoder.decode(b"", True).count("\ufffd")
        return self.good > 0 and self.good >= self.bad


class _Check:
    """Whether bytes fed in order decode in `codec` (an incremental decoder whose text is dropped)."""

    def __init__(self, codec: str, forced: bool):
        self.codec, self.forced, self.ok, self.seen = codec, forced, True, 0
        self.decoder = codecs.getincrementaldecoder(codec)()

    def feed(self, chunk: bytes, final: bool = False) -> bool:
        if self.ok:
            pending = len(self.decoder.getstate()[0])  # bytes of an unfinished character, held from before
            try:
                self.decoder.decode(chunk, final)
            except UnicodeDecodeError as e:
                if self.forced:
                    raise Undecodable(name(self.codec), self.seen - pending + e.start, e.reason) from None
                self.ok = False
            self.seen += len(chunk)
        return self.ok


def skip(head: bytes, codec: str, encoding: str) -> int:
    """The bytes to skip at a file's start before decoding it in `codec`: a UTF-8 BOM that auto found
    followed by bytes that are not UTF-8 (a UTF-8 file with a stray byte), which would read as "ï»¿"."""
    fallback = encoding == AUTO and codec in ("cp1252", "latin-1", REPLACED)
    return len(codecs.BOM_UTF8) if fallback and head.startswith(codecs.BOM_UTF8) else 0


def file_codec(path: str, chunk: int = 1 << 22) -> str:
    """The codec auto reads a local file in: "utf-8-sig" where it is UTF-8 (one pass at C speed), else
    `detect`'s choice from a second pass."""
    def chunks():
        with open(path, "rb") as f:
            while block := f.read(chunk):
                yield block

    decoder = codecs.getincrementaldecoder(UTF8)()
    try:
        for block in chunks():
            decoder.decode(block)
        decoder.decode(b"", True)
        return "utf-8-sig"
    except UnicodeDecodeError:
        return detect(chunks(), AUTO)


# Compressed files whose first bytes the standard library can read (Spark reads these and more: .snappy, .zst).
DECOMPRESSORS = {".gz": "gzip", ".bz2": "bz2"}


def head_text(path: str, size: int = 1 << 16) -> str:
    """A local file's first `size` bytes as text, in the encoding they tell (`detect` on them alone): enough for
    a CSV's header, read right whether the file is UTF-8, cp1252 or UTF-16, plain or compressed (gzip, bz2; a
    compressed file cut short: what it holds before the cut). Raises ValueError for another compression."""
    import importlib

    suffix = path[path.rfind("."):].lower() if "." in path else ""
    if suffix in (".snappy", ".zst", ".lz4"):
        raise ValueError(f"{path}: {suffix} is not read here")
    opener = importlib.import_module(DECOMPRESSORS[suffix]).open if suffix in DECOMPRESSORS else open
    head = b""
    with opener(path, "rb") as f:
        try:
            while len(head) < size and (chunk := f.read(size - len(head))):
                head += chunk
        except (EOFError, OSError):  # cut short, or damaged: what came before it (Spark's read says the rest)
            pass
    codec = detect([head], AUTO)
    return head[skip(head[:3], codec, AUTO):].decode(codec, errors="replace")


def read_note(what: str, codec: str) -> str | None:
    """The line for a file `file_codec` found not plain UTF-8 ("--input a.csv: not UTF-8; read as cp1252, ..."),
    None for UTF-8."""
    return None if codec == "utf-8-sig" else f"{what}: {decoded_as(codec)}, as prepare reads such a file"


def decoded_as(codec: str) -> str:
    """How a file that was not plain UTF-8 was read, for a line: "not UTF-8; read as cp1252"."""
    if codec == REPLACED:
        return "UTF-8 but for a few stray bytes, each read as U+FFFD"
    return f"not UTF-8; read as {name(codec)}"


def decode(raw: bytes, encoding: str) -> tuple[str, str]:
    """A whole file's bytes as text, and the name of the codec used (see `name`); raises Undecodable where
    a forced codec cannot decode them."""
    codec = detect([raw], encoding)
    return raw[skip(raw[:3], codec, encoding):].decode(codec), name(codec)


def undecodable_line(path: str, encoding: str, e: Undecodable) -> str:
    """The one line for a file data.encoding cannot decode: the file, where and why, and the fix."""
    return (f"data.path {path}: {e}, so data.encoding {encoding} cannot read it; set data.encoding to the file's"
            " encoding, or auto to decide per file")


def local_path(source: str) -> str:
    """The local path of a file URI as Spark gives it in _metadata.file_path (file:/a%20b or file:///a%20b)."""
    from urllib.parse import unquote, urlparse

    return unquote(urlparse(source).path) if source.startswith("file:") else source
