"""Row cleaning (Python on the executors, since Spark has no NFC) and the per-row rejection reasons."""

from __future__ import annotations

from collections.abc import Iterator

# The one cleaning shared with predict/serve, so a served text is cleaned exactly like a trained one.
from torchloom.textclean import clean_text

# Every reason a row can be rejected for; manifest.counts["rows_rejected"] always lists all of them.
REASONS = ("null_text", "empty_text", "null_label", "invalid_utf8", "too_short", "too_long", "conflicting_labels")

CLEANED_SCHEMA = "raw string, text string, label string, source string, reason string"

def clean_label(label: str | None) -> str | None:
    if label is None:
        return None
    return clean_text(label) or None  # an empty label is as good as none


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


def clean_batches(min_chars: int, max_chars: int):
    """A mapInArrow function: (text, label, source) -> CLEANED_SCHEMA."""

    def run(batches: Iterator) -> Iterator:
        import pyarrow as pa

        for batch in batches:
            # As binary: a string column may hold bytes that are not UTF-8 (see decode).
            raw_bytes = batch.column("text").cast(pa.binary()).to_pylist()
            labels = batch.column("label").cast(pa.binary()).to_pylist()
            raws, texts, clean_labels, reasons = [], [], [], []
            for value, label_bytes in zip(raw_bytes, labels):
                raw, valid = decode(value)
                text = clean_text(raw) if raw is not None else None
                label = clean_label(decode(label_bytes)[0])
                raws.append(raw)
                texts.append(text)
                clean_labels.append(label)
                reasons.append(reason_for(raw, valid, text, label, min_chars, max_chars))
            yield pa.RecordBatch.from_arrays(
                [pa.array(raws, pa.string()), pa.array(texts, pa.string()), pa.array(clean_labels, pa.string()),
                 batch.column("source"), pa.array(reasons, pa.string())],
                names=["raw", "text", "label", "source", "reason"],
            )

    return run
