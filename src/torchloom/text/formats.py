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
# named by its catalog (ICEBERG_SCHEME catalog/namespace.table); read at one version (data.version): inputs/tables.py
TABLE_FORMATS = ("delta", "iceberg")
FORMATS = ("csv", "jsonl", "parquet", "folder", *TABLE_FORMATS)  # what data.format may say, besides auto
DELTA_LOG = "_delta_log"
ICEBERG_SCHEME = "iceberg://"


def is_iceberg(path: str) -> bool:
    return path[:len(ICEBERG_SCHEME)].lower() == ICEBERG_SCHEME

COMPRESSED_SUFFIXES = (".gz", ".bz2", ".snappy", ".zst", ".lz4")  # a file's format is the suffix before these
# Field separators besides the comma that exported "CSV" files use (Excel in much of Europe writes ";")
OTHER_SEPARATORS = {";": "semicolons", "\t": "tabs", "|": "vertical bars"}


def default_separator(name: str) -> str:
    """The field separator a CSV input's file name implies: a tab for .tsv (compressed or not), else a comma."""
    stem = name.lower()
    for suffix in COMPRESSED_SUFFIXES:
        stem = stem.removesuffix(suffix)
    return "\t" if stem.endswith(".tsv") else ","


def separator_in(names: list[str], sep: str) -> str | None:
    """The separator a header read at `sep` shows its fields are split at, where it came out as one column
    holding another (";", a tab or "|"); None otherwise."""
    if len(names) != 1:
        return None
    return next((other for other in OTHER_SEPARATORS if other != sep and other in names[0]), None)

SPREADSHEETS = (".xlsx", ".xlsm", ".xls", ".ods", ".numbers")


def spreadsheet_hint(name: str) -> str:
    """For a spreadsheet file named as an input: what to do instead (none of our readers opens a workbook)."""
    if not name.lower().rstrip("/").endswith(SPREADSHEETS):
        return ""
    return ("it is a spreadsheet workbook, which torchloom does not open; save the sheet as CSV UTF-8 (Excel: File >"
            " Save As; LibreOffice: File > Save As > Text CSV) and give that file")


def column_named(names: list[str], wanted: str) -> str | None:
    """The column of `names` that data.text_column (or label, split) `wanted` names: itself, else the one
    column that differs only in case ("Text" for "text"; Spark resolves names that way too); None if neither."""
    if wanted in names:
        return wanted
    alike = [n for n in names if n.casefold() == wanted.casefold()]
    return alike[0] if len(alike) == 1 else None


# Column names that usually hold a text or a label, for the fix a missing-column line suggests
TEXT_NAMES = ("text", "body", "content", "review", "reviewtext", "message", "sentence", "comment", "document",
              "description", "abstract", "tweet", "article", "question", "utterance", "query", "headline", "title")
LABEL_NAMES = ("label", "labels", "class", "category", "topic", "sentiment", "target", "intent", "genre", "tag",
               "rating", "stars", "y")


def likely_column(names: list[str], kind: str) -> str | None:
    """The one column of `names` whose name says it holds a text (kind "text") or a label, by the first name of
    TEXT_NAMES / LABEL_NAMES that only one column has; None where none does."""
    key = {n: "".join(ch for ch in n.casefold() if ch.isalnum()) for n in names}
    for wanted in TEXT_NAMES if kind == "text" else LABEL_NAMES:
        found = [n for n in names if key[n] == wanted]
        if len(found) == 1:
            return found[0]
    return None


def column_fix(names: list[str], missing: dict[str, str]) -> str:
    """The fix for missing columns ({config key: "text" or "label"}): the flags with the likely columns filled
    in where the names say which, else the flags to set."""
    guesses = {key: likely_column(names, kind) for key, kind in missing.items()}
    if not any(guesses.values()):
        return "set " + " / ".join(f"--{key}" for key in missing)
    return "set " + " ".join(f"--{key} {shell_word(guess) if guess else 'COLUMN'}" for key, guess in guesses.items())


def shell_word(word: str) -> str:
    """`word` as a shell reads it back in a suggested command: quoted where it holds spaces or the like."""
    return word if word and all(ch.isalnum() or ch in "_.-" for ch in word) else "'" + word.replace("'", "'\\''") + "'"


def text_column_hint(names: list) -> str:
    """For predict's missing text column: " (--text-column body, by its name?)" where a column's name says it
    holds the texts, else nothing."""
    guess = likely_column([str(n) for n in names], "text")
    return f" (--text-column {shell_word(guess)}, by its name?)" if guess else ""
