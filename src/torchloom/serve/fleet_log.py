"""A fleet's durable log (monitor/predlog.py) given back to it: what makes feedback and the verdict the fleet's,
not one process's.

    recall        feedback for prediction ids this process never saw (answered before a restart, or by another
                  replica on the same PostgreSQL): their answers, and whether they are labelled, from the log
    keep_in_step  at start and every RESYNC_S: each model's tallies and outcomes (so its verdict) worked out from
                  the log's labels alone, for the versions served now, in the order the store took the labels; two
                  replicas on one store read the same rows and so give one verdict, and a restarted server the
                  verdict it had; and the newest events (the loop's, the admin's), the status page's timeline;
                  and the newest state of the fleet's deployment another server recorded (serve/fleet_sync.py)

Between two resyncs a label is scored at once in memory (serve/fleet.py), as without a log.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from torchloom.monitor.ab import Outcomes, Tally

log = logging.getLogger("torchloom.serve")
RESYNC_S = 2.0
RECALL_WAIT_S = 3.0  # how long an id found nowhere is looked for again: another replica writes its answers off the
# request path (predlog.WRITE_EVERY_S, and a transaction), so a label sent at once may come before them
TIMELINE = 50  # the newest events the status page draws (the loop's, the admin's, alerts)


async def recall(fleet, ids: list[str]) -> None:
    """The log's answers and labels of the ids the fleet does not hold in memory, put into its records."""
    missing = [i for i in dict.fromkeys(ids) if not fleet.records.get(i)]
    if not missing:
        return
    from torchloom.monitor.predlog import WRITE_EVERY_S

    deadline = time.monotonic() + RECALL_WAIT_S
    while True:
        answers, labels = await asyncio.to_thread(fleet.log.answers_of, missing)
        for i, by_model in answers.items():
            fleet.records[i] = {m: a for m, a in by_model.items() if m in fleet.members}
        fleet.labelled.update(labels)
        missing = [i for i in missing if i not in answers]
        if not missing or time.monotonic() >= deadline:
            return
        await asyncio.sleep(WRITE_EVERY_S)


def labelled_text(fleet, text: str, label: str) -> dict[str, Any]:
    """A label sent with its text (no prediction's id): kept in the log for retraining, scored for no model."""
    from torchloom.monitor.predlog import text_hash
    from torchloom.serve.api_common import ApiError

    fleet.may_change()
    if fleet.log is None:
        raise ApiError(501, "not_supported", "a label sent with its text is kept in the prediction log; start the"
                                             " server with --log PATH_OR_URI, or send the prediction's id")
    if label not in fleet.identity.labels:
        fleet.count("feedback", "invalid_label")
        raise ApiError(422, "unknown_label", f"label {label!r} is not one of the model's labels"
                                             f" ({', '.join(fleet.identity.labels[:20])}); GET /v1/labels lists them")
    key = f"text-{text_hash(text)}"
    fleet.log.feedback(key, label, text=text, source="text")
    fleet.count("feedback", "text")
    return {"id": key, "label": label, "kept": "text"}


def replay(fleet, items) -> None:
    """Tallies and outcomes of the served versions from the log's labels (predlog.Labelled, in seq order)."""
    versions = {n: fleet.members[n].identity.version for n in fleet.order}
    tallies = {n: Tally() for n in fleet.order}
    outcomes: dict[str, Outcomes] = {}
    control = fleet.order[0]
    for item in items:
        right = {m: answer == item.label for m, (version, _, answer) in item.answers.items()
                 if versions.get(m) == version}
        if not right:
            continue
        fleet.labelled.setdefault(item.id, item.label)
        for m, ok in right.items():
            tallies[m].labels += 1
            tallies[m].right += ok
        for name in fleet.order[1:]:
            if control in right or name in right:
                outcomes.setdefault(name, Outcomes()).add(right.get(control), right.get(name))
    fleet.tallies, fleet.outcomes = tallies, outcomes
    fleet.awaiting.clear()  # a shadow's late answer reaches the outcomes through the log at the next resync
    fleet.verdicts = {n: v for n, v in fleet.verdicts.items() if n in outcomes}
    fleet.labels_in += 1  # the verdicts are worked out again on the next read


def brief(event: dict[str, Any]) -> dict[str, Any]:
    """An event as the status page's timeline and `torchloom loop history` show it: when, what, by whom, one line."""
    line = event.get("line")
    if not line and event["kind"] == "admin":
        line = f"{event.get('action')}: " + ", ".join(f"{k} {event[k]}" for k in ("model", "plan", "path", "version")
                                                      if event.get(k))
    elif not line:
        line = ", ".join(f"{k}={v}" for k, v in event.items() if k not in ("seq", "at", "kind", "who"))
    kind = event["kind"] + (f" {event['gate']}" if event["kind"] == "gate" and event.get("gate") else "")
    return {"seq": event["seq"], "at": event["at"], "kind": kind, "who": event["who"], "line": str(line),
            "passed": event.get("passed")}


async def keep_in_step(fleet, every_s: float = RESYNC_S) -> None:
    """replay from the log now and every `every_s` (module docstring); a store that fails is logged and tried
    again, serving goes on."""
    failing = False
    while True:
        try:
            items = await asyncio.to_thread(fleet.log.labelled)
            replay(fleet, items)
            fleet.timeline = [brief(e) for e in await asyncio.to_thread(fleet.log.recent, TIMELINE)]
            fleet.judge()
            from torchloom.serve.fleet_sync import catch_up

            async with fleet.sync_lock:
                await catch_up(fleet)
            failing = False
        except asyncio.CancelledError:
            raise
        except Exception as e:
            if not failing:
                log.warning("prediction log %s: cannot read the labels (%s); the verdict is this process's until it"
                            " can", fleet.log.where, str(e).splitlines()[0][:200])
            failing = True
        await asyncio.sleep(every_s)
