"""The served fleet as the loop sees it: its admin route (/v1/admin: load, split, shadows, promote, remove), its
/v1/monitor and its /metrics. The keys come from environment variables, never the command line; a server that
cannot be reached or says no is one line (a ServerError: the long-running loop waits and tries again)."""

from __future__ import annotations

import json
import os
import re
import urllib.error
import urllib.request
from typing import Any

from torchloom.errors import UserError, clipped

ADMIN_KEY_ENV = "TORCHLOOM_ADMIN_KEY"  # serve/settings.py's
API_KEY_ENV = "TORCHLOOM_API_KEY"


class ServerError(UserError):
    """The server could not be reached, or refused a call: the loop's step did not happen, and may be tried
    again."""


class Server:
    def __init__(self, url: str, admin_key_env: str = ADMIN_KEY_ENV, api_key_env: str = API_KEY_ENV,
                 timeout_s: float = 120.0) -> None:
        self.url = url.rstrip("/")
        self.admin_key = os.environ.get(admin_key_env) or ""
        self.api_key = os.environ.get(api_key_env) or ""
        self.admin_key_env = admin_key_env
        self.timeout_s = timeout_s

    def _call(self, method: str, path: str, body: Any = None, admin: bool = True, raw: bool = False) -> Any:
        key = self.admin_key if admin else self.api_key
        request = urllib.request.Request(self.url + path, method=method,
                                         data=None if body is None else json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json",
                                                  **({"Authorization": f"Bearer {key}"} if key else {})})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:  # noqa: S310 - the user's server
                data = response.read()
        except urllib.error.HTTPError as e:
            try:
                message = json.loads(e.read()).get("error", {}).get("message", "")
            except (ValueError, AttributeError):
                message = ""
            hint = (f"; set {self.admin_key_env} to the server's --admin-key" if admin and e.code in (401, 403)
                    else "")
            raise ServerError(f"loop: {method} {self.url}{path} answered {e.code}"
                              f"{': ' + clipped(message, 300) if message else ''}{hint}") from None
        except (urllib.error.URLError, OSError) as e:
            why = getattr(e, "reason", e)
            raise ServerError(f"loop: the server at {self.url} cannot be reached ({clipped(str(why), 200)}); is"
                              " torchloom serve running there?") from None
        return data.decode() if raw else json.loads(data or b"{}")

    def view(self) -> dict[str, Any]:
        """{plan, traffic, shadows, models: {name: {name, version, path, source}}}"""
        return self._call("GET", "/v1/admin")

    def monitor(self) -> dict[str, Any]:
        return self._call("GET", "/v1/monitor", admin=False)

    def load(self, name: str, path: str) -> dict[str, Any]:
        return self._call("PUT", f"/v1/admin/models/{name}", {"path": path})

    def traffic(self, split: dict[str, float], shadows: list[str]) -> dict[str, Any]:
        return self._call("PUT", "/v1/admin/traffic", {"traffic": split, "shadows": shadows})

    def promote(self, name: str) -> dict[str, Any]:
        return self._call("POST", "/v1/admin/promote", {"model": name})

    def remove(self, name: str) -> dict[str, Any]:
        return self._call("DELETE", f"/v1/admin/models/{name}")

    def metrics(self) -> str:
        return self._call("GET", "/metrics", admin=False, raw=True)

    def counter(self, family: str, **labels: str) -> float:
        return sample(self.metrics(), family, **labels)


def sample(text: str, family: str, **labels: str) -> float:
    """The sum of a /metrics family's samples whose labels include `labels` (0 when none)."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(family + "{") and not line.startswith(family + " "):
            continue
        found = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', line.split("}")[0]))
        if all(found.get(k) == v for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def model_numbers(text: str, champion: str, candidate: str) -> dict[str, float]:
    """What the canary's limits read from /metrics: the candidate's requests and failures (counters), both models'
    recent p99 and its count."""
    out = {"requests": sample(text, "torchloom_model_requests_total", model=candidate),
           "failed": sample(text, "torchloom_model_failures_total", model=candidate)}
    for role, name in (("candidate", candidate), ("champion", champion)):
        for q in ("0.99", "count"):
            out[f"{role}_{'p99' if q == '0.99' else 'count'}"] = sample(
                text, "torchloom_model_duration_recent_seconds", model=name, quantile=q)
    return out


def champion_of(view: dict[str, Any]) -> str:
    """The model that takes the most traffic."""
    return max(view["traffic"], key=lambda n: view["traffic"][n])
