"""Alerts from training to a webhook (`tracking.notify_url`): one JSON message per event, Slack-compatible (its
"text" is what Slack, Mattermost, Rocket.Chat and Teams' incoming webhooks show; the "torchloom" object carries
the event's fields for anything else that reads them). Standard library only.

Sending never fails the command: a webhook that is down, slow (10 s) or refuses costs one line on stderr. A webhook
URL is a secret (Slack's carries its token in the path): only its scheme and host are ever printed.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import urlsplit

TIMEOUT_S = 10.0
EVENTS = ("train_failed", "train_preempted", "train_worse_after_resume")


def check_url(url: str) -> str | None:
    """The problem with a notify URL, None when it can be used ("" is no webhook)."""
    if not url:
        return None
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "not an http(s) URL; give the webhook's URL, e.g. https://hooks.slack.com/services/..."
    return None


def where(url: str) -> str:
    """What of a webhook URL may be shown: its scheme and host."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.hostname}{f':{parts.port}' if parts.port else ''}"


def send(url: str, event: str, text: str, fields: dict[str, Any], say=print) -> bool:
    """POST {"text", "torchloom": {"event", ...fields}} to `url`; says one line whichever way it went."""
    body = json.dumps({"text": text, "torchloom": {"event": event, **fields}}, default=str).encode()
    request = urllib.request.Request(url, data=body, method="POST",
                                     headers={"Content-Type": "application/json", "User-Agent": "torchloom"})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            status = response.status
    except urllib.error.HTTPError as e:
        say(f"alert: the webhook at {where(url)} answered {e.code}; not sent ({event}): {text}")
        return False
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        say(f"alert: the webhook at {where(url)} cannot be reached ({reason}); not sent ({event}): {text}")
        return False
    say(f"alert: sent to {where(url)} ({event}, HTTP {status}): {text}")
    return True
