"""train.length_bucketing auto: length buckets where the prepared texts are shorter than max_length.

Buckets measured 1.2-1.6x the samples/s of randomly mixed batches on short texts at equal accuracy (docs/
benchmarks.md, "Less padding on short texts"); where the texts fill max_length (the demo's news articles) every
batch is already full and buckets would only change the order of the batches. So auto turns them on when the
median prepared text (prepare's sample of token lengths, in the manifest) is shorter than max_length, and leaves
them off where the manifest has no such sample (data prepared before it was kept, or written without prepare).
"""

from __future__ import annotations

from torchloom.manifest import Manifest


def use_length_buckets(setting: bool | str, manifest: Manifest) -> bool:
    """train.length_bucketing for this data: the setting itself, or for auto what the texts' lengths say."""
    if setting != "auto":
        return bool(setting)
    lengths = manifest.tokenizer.get("lengths") or {}
    max_length = manifest.tokenizer.get("max_length")
    return bool(max_length and "p50" in lengths and lengths["p50"] < max_length)
