"""The admin's changes to a fleet (serve/fleet.py), applied without a restart: the split and the shadows, promotion,
loading a model (warmed up first) or replacing one in place, and removing one; each on record in the prediction log
(`tl_events`, kind "admin") where the server keeps one, beside the server's own log line. /v1/admin
(serve/fleet_api.py) calls these; so does the loop (torchloom.loop) through it."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from torchloom.monitor.ab import Tally
from torchloom.serve.api_common import ApiError
from torchloom.serve.split import Plan
from torchloom.uri import is_uri, redact

log = logging.getLogger("torchloom.serve")


@dataclass
class Member:
    """One model of the fleet: its name (`--model NAME=...`), where it came from, its engine's backend."""

    name: str
    path: str
    backend: Any
    encoding: tuple | None = None  # ServedModel.encoding_key (local engine; None: not shared)
    source: str = ""  # the store or registry URI it was loaded from (its path is this host's copy), else ""

    @property
    def identity(self):
        return self.backend.identity


class FleetAdmin:
    """Fleet's admin side (a mixin: the state is Fleet's)."""

    def set_plan(self, plan: Plan, who: str, action: str = "traffic", record: bool = True) -> dict[str, Any]:
        """A new split and shadows from now on; requests already routed finish where they went."""
        self.may_change()
        before = self.plan.line()
        self.plan = plan
        self.count("admin", action)
        log.info("admin (%s): %s (was %s)", who, plan.line(), before)
        self.on_record(action, who, record, plan=plan.line(), was=before)
        return self.admin_view()

    def on_record(self, action: str, who: str, record: bool = True, **detail: Any) -> None:
        """An admin change in the prediction log's events (where there is a log), with the fleet's state after it
        for its other servers (serve/fleet_sync.py); a store that refuses is a warning: the change stands. A change
        followed from another server (`record` False) is its record already."""
        if self.log is None or not record:
            return
        from torchloom.serve.fleet_sync import stamp

        try:
            self.log.event("admin", who, action=action, **detail, **stamp(self))
        except Exception as e:  # noqa: BLE001 - the change is made; the record of it is what failed
            log.warning("admin: the change was made but not recorded in the prediction log (%s)", e)

    def remove(self, name: str, who: str, record: bool = True) -> dict[str, Any]:
        """Unload a model without traffic (a shadow stops being one first); the first model, the one the others are
        compared with, stays."""
        self.may_change()
        if name not in self.members:
            raise ApiError(404, "unknown_model", f"no model is named {name!r} (the models: {', '.join(self.order)})")
        if self.plan.traffic.get(name) or name == self.order[0]:
            why = "it takes traffic: move its share first" if self.plan.traffic.get(name) else \
                "it is the first model, the one the others are compared with"
            raise ApiError(409, "in_use", f"model {name} cannot be removed: {why} (PUT /v1/admin/traffic)")
        member = self.members.pop(name)
        self.order.remove(name)
        self.plan = Plan({n: s for n, s in self.plan.traffic.items() if n != name},
                         [s for s in self.plan.shadows if s != name])
        for table in (self.tallies, self.outcomes, self.verdicts):
            table.pop(name, None)
        self.count("admin", "remove")
        log.info("admin (%s): model %s (%s %s) removed", who, name, member.identity.name, member.identity.version)
        self.on_record("remove", who, record, model=name, version=member.identity.version)
        task = asyncio.ensure_future(self._release(member))
        self.shadow_tasks.add(task)
        task.add_done_callback(self.shadow_tasks.discard)
        return self.admin_view()

    def promote(self, name: str, who: str) -> dict[str, Any]:
        """`name` takes all the traffic and stops being a shadow; the others stay loaded, without traffic."""
        self.may_change()
        if name not in self.members:
            raise ApiError(404, "unknown_model", f"no model is named {name!r} (the models: {', '.join(self.order)})")
        plan = Plan({n: 100.0 if n == name else 0.0 for n in self.order}, [s for s in self.plan.shadows if s != name])
        return self.set_plan(plan, who, "promote")

    async def put_model(self, name: str, path: str, who: str, record: bool = True) -> dict[str, Any]:
        """Load `path` as model `name`, warmed up before it takes any traffic: a new model joins without traffic;
        a model of that name is replaced in place (its share and shadow role kept), and released once the texts
        it was given are answered."""
        self.may_change()
        if self.load is None:
            raise ApiError(501, "not_supported", "this server cannot load models (Ray Serve with several replicas"
                                                 " and no --log to share the change through); redeploy instead")
        path = path.removeprefix("file://") if path.startswith("file:///") else path  # a local path as a URL
        # where another host reads it: a store's URI or a registered version (never its credentials)
        source = redact(path) if is_uri(path) or path.startswith("models:/") else ""
        if source:  # fetched once into this host's cache, for either engine (the loop's candidate on Kubernetes)
            from torchloom.registry import local_copy

            path = await asyncio.to_thread(local_copy, path, f"model {name}")
        member = await self.load(name, path)
        member.source = source
        try:
            self.check_labels([self.members[self.order[0]], member] if self.order[0] != name else
                              [member, *(self.members[n] for n in self.order[1:])])
        except Exception as e:
            await member.backend.stop()
            raise ApiError(422, "labels_differ", str(e)) from None
        old = self.members.get(name)
        self.members[name] = member
        if old is None:
            self.order.append(name)
            self.tallies[name] = Tally()
            self.plan.traffic[name] = 0.0
        else:  # a new version: its labels counted afresh, its comparison too
            self.tallies[name] = Tally()
            self.outcomes.pop(name, None)
            self.verdicts.pop(name, None)
        if name == self.order[0]:
            self.identity = member.identity
        self.count("admin", "load" if old is None else "replace")
        log.info("admin (%s): model %s loaded from %s (%s %s)%s", who, name, path, member.identity.name,
                 member.identity.version, "" if old is None else f", replacing {old.identity.version}")
        self.on_record("load" if old is None else "replace", who, record, model=name, path=path,
                       version=member.identity.version)
        if old is not None:
            task = asyncio.ensure_future(self._release(old))
            self.shadow_tasks.add(task)
            task.add_done_callback(self.shadow_tasks.discard)
        return self.admin_view()

    async def _release(self, old: Member, timeout_s: float = 60.0) -> None:
        """Stop a replaced member once its queue is empty: what it was given, it answers."""
        deadline = time.monotonic() + timeout_s
        while old.backend.queued and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await old.backend.stop()
        log.info("released %s %s", old.identity.name, old.identity.version)

    def admin_view(self) -> dict[str, Any]:
        return {"plan": self.plan.line(), "traffic": dict(self.plan.traffic), "shadows": list(self.plan.shadows),
                "models": {n: {"name": self.members[n].identity.name, "version": self.members[n].identity.version,
                               "path": self.members[n].path,
                               # where another host reads it: the URI it came from, a registered model's
                               "source": self.members[n].source or self.members[n].identity.uri}
                           for n in self.order}}

    def check_labels(self, members: list[Member]) -> None:
        from torchloom.errors import UserError

        first = members[0]
        for m in members[1:]:
            if set(m.identity.labels) != set(first.identity.labels):
                raise UserError(f"--model {m.name}: its labels ({', '.join(m.identity.labels[:8])}) differ from"
                                f" {first.name}'s ({', '.join(first.identity.labels[:8])}); models behind one"
                                " endpoint must predict the same labels")

