"""A small prepared dataset written without Spark or a tokenizer, for tests and benchmarks.

The shards and manifest have exactly the shape `prepare` writes (see `torchloom.manifest`). Token ids
look like BERT's ([CLS]=101 ... [SEP]=102); each label draws most of its tokens from its own band of
the vocabulary, so a tiny model learns the task in a few steps.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from torchloom.manifest import Manifest, Shard, Split

CLS_ID, SEP_ID = 101, 102
FIRST_CONTENT_ID = 104  # ids below are special tokens in BERT vocabularies
IN_BAND_FRACTION = 0.7  # share of a row's tokens taken from its label's band; the rest are noise
DEFAULT_ROWS: Mapping[str, int] = MappingProxyType({"train": 103, "val": 17, "test": 19})

SCHEMA = pa.schema([
    ("text", pa.string()),
    ("label", pa.string()),
    ("label_id", pa.int32()),
    ("input_ids", pa.list_(pa.int32())),
    ("length", pa.int32()),
])


def write_synthetic_dataset(
    out_dir: str | Path,
    rows: Mapping[str, int] = DEFAULT_ROWS,
    num_labels: int = 3,
    rows_per_group: int = 10,
    rows_per_shard: int = 40,
    min_len: int = 4,
    max_len: int = 24,
    vocab_size: int = 1000,
    seed: int = 0,
) -> Manifest:
    """Write `<out_dir>/<split>/part-*.parquet` and `<out_dir>/manifest.json`; returns the manifest.

    rows: rows per split. min_len, max_len: token counts including [CLS] and [SEP].
    The same arguments always write the same bytes of data.
    """
    if not 2 <= min_len <= max_len:
        raise ValueError(f"need 2 <= min_len <= max_len, got min_len={min_len}, max_len={max_len}")
    if vocab_size - FIRST_CONTENT_ID < num_labels:
        raise ValueError(f"vocab_size {vocab_size} too small for {num_labels} label bands")
    if rows_per_group < 1 or rows_per_shard < 1:
        raise ValueError("rows_per_group and rows_per_shard must be >= 1")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    labels = [f"label_{k}" for k in range(num_labels)]
    words = pa.array([f"w{i}" for i in range(vocab_size)])
    splits = {}
    for split_number, (name, n) in enumerate(rows.items()):
        rng = np.random.default_rng([seed, split_number])
        table = _split_table(rng, n, labels, words, min_len, max_len, vocab_size)
        (out / name).mkdir(exist_ok=True)
        shards = []
        for shard_number, first in enumerate(range(0, n, rows_per_shard)):
            rel = f"{name}/part-{shard_number:05d}.parquet"
            pq.write_table(table.slice(first, rows_per_shard), out / rel, row_group_size=rows_per_group)
            meta = pq.read_metadata(out / rel)
            groups = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
            shards.append(Shard(path=rel, rows=meta.num_rows, row_groups=groups))
        counts = np.bincount(table.column("label_id").to_numpy(), minlength=num_labels)
        splits[name] = Split(rows=n, shards=shards, per_class={lb: int(c) for lb, c in zip(labels, counts)})
    params = {"rows": dict(rows), "num_labels": num_labels, "rows_per_group": rows_per_group,
              "rows_per_shard": rows_per_shard, "min_len": min_len, "max_len": max_len,
              "vocab_size": vocab_size, "seed": seed}
    manifest = Manifest(
        labels=labels,
        splits=splits,
        tokenizer={"path": "", "hash": "synthetic", "max_length": max_len, "vocab_size": vocab_size},
        fingerprint=hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:16],
        inputs={"synthetic": params},
        counts={"rows_read": sum(rows.values()), "rows_rejected": {}, "duplicates_removed": 0},
    )
    manifest.write(out)
    manifest.root = str(out)
    return manifest


def _split_table(rng: np.random.Generator, n: int, labels: list[str], words: pa.Array,
                 min_len: int, max_len: int, vocab_size: int) -> pa.Table:
    label_id = rng.integers(0, len(labels), n).astype(np.int32)
    length = rng.integers(min_len, max_len + 1, n).astype(np.int32)
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(length, out=offsets[1:])
    total = int(offsets[-1])
    row = np.repeat(np.arange(n), length)
    position = np.arange(total) - offsets[row]
    band = (vocab_size - FIRST_CONTENT_ID) // len(labels)
    in_band = FIRST_CONTENT_ID + label_id[row] * band + rng.integers(0, band, total)
    noise = rng.integers(FIRST_CONTENT_ID, vocab_size, total)
    ids = np.where(rng.random(total) < IN_BAND_FRACTION, in_band, noise).astype(np.int32)
    ids[position == 0] = CLS_ID
    ids[position == length[row] - 1] = SEP_ID
    input_ids = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(ids))
    # The text is the content tokens spelled as words ("w417 w90 ..."), without [CLS] and [SEP].
    content = ids[(position != 0) & (position != length[row] - 1)]
    content_offsets = (offsets - 2 * np.arange(n + 1)).astype(np.int32)
    text = pc.binary_join(pa.ListArray.from_arrays(pa.array(content_offsets), words.take(pa.array(content))), " ")
    label = pa.array(labels).take(pa.array(label_id))
    return pa.Table.from_arrays([text, label, pa.array(label_id), input_ids, pa.array(length)], schema=SCHEMA)
