"""The candidate's data, pinned: the champion's prepared splits as its run recorded them (train, val, test: the
test split frozen, the one every candidate is judged on) plus the labels fed back up to a watermark (a
`tl_feedback` seq), each text once.

A label fed back is used when the log holds its text (`serve --keep-texts`, or a label sent with its text) and
its label is one the champion knows; its text must not be in the champion's data already (a text of test in
train would flatter the candidate on the gate). Of several labels of one text, the newest stands. The newest
`holdout` share of what is left (by seq) is held out of training: the gate's "newest labelled slice", the data
most like what the server sees now. Every label set aside is counted by reason, in snapshot.json, which also
records the watermark, the champion's data fingerprint and each file's SHA-256: the candidate can be rebuilt
exactly from it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

from torchloom.errors import UserError
from torchloom.monitor.predlog import text_hash

SPLITS = ("train", "val", "test")
FILES = {"train": "train.parquet", "val": "val.parquet", "test": "test.parquet", "newest": "newest.parquet"}
ALL = 10 ** 12


def original(recipe: Path) -> tuple[Any, dict[str, tuple[list[str], list[str]]]]:
    """The champion's manifest and its prepared splits' (texts, labels)."""
    from torchloom import manifest as manifests
    from torchloom.data.texts import labelled_texts

    m = manifests.read(recipe)
    if m.multi_label:
        raise UserError(f"loop: the champion's run {recipe} is multi-label; the loop retrains single-label models"
                        " for now (retrain a tagger with torchloom run)")
    return m, {split: labelled_texts(m, split, ALL) for split in SPLITS}


def feedback(log, until: int, labels: set[str], known: set[str]) -> tuple[list[tuple[int, str, str]], Counter]:
    """(seq, text, label) of the labels up to seq `until` that can be trained on, the newest per text, in seq
    order; and the count of the others by reason."""
    aside: Counter = Counter()
    newest: dict[str, tuple[int, str, str]] = {}
    for item in log.labelled(0, until):
        if item.text is None:
            aside["no_text"] += 1
        elif item.label not in labels:
            aside["unknown_label"] += 1
        elif text_hash(item.text) in known:
            aside["in_the_data"] += 1
        else:
            h = text_hash(item.text)
            if h in newest:
                aside["relabelled"] += 1
            newest[h] = (item.seq, item.text, item.label)
    return sorted(newest.values()), aside


def build(log, recipe: Path, out: Path, holdout: float) -> dict[str, Any]:
    """snapshot.json's record (module docstring), the files written beside it in `out` (a new directory, whole or
    not at all)."""

    m, splits = original(recipe)
    until = log.watermark()
    known = {text_hash(t) for texts, _ in splits.values() for t in texts}
    fed, aside = feedback(log, until, set(m.labels), known)
    held = math.ceil(holdout * len(fed)) if fed else 0
    trained, newest = fed[:len(fed) - held], fed[len(fed) - held:]
    train_texts, train_labels = splits["train"]
    tables = {"train": (train_texts + [t for _, t, _ in trained], train_labels + [y for _, _, y in trained]),
              "val": splits["val"], "test": splits["test"],
              "newest": ([t for _, t, _ in newest], [y for _, _, y in newest])}
    if not tables["test"][0]:
        raise UserError(f"loop: the champion's run {recipe} has no test split to judge a candidate on; prepare with"
                        " prepare.test_fraction above 0 or give data.test_path")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))  # new: nothing in it but what follows
    try:
        record = _write(tmp, tables)
    except BaseException:
        remove_ours(tmp, need_record=False)
        raise
    record.update({"watermark": until, "recipe": str(recipe), "data_fingerprint": m.fingerprint,
                   "data_inputs": {k: v for k, v in m.inputs.items() if k in ("path", "format", "version")},
                   "rows": {name: len(texts) for name, (texts, _) in tables.items()},
                   "feedback": {"trained": len(trained), "held_out": len(newest), "set_aside": dict(aside),
                                "seq_newest_slice": [newest[0][0], newest[-1][0]] if newest else None},
                   "labels": list(m.labels)})
    (tmp / "snapshot.json").write_text(json.dumps(record, indent=2) + "\n")
    if out.exists():  # built before the loop stopped, its event never written: ours, built again
        remove_ours(out)
    os.replace(tmp, out)
    return record


def _write(tmp: Path, tables: dict[str, tuple[list[str], list[str]]]) -> dict[str, Any]:
    """The tables as Parquet files in `tmp`; {"sha256": each file's}."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    digests = {}
    for name, (texts, labels) in tables.items():
        pq.write_table(pa.table({"text": texts, "label": labels}), tmp / FILES[name])
        digests[name] = hashlib.sha256((tmp / FILES[name]).read_bytes()).hexdigest()
    return {"sha256": digests}


def remove_ours(out: Path, need_record: bool = True) -> None:
    """A snapshot directory the loop wrote, removed by the names it writes; anything else in it is not the loop's:
    nothing is deleted, and one line says so (need_record: its snapshot.json must be there, as in one built
    whole)."""
    ours = [out / name for name in (*FILES.values(), "snapshot.json")]
    others = [p.name for p in out.iterdir() if p not in ours] if out.is_dir() else [out.name]
    if others or (need_record and not (out / "snapshot.json").is_file()):
        found = ", ".join(others[:3]) or "no snapshot.json"
        raise UserError(f"loop: {out} exists and is not (only) a snapshot the loop wrote ({found}); move it or pick"
                        " another --work")
    for path in ours:
        path.unlink(missing_ok=True)
    out.rmdir()


def newest_slice(directory: Path) -> tuple[list[str], list[str]]:
    return _read(directory / FILES["newest"])


def frozen_test(directory: Path) -> tuple[list[str], list[str]]:
    return _read(directory / FILES["test"])


def _read(path: Path) -> tuple[list[str], list[str]]:
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    return table.column("text").to_pylist(), table.column("label").to_pylist()
