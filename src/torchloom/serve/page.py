"""The server's status page, GET /: the model and its labels, live traffic (from /metrics), the monitor's signals
against their thresholds and its history (/v1/monitor), a fleet's models, and a box to try a text (/v1/predict).
One HTML document, page.html beside this file, its script and style inline (no build step, no asset from anywhere
else: the Content-Security-Policy of app.py allows this server only); every value from the server is set as text,
never as markup. Its four placeholders (@@name@@, @@version@@, @@labels@@, @@nonce@@) are filled in one pass.
"""

from __future__ import annotations

import html
import re
from functools import cache
from importlib import resources

PLACEHOLDER = re.compile(r"@@(name|version|labels|nonce)@@")


@cache
def _page() -> str:
    return resources.files("torchloom.serve").joinpath("page.html").read_text(encoding="utf-8")


def render_page(identity, nonce: str) -> str:
    """The page for a model (model/served.ModelIdentity); `nonce`: the one the response's policy allows."""
    values = {"name": identity.name, "version": identity.version, "labels": ", ".join(identity.labels),
              "nonce": nonce}
    return PLACEHOLDER.sub(lambda m: html.escape(values[m.group(1)]), _page())
