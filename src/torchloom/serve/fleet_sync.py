"""One fleet, several servers: Ray Serve's replicas, or the pods behind `torchloom k8s serve`'s Service, each of which
an admin request (the loop's among them) reaches alone. With the prediction log they share (--log), each admin
change is recorded with the fleet's whole state after it (its models as another server reads them, the split, the
shadows), and every server makes the newest state of its deployment its own:

- at start: a server restarted after a promotion serves what its fleet serves, not what its flags said;
- within RESYNC_S of a change (serve/fleet_log.keep_in_step looks every round);
- before it makes or shows a change itself (`catch_up`, under the fleet's lock): a change is made on top of the
  newest state, whichever server took the one before, and GET /v1/admin shows it.

A deployment (`epoch`) is its start-up models, split and shadows: the flags every replica and pod of it share. A
server started with other flags is another deployment; it starts from its flags and follows only its own. A model's
place in the state is where another server reads it: its store or registry URI, else its path (which a server on
another host may not read: such a change is said once, as a warning, and tried again at each look). Following is
not a change: nothing is recorded again (no echo), and the log line names the server whose change it follows.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import uuid
from typing import Any

log = logging.getLogger("torchloom.serve")
INSTANCE = uuid.uuid4().hex[:12]  # this process: its own changes are not followed again


def epoch(models: dict, traffic: Any, shadow: Any) -> str:
    """The deployment a server belongs to: its start-up models (names and where), split and shadows."""
    given = json.dumps({"models": {str(k): str(v) for k, v in models.items()}, "traffic": traffic, "shadow": shadow},
                       sort_keys=True, default=str)
    return hashlib.sha256(given.encode()).hexdigest()[:16]


def state(fleet) -> dict[str, Any]:
    """The fleet's state as another server of it would load it."""
    return {"models": {n: fleet.members[n].source or fleet.members[n].path for n in fleet.order},
            "traffic": dict(fleet.plan.traffic), "shadows": list(fleet.plan.shadows)}


def stamp(fleet) -> dict[str, Any]:
    """What an admin event carries for the fleet's other servers (none without a deployment: a lone server)."""
    return {"state": state(fleet), "epoch": fleet.epoch, "by": INSTANCE} if fleet.epoch else {}


async def catch_up(fleet) -> None:
    """The newest recorded state of this deployment made this server's, where it is newer than what it follows."""
    if fleet.log is None or not fleet.epoch:
        return
    events = await asyncio.to_thread(fleet.log.events_of, "admin", fleet.synced)
    if not events:
        return
    ours = [e for e in events if e.get("epoch") == fleet.epoch and isinstance(e.get("state"), dict)]
    newest = ours[-1] if ours else None
    if newest is not None and newest.get("by") != INSTANCE:
        try:
            await follow(fleet, newest)
        except Exception as e:  # noqa: BLE001 - serving goes on with what it has; tried again at the next look
            if fleet.sync_failed != newest["seq"]:
                log.warning("admin: cannot follow the fleet's change %s by %s (%s); serving what this server has,"
                            " trying again", newest["seq"], newest.get("who"), str(e).splitlines()[0][:200])
                fleet.sync_failed = newest["seq"]
            return
    fleet.synced = events[-1]["seq"]


async def follow(fleet, event: dict[str, Any]) -> None:
    """`event`'s state made this server's: models loaded (or replaced) first, then the split, then what left."""
    from torchloom.serve.split import Plan

    want, who = event["state"], f"following {event.get('who', 'another server')} (event {event['seq']})"
    for name, where in want.get("models", {}).items():
        member = fleet.members.get(name)
        if member is None or (member.source or member.path) != where:
            await fleet.put_model(name, where, who, record=False)
    traffic = {n: float(s) for n, s in want.get("traffic", {}).items() if n in fleet.members}
    if traffic and (traffic != fleet.plan.traffic or want.get("shadows", []) != fleet.plan.shadows):
        plan = Plan({**traffic, **{n: 0.0 for n in fleet.order if n not in traffic}},  # the state's order
                    [s for s in want.get("shadows", []) if s in fleet.members])
        fleet.set_plan(plan, who, record=False)
    for name in [n for n in fleet.order[1:] if n not in want.get("models", {})]:
        fleet.remove(name, who, record=False)
