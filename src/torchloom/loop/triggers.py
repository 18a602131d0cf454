"""When the loop retrains: each trigger has an id, fires on what the fleet shows, and waits out a cooldown after it
fired and a limit of firings a day (both read back from the events: a restarted loop keeps them).

    labels     K labels fed back since the last snapshot's watermark
    drift      the champion's monitor says drifted, over at least N texts (its chosen false-alarm rate)
    accuracy   the champion's estimated accuracy (without labels) under a floor
    schedule   every H hours
    alert      an Alertmanager webhook the loop listens on got a firing alert (so a platform's own Prometheus
               rules can start a retrain); the alert is an event in the log, and fires once
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

DAY_S = 86_400.0


@dataclass
class Trigger:
    id: str
    threshold: float

    def fires(self, seen: dict[str, Any], last_fired: float, now: float) -> str | None:
        """Why this trigger fires on what is seen now (None: it does not)."""
        if self.id == "labels" and seen["labels"] >= self.threshold:
            return f"{seen['labels']} labels fed back since the last snapshot (at least {self.threshold:g})"
        monitor = seen.get("monitor") or {}
        if self.id == "drift" and monitor.get("drift") and (monitor.get("texts") or 0) >= self.threshold:
            drifted = ", ".join(monitor.get("drifted") or []) or "its signals"
            return f"the champion's traffic drifted in {drifted} over {monitor.get('texts')} texts"
        estimate = (monitor.get("estimated_accuracy") or {}).get("value")
        if self.id == "accuracy" and estimate is not None and estimate < self.threshold:
            return f"the champion's estimated accuracy {estimate:.3f} is under {self.threshold:g}"
        if self.id == "schedule" and now - last_fired >= self.threshold * 3600:
            return f"the schedule (every {self.threshold:g} h)"
        if self.id == "alert" and seen.get("alerts"):
            return f"alert {seen['alerts'][-1]} from the webhook"
        return None


def due(triggers: list[Trigger], seen: dict[str, Any], events: list[dict[str, Any]], cooldown_s: float,
        daily_limit: int, now: float | None = None) -> tuple[Trigger, str] | tuple[None, str]:
    """The first trigger that fires and may (its cooldown past, its limit not reached), with why; else None with
    what holds the loop back."""
    now = time.time() if now is None else now
    held = []
    for trigger in triggers:
        fired = [e["at"] for e in events if e["kind"] == "trigger" and e.get("trigger") == trigger.id]
        last = fired[-1] if fired else (events[0]["at"] if events and trigger.id == "schedule" else 0.0)
        why = trigger.fires(seen, last, now)
        if why is None:
            continue
        if fired and now - fired[-1] < cooldown_s:
            held.append(f"{trigger.id} would fire ({why}) but cools down for {(cooldown_s - now + fired[-1]) / 60:.0f}"
                        " more minutes")
        elif sum(1 for at in fired if now - at < DAY_S) >= daily_limit:
            held.append(f"{trigger.id} would fire ({why}) but fired {daily_limit} times in the last day")
        else:
            return trigger, why
    return None, "; ".join(held) or "no trigger fires"


def parse(given: dict[str, float]) -> list[Trigger]:
    """The triggers switched on ({id: threshold}; 0 or None: off), in the order they are tried."""
    order = ("alert", "labels", "drift", "accuracy", "schedule")
    return [Trigger(k, float(given[k])) for k in order if given.get(k)]
