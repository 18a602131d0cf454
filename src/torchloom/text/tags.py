"""Multi-label rows: a row's tags read from what users write, and the set each row holds as one integer.

What a tag column holds, read the same way on every side (prepare's Spark tasks, the driver, the server):

- a list (a JSON or Parquet list column, or a Python list): each element a tag;
- a string that is a JSON list (`["sport", "money"]`, as a CSV cell holds one);
- a delimited string (`sport|money`) when a delimiter is given (`data.label_delimiter`).

Each tag is cleaned as a single label is (text/clean.py: whitespace folded, stripped); an empty tag is no tag, a
tag given twice counts once, and the order in which a row names its tags does not matter.

A row's tag set travels through the prepared shards as the list of its tags' ids (label_id, list<int32>, sorted:
the manifest's label i is id i), so a row costs what its tags cost, whatever the vocabulary of tags. In memory a
batch's or a split's tag sets are one int64 array [rows, width], each row its ids padded with -1 to the widest
row's count (tag_scoring.label_array and concat_labels); a filler row (a rank with nothing in a micro-step) is a
1-D -100, as a single-label filler's, and an untagged row is all -1. Shards prepared before this (label_id one
int64, bit i for label i) still read: label_array gives those 1-D, and every reader of tag sets
(tag_scoring.multi_hot, train/state.tag_loss, `ids_of`) takes either.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence

from torchloom.errors import UserError
from torchloom.text.clean import clean_text

MAX_TAGS = 100_000  # the head's outputs and the per-tag sums grow with it; past this, a different model is needed
TASKS = ("auto", "single_label", "multi_label")


def _tag(value) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise ValueError(f"a tag must be a string, not {type(value).__name__} ({value!r})")
    return clean_text(str(value)) or None


def as_tags(items: Iterable) -> list[str]:
    """The cleaned tags of `items` in first-seen order, each once, empty ones left out."""
    seen: dict[str, None] = {}
    for item in items:
        tag = _tag(item)
        if tag is not None:
            seen.setdefault(tag, None)
    return list(seen)


def is_list_text(value) -> bool:
    """A string that holds a JSON list (a CSV cell of tags)."""
    if not isinstance(value, str):
        return False
    text = value.strip()
    if not (text.startswith("[") and text.endswith("]")):
        return False
    try:
        return isinstance(json.loads(text), list)
    except ValueError:
        return False


def parse(value, delimiter: str = "") -> list[str] | None:
    """A row's tags, or None when the row names none at all (a null cell). A list, a JSON list in a string, a
    delimited string (with `delimiter`), else one tag. ValueError for what cannot be tags (a nested list, a
    float)."""
    if value is None:
        return None
    if isinstance(value, list | tuple):
        return as_tags(value)
    if is_list_text(value):
        return as_tags(json.loads(value))
    if isinstance(value, str) and delimiter:
        return as_tags(value.split(delimiter))
    return as_tags([value])


def canonical(tags: Iterable[str]) -> tuple[str, ...]:
    """A tag set in one order (sorted), whatever order the row named them in."""
    return tuple(sorted(set(tags)))


def check_count(labels: Sequence[str], shown: str) -> None:
    if len(labels) > MAX_TAGS:
        raise UserError(f"{shown}: {len(labels)} distinct tags; a multi-label run takes at most {MAX_TAGS}: keep the"
                        " most frequent (map the rest to one tag such as 'other', or drop them) and prepare again")


def ids_of(value) -> list[int]:
    """A row's tag ids from what a shard or an array holds: a list or array of ids (-1: padding), or an int64 mask
    of older shards (a negative one, a filler row's, has none)."""
    if isinstance(value, int) or getattr(value, "ndim", 1) == 0:
        mask = int(value)
        return [] if mask < 0 else [i for i in range(mask.bit_length()) if mask >> i & 1]
    return sorted(int(i) for i in value if int(i) >= 0)


def decode(value, labels: Sequence[str]) -> list[str]:
    """The tags of a row's tag ids (or of an older shard's mask), in the labels' order."""
    return [labels[i] for i in ids_of(value)]


# In prepare's label column a row's tags are one string: SET before each tag, in sorted order ("" tags: SET
# alone). clean_text turns \x1f into a space, so no cleaned tag holds it, and a single label never starts with it.
SET = "\x1f"


def as_label(tags: Iterable[str]) -> str:
    """A tag set as prepare's label column holds it (sorted, each once)."""
    return "".join(SET + tag for tag in canonical(tags)) or SET


def is_set(label: str | None) -> bool:
    return label is not None and label.startswith(SET)


def of_label(label: str) -> list[str]:
    """The tags of a label column's value (a single label: itself)."""
    return [t for t in label.split(SET) if t] if is_set(label) else [label]


def shown(label: str) -> str:
    """A tag set as a line shows it: a JSON list."""
    return json.dumps(of_label(label), ensure_ascii=False) if is_set(label) else label


def label_value(value, mode: str, delimiter: str = "") -> str | None:
    """prepare's label for a raw label value: `multi` reads every value as tags (a list, a JSON list, delimited
    or one tag); `auto` reads a list or a JSON list as tags and leaves any other value one label; `single` leaves
    every value one label. None for a null value; ValueError for a value that cannot be tags."""
    if value is None:
        return None
    if mode == "multi" or (mode == "auto" and (isinstance(value, list | tuple) or is_list_text(value))):
        return as_label(parse(value, delimiter))
    return clean_text(str(value)) or None


def mode_for(task: str, delimiter: str) -> str:
    """How prepare's cleaning reads labels for data.task and data.label_delimiter (label_value's mode)."""
    if task not in TASKS:
        raise UserError(f"data.task {task!r}: not a task; use one of {', '.join(TASKS)}")
    if task == "multi_label" or (task == "auto" and delimiter):
        return "multi"
    return "single" if task == "single_label" else "auto"


def decide(labels: Iterable[str], task: str, delimiter: str, where: str) -> str:
    """single_label or multi_label from the distinct labels prepare read (label_value's): one line for a column
    that is neither (lists beside single labels; a delimiter that split nothing)."""
    labels = [lb for lb in labels if lb is not None]
    sets = [lb for lb in labels if is_set(lb)]
    if sets and len(sets) < len(labels):
        single = next(lb for lb in labels if not is_set(lb))
        raise UserError(f"data.label_column of {where}: some labels are lists of tags ({shown(sets[0])}) and others"
                        f" single labels ({single!r}); write every row's tags as a list (one tag: [\"{single}\"]),"
                        " or set data.task single_label to read each list as one label")
    if not sets:
        return "single_label"
    if delimiter and not any(len(of_label(lb)) > 1 for lb in sets):
        raise UserError(f"data.label_delimiter {delimiter!r}: occurs in none of {where}'s labels (e.g."
                        f" {shown(sets[0])}); give the delimiter the column uses, or leave it empty")
    return "multi_label"
