"""`torchloom loop history`: the fleet's events (the loop's, the admin route's, the alerts), oldest first, as a
table or as JSON lines."""

from __future__ import annotations

import json
import time
from typing import Any


def table(events: list[dict[str, Any]]) -> str:
    from torchloom.serve.fleet_log import brief  # the status page's timeline says each event the same way

    rows = [("seq", "time (UTC)", "event", "by", "what")]
    for b in map(brief, events):
        rows.append((str(b["seq"]), time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(b["at"])), b["kind"], str(b["who"]),
                     b["line"]))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4] for r in rows)


def json_lines(events: list[dict[str, Any]]) -> str:
    return "\n".join(json.dumps(e, sort_keys=True, default=str) for e in events)
