"""The contract between prepare and every later stage: what a prepared dataset holds.

Written by `prepare` as `<run>/data/manifest.json`; read by the loader, training, evaluation and
export. Plain JSON and the standard library only, so any stage (and any tool) can read it.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from torchloom.errors import UserError
from torchloom.jsonio import write_atomic
from torchloom.runs.rundir import MANIFEST_FILE, RunDir
from torchloom.uri import has_scheme

FORMAT_VERSION = 1
SPLITS = ("train", "val", "test")
# Columns of every split's Parquet shards.
COLUMNS = {
    "text": "string",  # the cleaned text
    "label": "string",  # the original label
    "label_id": "int32",  # index into Manifest.labels; a multi-label run's: list<int32>, the row's tags' indices
    "input_ids": "list<int32>",  # token ids, truncated at max_length, not padded
    "length": "int32",  # len(input_ids)
    "chunk": "int32",  # the window's place in its text (truncation chunks: one row per window); else 0
}


@dataclass
class Shard:
    path: str  # relative to the manifest's directory, or an absolute URI
    rows: int
    row_groups: list[int]  # rows per row group, in file order


@dataclass
class Split:
    rows: int  # with truncation chunks: windows (a text's windows are consecutive rows, chunk 0 first)
    shards: list[Shard]
    per_class: dict[str, int] = field(default_factory=dict)  # rows per label
    documents: int = 0  # with truncation chunks: the texts the rows are windows of; else 0 (one per row)


@dataclass
class Manifest:
    labels: list[str]  # label_id -> label, sorted
    splits: dict[str, Split]
    tokenizer: dict[str, Any]  # {"path", "hash", "max_length", "vocab_size"}
    fingerprint: str  # changes when the prepared rows, labels or tokenization change
    inputs: dict[str, Any] = field(default_factory=dict)
    counts: dict[str, Any] = field(default_factory=dict)  # rows_read, rows_rejected{reason}, duplicates_removed
    timings: dict[str, float] = field(default_factory=dict)
    # "multi_label": labels are tags, a row's label_id the list of its tags' ids (text/tags.py), and `tags` holds
    # the tags' support per split, the label cardinality and the split's strata (etl/tag_split.py)
    task: str = "single_label"
    tags: dict[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    root: str = ""  # where the manifest was read from (not written)

    @property
    def num_labels(self) -> int:
        return len(self.labels)

    @property
    def multi_label(self) -> bool:
        return self.task == "multi_label"

    def shard_uri(self, shard: Shard) -> str:
        if has_scheme(shard.path) or os.path.isabs(shard.path):
            return shard.path
        return os.path.join(self.root, shard.path)

    def split(self, name: str) -> Split:
        if name not in self.splits:
            raise UserError(f"manifest {self.root}: no split {name!r}; it has {', '.join(self.splits)}")
        return self.splits[name]

    def to_json(self) -> str:
        data = asdict(self)
        data.pop("root")
        return json.dumps(data, indent=2, sort_keys=False, ensure_ascii=False)

    def write(self, directory: str | Path) -> Path:
        return write_atomic(Path(directory) / MANIFEST_FILE, self.to_json() + "\n")

    @classmethod
    def from_dict(cls, data: dict[str, Any], root: str = "") -> Manifest:
        splits = {
            name: Split(
                rows=s["rows"],
                shards=[Shard(**sh) for sh in s["shards"]],
                per_class=s.get("per_class", {}),
                documents=s.get("documents", 0),
            )
            for name, s in data["splits"].items()
        }
        fields = {k: v for k, v in data.items() if k not in ("splits", "root")}
        return cls(splits=splits, root=root, **fields)


def read(directory: str | Path) -> Manifest:
    """Read `<directory>/manifest.json` (directory is a prepared data dir or a run dir)."""
    d = Path(directory)
    if RunDir(d).manifest.is_file():
        d = RunDir(d).data
    path = d / MANIFEST_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        raise UserError(f"{directory}: no prepared data (manifest.json) here; run torchloom prepare first") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: not valid JSON ({e}); run torchloom prepare --output.overwrite true") from None
    if data.get("format_version") != FORMAT_VERSION:
        raise UserError(
            f"{path}: manifest format {data.get('format_version')!r}, this torchloom reads {FORMAT_VERSION};"
            " prepare the data again"
        )
    return Manifest.from_dict(data, root=str(d))
