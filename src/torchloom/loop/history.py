"""`torchloom loop history`: the fleet's events (the loop's, the admin route's, the alerts), oldest first, as a
table or as JSON lines."""

from __future__ import annotations

import json
import time
from typing import Any


def line_of(event: dict[str, Any]) -> str:
    if event.get("line"):
        return str(event["line"])
    if event["kind"] == "admin":
        return f"{event.get('action')}: " + ", ".join(f"{k} {event[k]}" for k in ("model", "plan", "path", "version")
                                                     if event.get(k))
    return ", ".join(f"{k}={v}" for k, v in event.items() if k not in ("seq", "at", "kind", "who"))


def table(events: list[dict[str, Any]]) -> str:
    rows = [("seq", "time (UTC)", "event", "by", "what")]
    for e in events:
        kind = e["kind"] + (f" {e['gate']}" if e["kind"] == "gate" and e.get("gate") else "")
        rows.append((str(e["seq"]), time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(e["at"])), kind, str(e["who"]),
                     line_of(e)))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4] for r in rows)


def json_lines(events: list[dict[str, Any]]) -> str:
    return "\n".join(json.dumps(e, sort_keys=True, default=str) for e in events)
