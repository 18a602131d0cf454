"""The one text cleaning shared by prepare (Spark) and predict/serve, so training and serving see the same text.

Pure standard library: it runs inside Spark's Python workers and in servers without torch.
"""

from __future__ import annotations

import re
import unicodedata

_WHITESPACE = re.compile(r"\s+")
# Invisible characters that carry no meaning for a classifier but change token ids.
_INVISIBLE = {"\ufeff", "\u200b", "\u2060", "\u00ad"}


def clean_text(s: str) -> str:
    """Unicode NFC, control characters dropped, runs of whitespace collapsed to one space, ends stripped."""
    s = unicodedata.normalize("NFC", s)
    # Whitespace controls (\t \n \r \x0b \x0c) become spaces before the other controls are dropped,
    # so "a\tb" stays two words.
    s = "".join(
        " " if ch.isspace() else ch
        for ch in s
        if ch.isspace() or (unicodedata.category(ch) != "Cc" and ch not in _INVISIBLE)
    )
    return _WHITESPACE.sub(" ", s).strip()
