"""The loop's state machine (torchloom.loop). Its state is nowhere but the prediction log's events: each step
reads where the cycle stands from them, does one thing, and appends the event that says what it did and which
stage comes next. A loop stopped anywhere (kill -9 included) starts again where the events say; two loops on one
fleet would read the same state and act twice, so a loop holds the fleet's lease while it runs (lease.py).

    idle         a trigger fires (triggers.py)                                  -> snapshot
    snapshot     the pinned data (snapshot.py)                                  -> train
    train        the champion's recipe on it (candidate.py)                     -> offline | paused
    offline      the offline gate (gates.py)                                    -> shadow | paused
    shadow       the candidate loaded as a shadow                               -> shadow_wait
    shadow_wait  enough shadow answers: the shadow gate                         -> canary | paused
    canary       the next share of the ramp                                     -> canary_wait
    canary_wait  harm: rolled back; enough labels at this share: the next share -> canary | promote | paused
    promote      all the traffic, the registry's alias                          -> watch | idle
    watch        the new champion's error rate and p99 for --watch-hours        -> idle | paused
    paused       a person looks; `torchloom loop resume`                        -> idle
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torchloom.errors import UserError
from torchloom.loop import gates, snapshot, triggers
from torchloom.loop.arguments import LoopSettings
from torchloom.loop.server import Server, ServerError, champion_of, model_numbers

RECORDS = ("started", "trigger", "snapshot", "candidate", "gate", "shadow", "canary", "promote", "watched", "rollback",
           "stopped", "resumed")  # the loop's own events (the server writes "admin", the webhook "alert")


def state_of(events: list[dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    """(stage, the current cycle's record: every detail since its trigger, later ones over earlier ones)."""
    stage, cycle = "idle", {}
    for e in events:
        if e["kind"] not in RECORDS:
            continue
        if e["kind"] == "trigger":
            cycle = {}
        cycle.update({k: v for k, v in e.items() if k not in ("seq", "kind", "who", "at", "stage", "passed")})
        stage = e.get("stage", stage)
    return stage, cycle


def readable(path: str, source: str, what: str = "the champion") -> str:
    """A model on this host: the server's copy where this host sees it (the loop beside the server), else fetched
    from the store it is on (a candidate trained in a Job) or from where the server loaded it (a registry or store
    URI: the loop in a pod of its own)."""
    from torchloom.uri import is_uri

    if Path(path).is_dir() or not (source or is_uri(path)):
        return path
    from torchloom.registry import local_copy

    return local_copy(path if is_uri(path) else source, what)


class Loop:
    def __init__(self, settings: LoopSettings, log, server: Server, say: Callable[[str], object] = print) -> None:
        self.s, self.log, self.server, self.say = settings, log, server, say
        self.triggers = triggers.parse(settings.triggers)

    def record(self, kind: str, stage: str, **detail: Any) -> dict[str, Any]:
        event = self.log.event(kind, self.s.who, stage=stage, **detail)
        self.say(f"loop: {kind}: {detail.get('line') or stage}")
        return event

    def step(self) -> tuple[bool, str]:
        """One step (module docstring): (whether it moved the cycle on, a line saying where it stands)."""
        events = self.log.events()
        if not any(e["kind"] in RECORDS for e in events):
            self.record("started", "idle", line=f"watching fleet {self.log.fleet} at {self.server.url}")
            events = self.log.events()
        stage, cycle = state_of(events)
        return getattr(self, f"_{stage}")(cycle, events)

    # --- the stages --------------------------------------------------------------------------------------------

    def _idle(self, cycle: dict[str, Any], events: list[dict[str, Any]]) -> tuple[bool, str]:
        last = [e for e in events if e["kind"] == "snapshot"]
        after = max([e["seq"] for e in events if e["kind"] == "trigger"], default=0)
        seen = {"labels": self.log.count_labels(last[-1]["watermark"] if last else 0),
                "alerts": [e.get("alert", "alert") for e in events if e["kind"] == "alert" and e["seq"] > after]}
        if any(t.id in ("drift", "accuracy") for t in self.triggers):
            seen["monitor"] = self.server.monitor()
        trigger, why = triggers.due(self.triggers, seen, events, self.s.cooldown_s, self.s.daily_limit)
        if trigger is None:
            return False, f"idle: {why} ({seen['labels']} new labels)"
        view = self.server.view()
        champion = champion_of(view)
        model = view["models"][champion]
        from torchloom.loop.candidate import recipe_of

        recipe = recipe_of(model["path"], self.s.recipe)
        number = sum(1 for e in events if e["kind"] == "trigger") + 1
        self.record("trigger", "snapshot", trigger=trigger.id, line=why, cycle=number, champion=champion,
                    champion_path=model["path"], champion_source=model.get("source", ""),
                    champion_version=model["version"], recipe=str(recipe))
        return True, f"triggered: {why}"

    def _snapshot(self, cycle: dict[str, Any], events) -> tuple[bool, str]:
        where = self.cycle_dir(cycle) / "snapshot"
        built = snapshot.build(self.log, Path(cycle["recipe"]), where, self.s.holdout)
        rows = built["rows"]
        line = (f"snapshot at label seq {built['watermark']}: train {rows['train']} ({built['feedback']['trained']}"
                f" fed back), val {rows['val']}, test {rows['test']} (frozen), newest {rows['newest']} held out;"
                f" set aside {built['feedback']['set_aside'] or 'none'}")
        self.record("snapshot", "train", snapshot=str(where), watermark=built["watermark"], rows=rows,
                    set_aside=built["feedback"]["set_aside"], sha256=built["sha256"], line=line)
        return True, line

    def _train(self, cycle: dict[str, Any], events) -> tuple[bool, str]:
        name = f"{self.log.fleet}-r{cycle['cycle']}"
        run: Path | str = self.cycle_dir(cycle) / "run"
        try:
            if self.s.train_on == "k8s":
                from torchloom.loop.candidate_job import train as train_in_job

                summary = train_in_job(Path(cycle["recipe"]), Path(cycle["snapshot"]), self.cycle_dir(cycle),
                                       self.s.store, name, self.say)
                run = summary["run_dir"]
            else:
                from torchloom.loop.candidate import train

                summary = train(Path(cycle["recipe"]), Path(cycle["snapshot"]), Path(run), self.say)
        except UserError as e:
            self.record("stopped", "paused", gate="train", line=str(e))
            return True, str(e)
        line = f"candidate {name}: test accuracy {summary.get('accuracy', 0):.3f} in its own run ({run})"
        registered = summary.get("registered") or {}
        model = f"{run}/model"
        # the server loads a registered candidate from the registry (a serve pod cannot read this host's run)
        self.record("candidate", "offline", candidate=name, candidate_path=model, run=str(run),
                    candidate_source=registered.get("uri", "") or (model if self.s.train_on == "k8s" else ""),
                    registered=summary.get("registered"), line=line)
        return True, line

    def _offline(self, cycle: dict[str, Any], events) -> tuple[bool, str]:
        where = Path(cycle["snapshot"])
        sets = {"frozen_test": snapshot.frozen_test(where), "newest": snapshot.newest_slice(where)}
        champion = readable(cycle["champion_path"], cycle.get("champion_source", ""))
        candidate = readable(cycle["candidate_path"], cycle.get("candidate_source", ""), "the candidate")
        result = gates.offline(champion, candidate, sets, self.s.margin,
                               self.s.class_margin, self.s.alpha, self.s.max_slowdown)
        return self.gate(cycle, "offline", result, "shadow", self.summary_line(result))

    def _shadow(self, cycle: dict[str, Any], events) -> tuple[bool, str]:
        try:
            view = self.server.load(cycle["candidate"], cycle["candidate_path"])
        except ServerError:
            if not cycle.get("candidate_source"):
                raise
            # the server runs elsewhere (its own pod) and cannot read this host's run: the registered version
            view = self.server.load(cycle["candidate"], cycle["candidate_source"])
        self.server.traffic(view["traffic"], [*view["shadows"], cycle["candidate"]])
        since = time.time()
        self.record("shadow", "shadow_wait", shadow_since=since, line=f"{cycle['candidate']} is a shadow of"
                    f" {cycle['champion']}: it sees every text, answers none")
        return True, "shadow started"

    def _shadow_wait(self, cycle: dict[str, Any], events) -> tuple[bool, str]:
        champion, candidate, since = cycle["champion"], cycle["candidate"], cycle["shadow_since"]
        seen = gates.agreement(self.log, champion, candidate, since)["n"]
        if seen < self.s.shadow_texts:
            return False, f"shadow: {seen} of {self.s.shadow_texts} texts answered by both"
        errors = self.server.counter("torchloom_shadow_dropped_total", model=candidate, reason="model_error")
        result = gates.shadow(self.log, champion, candidate, since, errors, self.s.min_agreement,
                              self.s.max_error_rate, self.s.alpha)
        a = result["agreement"]
        line = (f"agreement {a['interval']['value']:.3f} on {a['n']} texts, {result['errors']:g} errors;"
                f" {result['labels']['line']}")
        if not result["passed"]:
            self.withdraw(cycle)
        return self.gate(cycle, "shadow", result, "canary", line, step=0)

    def _canary(self, cycle: dict[str, Any], events) -> tuple[bool, str]:
        step = cycle.get("step", 0)
        share = self.s.ramp[step]
        champion, candidate = cycle["champion"], cycle["candidate"]
        view = self.server.view()
        split = dict(view["traffic"])  # the other models of the fleet keep their shares
        base = split[champion] + split.get(candidate, 0.0)  # the ramp's share is of the champion's traffic
        split.update({champion: base * (100.0 - share) / 100.0, candidate: base * share / 100.0})
        self.server.traffic(split, [s for s in view["shadows"] if s != candidate])
        now = time.time()
        numbers = model_numbers(self.server.metrics(), champion, candidate)
        self.record("canary", "canary_wait", step=step, share=share, canary_since=cycle.get("canary_since", now),
                    step_since=now, limits_at=numbers,
                    line=f"{candidate} answers {share:g} % of the traffic, {champion} the rest")
        return True, f"canary at {share:g} %"

    def _canary_wait(self, cycle: dict[str, Any], events) -> tuple[bool, str]:
        numbers = model_numbers(self.server.metrics(), cycle["champion"], cycle["candidate"])
        limits = gates.limits(cycle.get("limits_at") or {}, numbers, self.s.max_error_rate, self.s.max_p99_ratio)
        if limits["breached"]:
            self.withdraw(cycle)
            line = f"rolled back to {cycle['champion']}: {'; '.join(limits['why'])}"
            self.record("rollback", "paused", gate="canary limits", limits=limits, line=line)
            self.tag(cycle, {"torchloom.loop.outcome": "rolled back", "torchloom.loop.rollback": line})
            return True, line
        result = gates.canary(self.log, cycle["champion"], cycle["candidate"], cycle["canary_since"],
                              cycle["step_since"], self.s.canary_labels, self.s.alpha, self.s.min_effect)
        if result["harm"]:
            self.withdraw(cycle)
            self.record("rollback", "paused", gate="canary", verdict=result, line=f"rolled back to {cycle['champion']}:"
                        f" {result['line']}")
            self.tag(cycle, {"torchloom.loop.outcome": "rolled back", "torchloom.loop.rollback": result["line"]})
            return True, f"rolled back: {result['line']}"
        if result["candidate_labels_this_step"] < self.s.canary_labels:
            return False, (f"canary at {cycle['share']:g} %: {result['candidate_labels_this_step']} of"
                           f" {self.s.canary_labels} labels on the candidate's answers; {result['line']}")
        last = cycle["step"] + 1 >= len(self.s.ramp)
        said = f"no harm at {cycle['share']:g} %: {result['line']}"
        self.record("gate", "promote" if last else "canary", gate=f"canary {cycle['share']:g} %", passed=True,
                    verdict=result, step=cycle["step"] + 1, line=said)
        self.tag(cycle, {f"torchloom.loop.gate.canary_{cycle['share']:g}": said})
        return True, "canary step passed"

    def _promote(self, cycle: dict[str, Any], events) -> tuple[bool, str]:
        view = self.server.view()
        others = {n: v for n, v in view["traffic"].items() if n not in (cycle["champion"], cycle["candidate"])}
        if any(others.values()):  # the fleet's other models keep their shares: the champion's goes to the candidate
            split = dict(view["traffic"])
            split[cycle["candidate"]] += split[cycle["champion"]]
            split[cycle["champion"]] = 0.0
            self.server.traffic(split, view["shadows"])
        else:
            self.server.promote(cycle["candidate"])
        moved = self.move_alias(cycle)
        # the limits the watch holds the new champion to: its counters from now, the old one's p99 as it served
        numbers = model_numbers(self.server.metrics(), cycle["champion"], cycle["candidate"])
        self.record("promote", "watch" if self.s.watch_s else "idle", champion=cycle["candidate"],
                    previous=cycle["champion"], registry=moved, watch_since=time.time(), watch_at=numbers,
                    line=f"{cycle['candidate']} promoted over {cycle['champion']}"
                         + (f"; {moved['name']}@{moved['alias']} is version {moved['version']}" if moved else ""))
        self.tidy(cycle)
        return True, "promoted"

    def _watch(self, cycle: dict[str, Any], events) -> tuple[bool, str]:
        """After promotion: the new champion's error rate since, and its recent p99 against the one the champion
        it replaced had when it last served; a breach rolls back (the old one is still loaded: tidy keeps it)."""
        new, old, at = cycle["candidate"], cycle["previous"], cycle.get("watch_at") or {}  # promote's names
        now = model_numbers(self.server.metrics(), old, new)
        found = gates.limits(at, {**now, "champion_p99": at.get("champion_p99", 0.0),
                                  "champion_count": at.get("champion_count", 0.0)},
                             self.s.max_error_rate, self.s.max_p99_ratio)
        if found["breached"]:
            line = f"rolled back to {old} after promotion: {'; '.join(found['why'])}"
            self.roll_back(cycle)
            self.record("rollback", "paused", gate="watch", limits=found, line=line)
            self.tag(cycle, {"torchloom.loop.outcome": "rolled back after promotion", "torchloom.loop.rollback": line})
            return True, line
        left = cycle["watch_since"] + self.s.watch_s - time.time()
        said = f"{found['requests']:g} requests, {found['failed']:g} failed"
        if left > 0:
            return False, f"watching {new} for {left / 60:.0f} min more: {said}, no limit breached"
        line = f"{new} kept after {self.s.watch_s / 3600:g} h: {said}, no limit breached"
        self.record("watched", "idle", limits=found, line=line)
        self.tag(cycle, {"torchloom.loop.watch": line})
        return True, line

    def roll_back(self, cycle: dict[str, Any]) -> None:
        """The promoted model's traffic back to the champion it replaced (loaded again if it was unloaded), and the
        registry's alias back to its version."""
        new, old = cycle["candidate"], cycle["previous"]
        view = self.server.view()
        if old not in view["traffic"]:
            view = self.server.load(old, cycle.get("champion_source") or cycle["champion_path"])
        split = dict(view["traffic"])
        split[old] = split.get(old, 0.0) + split.get(new, 0.0)
        split[new] = 0.0
        self.server.traffic(split, [s for s in view["shadows"] if s != new])
        from torchloom.loop.registry import restore_alias

        restore_alias(cycle, self.say)

    def _paused(self, cycle: dict[str, Any], events) -> tuple[bool, str]:
        return False, ("paused: a person looks first (torchloom loop history shows why); then torchloom loop resume")

    # --- helpers -----------------------------------------------------------------------------------------------

    def gate(self, cycle: dict[str, Any], name: str, result: dict[str, Any], then: str, line: str, **detail: Any
             ) -> tuple[bool, str]:
        passed = result["passed"]
        said = f"{name} gate {'passed' if passed else 'refused the candidate'}: " + (line if passed else
                                                                                      "; ".join(result["why"]))
        self.record("gate", then if passed else "paused", gate=name, passed=passed, result=result, line=said,
                    **detail)
        tags = {f"torchloom.loop.gate.{name}": said}
        if not passed:
            tags["torchloom.loop.outcome"] = f"stopped at the {name} gate"
        self.tag(cycle, tags)
        return True, f"{name} gate {'passed' if passed else 'refused'}"

    def cycle_dir(self, cycle: dict[str, Any]) -> Path:
        return self.s.work / f"cycle-{cycle['cycle']}"

    @staticmethod
    def summary_line(result: dict[str, Any]) -> str:
        parts = [f"{k}: {v['candidate']:.3f} vs {v['champion']:.3f} (n {v['n']})" for k, v in result["sets"].items()]
        return "; ".join(parts) + f"; latency x{result['latency']['ratio']:.2f}"

    def withdraw(self, cycle: dict[str, Any]) -> None:
        """The champion takes the candidate's traffic back (the other models keep theirs); the candidate is
        unloaded."""
        view = self.server.view()
        split = dict(view["traffic"])
        if cycle["candidate"] in split:
            split[cycle["champion"]] += split[cycle["candidate"]]
            split[cycle["candidate"]] = 0.0
        self.server.traffic(split, [s for s in view["shadows"] if s != cycle["candidate"]])
        try:
            self.server.remove(cycle["candidate"])
        except ServerError as e:
            self.say(f"loop: warning: {e}")

    def tidy(self, cycle: dict[str, Any]) -> None:
        """Earlier candidates of this loop that take no traffic, unloaded (the champion just replaced stays, to
        roll back to)."""
        view = self.server.view()
        for name, share in view["traffic"].items():
            if name.startswith(f"{self.log.fleet}-r") and not share and name not in (cycle["champion"],
                                                                                        cycle["candidate"]):
                try:
                    self.server.remove(name)
                except ServerError as e:
                    self.say(f"loop: warning: {e}")

    def move_alias(self, cycle: dict[str, Any]) -> dict[str, str] | None:
        from torchloom.loop.registry import move_alias

        return move_alias(cycle, self.say)

    def tag(self, cycle: dict[str, Any], tags: dict[str, Any]) -> None:
        from torchloom.loop.registry import tag

        tag(cycle, tags, self.say)


def run(loop: Loop, poll_s: float, stop: Callable[[], bool]) -> int:
    """Steps until stopped: at once while they move the cycle on, every poll_s while they wait. A server that
    cannot be reached is waited for."""
    while not stop():
        try:
            moved, line = loop.step()
        except ServerError as e:
            moved, line = False, f"{e} (trying again in {poll_s:g} s)"
        loop.say(f"loop: {line}")
        if not moved:
            for _ in range(max(1, int(poll_s * 10))):
                if stop():
                    break
                time.sleep(0.1)
    return 0
