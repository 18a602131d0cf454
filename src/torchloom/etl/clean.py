"""Row cleaning (Python on the executors, since Spark has no NFC) and the per-row rejection reasons."""

from __future__ import annotations

from collections.abc import Iterator

# The one cleaning shared with predict/serve, so a served text is cleaned exactly like a trained one.
from torchloom.inputs.encoding import AUTO, RAW, STRICT, UTF8, Undecodable, local_path, undecodable_line
from torchloom.inputs.encoding import decode as encoding_decode
from torchloom.text import hierarchy
from torchloom.text import tags as tag_rules
from torchloom.text.clean import clean_text

# Every reason a row can be rejected for; manifest.counts["rows_rejected"] always lists all of them.
# conflicting_labels and leaked are found by dedup, class_too_small and label_not_in_train when the split
# is planned (etl/split.py, etl/prepare.py); unknown_split marks a split column value that is none of ours
# no_tags and invalid_tags: a multi-label row with an empty tag list (unless data.keep_untagged), a label that cannot
# be tags (a nested list, a number inside a list).
REASONS = ("null_text", "empty_text", "null_label", "no_tags", "invalid_tags", "invalid_utf8", "too_short", "too_long",
           "unknown_split", "conflicting_labels", "class_too_small", "label_not_in_train", "leaked")

# raw is the input text only where cleaning changed it (null where it equals text): it is kept for
# the rejected rows' output, and leaving out the copies halves what the dedup shuffle and cache hold.
# codec: the encoding a row was decoded from where inputs/encoding.py chose it and it is not UTF-8 (null: UTF-8,
# typed Parquet strings, or data.encoding strict); prepare counts these rows (manifest counts.decoded).
CLEANED_SCHEMA = "raw string, text string, label string, source string, reason string, codec string"
# with the user's own split: `given`, the split each row came with (train, val or test; null: unknown)
CLEANED_SCHEMA_GIVEN = CLEANED_SCHEMA + ", given string"

def clean_label(label: str | None) -> str | None:
    if label is None:
        return None
    return clean_text(label) or None  # an empty label is as good as none


def tag_label(value: str | None, mode: str, delimiter: str, keep_untagged: bool, path_delimiter: str = ""
              ) -> tuple[str | None, str | None]:
    """(prepare's label, a rejection reason or None) for a raw label value; mode: text/tags.mode_for's.
    path_delimiter (hierarchical labels): each label and tag normalised as a path (text/hierarchy.py)."""
    if mode == "single":
        label = clean_label(value)
        return (hierarchy.normalize(label, path_delimiter) or None if label and path_delimiter else label), None
    try:
        label = tag_rules.label_value(value, mode, delimiter)
    except ValueError:
        return None, "invalid_tags"
    if label is not None and path_delimiter and tag_rules.is_set(label):
        label = tag_rules.as_label(t for t in (hierarchy.normalize(t, path_delimiter)
                                               for t in tag_rules.of_label(label)) if t)
    elif label is not None and path_delimiter:
        label = hierarchy.normalize(label, path_delimiter) or None
    if label == tag_rules.SET and not keep_untagged:
        return label, "no_tags"
    return label, None


def look_alike(labels: list[str]) -> list[list[str]]:
    """Groups of labels that differ only in case, spaces or punctuation ("Sports", "sports", '["sports"]'):
    separate classes as written, and most often one class written two ways."""
    groups: dict[str, list[str]] = {}
    for label in labels:
        groups.setdefault("".join(ch for ch in label.casefold() if ch.isalnum()), []).append(label)
    return [sorted(group) for key, group in sorted(groups.items()) if key and len(group) > 1]


def decode(raw: bytes | None) -> tuple[str | None, bool]:
    """The text of a raw value and whether it was valid UTF-8.

    Spark's text source (folder-per-label) passes file bytes through undecoded, so invalid UTF-8
    arrives here as bytes; the CSV and JSON readers decode invalid bytes to U+FFFD (the replacement
    character), so the original bytes are gone: a text containing U+FFFD is treated as invalid UTF-8.
    """
    if raw is None:
        return None, True
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("utf-8", errors="replace"), False
    return text, "\ufffd" not in text


def reason_for(raw: str | None, valid_utf8: bool, text: str | None, label: str | None,
               min_chars: int, max_chars: int) -> str | None:
    """Why a row is rejected before dedup, or None. The first matching reason wins, in REASONS order."""
    if raw is None:
        return "null_text"
    if not text:
        return "empty_text"
    if label is None:
        return "null_label"
    if not valid_utf8:
        return "invalid_utf8"
    if len(text) < min_chars:
        return "too_short"
    if max_chars > 0 and len(text) > max_chars:
        return "too_long"
    return None


def _decoded(column, fffd_is_error: bool = True) -> tuple[list, list[bool]]:
    """A text column's values as str (None for null) and whether each was valid UTF-8 (see decode).

    The fast path converts the whole column in C; a column holding invalid UTF-8 (possible from the
    text source) falls back to decoding row by row.
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    try:
        column.validate(full=True)  # checks that every value is UTF-8
    except pa.ArrowInvalid:
        decoded = [decode(value) for value in column.cast(pa.binary()).to_pylist()]
        return [text for text, _ in decoded], [valid for _, valid in decoded]
    if not fffd_is_error:
        return column.to_pylist(), [True] * len(column)
    # the CSV and JSON readers mark bytes that were not UTF-8 with U+FFFD
    return column.to_pylist(), [not r for r in pc.match_substring(column, "\ufffd").to_pylist()]


def _codecs(batch, encoding: str, texts: list, valid: list[bool]) -> list:
    """Each row's codec where not UTF-8 (else None), from the `codec` column: a row a reader decoded with
    inputs/encoding.py is valid (a U+FFFD in it is a character); a row of a file the text source passed on
    undecoded (RAW: a folder's files) is decoded here (texts and valid updated), under a forced codec
    other than UTF-8 whatever its bytes, under auto or utf-8 where they are not valid UTF-8."""
    import codecs as codec_registry

    import pyarrow as pa

    n = batch.num_rows
    if "codec" not in batch.schema.names or encoding == STRICT:
        return [None] * n
    marks = batch.column("codec").to_pylist()
    forced = encoding != AUTO and codec_registry.lookup(encoding).name not in (UTF8, "utf-8-sig")
    out: list = [None] * n
    binary = sources = None
    for i, mark in enumerate(marks):
        if mark != RAW:
            if mark is not None:
                valid[i], out[i] = True, None if mark == UTF8 else mark
            continue
        if texts[i] is None or not (forced or not valid[i]):
            continue
        if binary is None:
            binary, sources = batch.column("text").cast(pa.binary()), batch.column("source")
        try:
            texts[i], codec = encoding_decode(binary[i].as_py(), encoding)
        except Undecodable as e:
            from torchloom.inputs.store_tasks import MARK

            raise RuntimeError(MARK + undecodable_line(local_path(sources[i].as_py() or "?"), encoding, e)) from None
        valid[i], out[i] = True, None if codec == UTF8 else codec
    return out


def clean_batches(min_chars: int, max_chars: int, utf8_sources: frozenset[str] = frozenset(),
                  fffd_is_error: bool = True, encoding: str = STRICT,
                  tags: tuple[str, str, bool] = ("single", "", False)):
    """A mapInArrow function: (text, label, source[, given][, codec]) -> CLEANED_SCHEMA[_GIVEN].

    utf8_sources: local files known to be valid UTF-8 (read.utf8_files); a U+FFFD in their rows is a
    character, not a decoding error. fffd_is_error False: no U+FFFD is (Parquet, whose strings are
    checked byte by byte instead). encoding: data.encoding; an input `codec` column says how each row
    was decoded (see _codecs). tags: (mode, delimiter, keep_untagged, path_delimiter) for tag_label.
    """

    def run(batches: Iterator) -> Iterator:
        import pyarrow as pa

        labels_seen: dict[str | None, tuple] = {}  # a handful of distinct labels: clean each once
        trusted: dict[str, bool] = {}
        for batch in batches:
            raws, valid = _decoded(batch.column("text").cast(pa.string()), fffd_is_error)
            codecs = _codecs(batch, encoding, raws, valid)
            if utf8_sources and not all(valid):
                for i, source in enumerate(batch.column("source").to_pylist()):
                    if not valid[i] and source is not None:
                        if source not in trusted:
                            trusted[source] = local_path(source) in utf8_sources
                        valid[i] = trusted[source]
            label_values, _ = _decoded(batch.column("label").cast(pa.string()))
            changed, texts, clean_labels, reasons = [], [], [], []
            for raw, ok, label_value in zip(raws, valid, label_values):
                text = clean_text(raw) if raw is not None else None
                changed.append(raw if raw != text else None)
                if label_value in labels_seen:
                    label, tag_reason = labels_seen[label_value]
                else:
                    label, tag_reason = labels_seen[label_value] = tag_label(label_value, *tags)
                texts.append(text)
                clean_labels.append(label)
                reasons.append(tag_reason if tag_reason and raw is not None and text
                               else reason_for(raw, ok, text, label, min_chars, max_chars))
            arrays = [pa.array(changed, pa.string()), pa.array(texts, pa.string()),
                      pa.array(clean_labels, pa.string()), batch.column("source"), pa.array(reasons, pa.string()),
                      pa.array(codecs, pa.string())]
            names = ["raw", "text", "label", "source", "reason", "codec"]
            if "given" in batch.schema.names:
                arrays.append(batch.column("given"))
                names.append("given")
            yield pa.RecordBatch.from_arrays(arrays, names=names)

    return run
