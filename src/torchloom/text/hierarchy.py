"""Hierarchical labels: a label written as a path (`Tops/Knits`, data.label_path_delimiter "/") names a leaf and,
by its prefixes, its parents (`Tops`).

The rule (docs/evaluation.md, "Hierarchical labels"): the model trains on the leaves, the labels as written, and the
parents are derived when it predicts. A single-label prediction's path is its leaf's prefixes, each scored by the
sum of its leaves' probabilities (one path, never a parent that disagrees with its leaf); a multi-label
prediction's parents are the prefixes of its tags. Every level is scored in the report.

Labels are normalised when prepare reads them: each part stripped, empty parts dropped (`Tops / Knits/` is
`Tops/Knits`). Standard library only: prepare's tasks, predict and the report use it alike.
"""

from __future__ import annotations

from collections.abc import Sequence


def normalize(label: str, delimiter: str) -> str:
    """The label with each part stripped and empty parts dropped ("" when none is left)."""
    return delimiter.join(p for p in (part.strip() for part in label.split(delimiter)) if p)


def depth(label: str, delimiter: str) -> int:
    return label.count(delimiter) + 1


def at_depth(label: str, level: int, delimiter: str) -> str:
    """The label's prefix of `level` parts (the label itself where it has no more)."""
    return delimiter.join(label.split(delimiter)[:level])


def ancestors(label: str, delimiter: str) -> list[str]:
    """The label's parents, the top one first (`A/B/C`: `A`, `A/B`)."""
    parts = label.split(delimiter)
    return [delimiter.join(parts[:i]) for i in range(1, len(parts))]


def levels(labels: Sequence[str], delimiter: str) -> int:
    """The depth of the deepest label."""
    return max((depth(label, delimiter) for label in labels), default=1)


def path(probabilities: dict[str, float], leaf: str, delimiter: str) -> list[dict]:
    """A single-label prediction's path: each parent of `leaf` scored by the sum of its leaves' probabilities, then
    the leaf with its own."""
    out = []
    for parent in ancestors(leaf, delimiter):
        under = parent + delimiter
        out.append({"label": parent, "score": sum(p for name, p in probabilities.items()
                                                  if name == parent or name.startswith(under))})
    return out + [{"label": leaf, "score": probabilities[leaf]}]


def parents(tags: Sequence[str], delimiter: str) -> list[str]:
    """A multi-label prediction's parents: the prefixes of its tags, each once, in the order they come."""
    seen: dict[str, None] = {}
    for tag in tags:
        for parent in ancestors(tag, delimiter):
            seen.setdefault(parent, None)
    return list(seen)


def describe(result: dict, delimiter: str) -> dict:
    """A prediction (predict's dict) with its parents: `path` (single-label) or `parents` (multi-label)."""
    if "labels" in result:
        result["parents"] = parents(result["labels"], delimiter)
    else:
        result["path"] = path(result["probabilities"], result["label"], delimiter)
    return result
