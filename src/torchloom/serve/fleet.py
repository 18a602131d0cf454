"""Several models behind one endpoint (issue 58): a traffic split, shadows, prediction ids, feedback, online
accuracy and a verdict on which model is better; the admin's changes, applied without a restart.

A `Fleet` is the backend the HTTP app talks to (app.py): every server has one, of one model or several. Its
members are the engine's own backends (server.LocalBackend, ray_engine.RayBackend), each named by its
`--model NAME=DIR`. A request goes to one member: by the hash of its key (`X-Torchloom-Key`: the same key, the same
model, while the split stays) or at random, in the proportions of the split. Each shadow gets every text; its
answers are recorded, never returned, and where its encoding equals the answering model's, it takes the texts
tokenized once. Each text answered gets an id; `POST /v1/feedback` with the id and the true label scores every
model that answered it. The verdict (ab.compare) compares each model with the first (`--model` order) on the
labels they share: paired where both answered the same texts (a shadow), unpaired otherwise (a split).

Everything here runs on the event loop thread; no locks.
"""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from typing import Any

from torchloom.monitor.ab import ALPHA, MIN_EFFECT, N_MIN, Outcomes, Tally, Verdict, compare
from torchloom.serve.api_common import ApiError
from torchloom.serve.batcher import Overloaded, ShuttingDown
from torchloom.serve.fleet_admin import FleetAdmin, Member
from torchloom.serve.split import Plan, key_point

log = logging.getLogger("torchloom.serve")
FEEDBACK_SIZE = 100_000  # predictions kept for feedback: the most recent this many
SHADOW_GATHER_S = 0.005  # a shadow's texts of the requests that come within this go to it in one call
LATENCY_KEPT = 10_000  # each model's newest request times, for its recent p50 and p99 (the loop's canary limit)
VERDICT_EVERY_S = 0.5  # the verdict is worked out again at most this often on feedback (always on a read)


class Fleet(FleetAdmin):
    """The backend of the HTTP app over one or more models (module docstring)."""

    def __init__(self, members: list[Member], plan: Plan, metrics, feedback_size: int = FEEDBACK_SIZE,
                 alpha: float = ALPHA, min_effect: float = MIN_EFFECT, n_min: int = N_MIN,
                 load: Callable[[str, str], Awaitable[Member]] | None = None, log=None) -> None:
        """metrics: the server's ServeMetrics, shared by the members; load: makes a member (NAME, DIR) for the
        admin route, warmed up (None: loading refused); log: the durable monitor.predlog.PredictionLog, or None
        (serve/fleet_log.py: what it is given, and what it gives back after a restart or from other replicas)."""
        self.members = {m.name: m for m in members}
        self.order = [m.name for m in members]  # the first is the one the others are compared with
        self.plan = plan
        self.metrics = metrics
        self.feedback_size, self.alpha, self.min_effect, self.n_min = feedback_size, alpha, min_effect, n_min
        self.load = load
        self.records: OrderedDict[str, dict[str, str | None]] = OrderedDict()  # id -> {model: its label}
        # id -> its true label, and where a shadow had not answered it yet: {shadow: its place in the outcomes}
        self.labelled: dict[str, str] = {}
        self.awaiting: dict[str, dict[str, int]] = {}
        self.prefix = secrets.token_hex(3)  # ids of different servers and starts never meet
        self.counter = 0
        self.tallies = {name: Tally() for name in self.order}
        self.outcomes: dict[str, Outcomes] = {}
        self.verdicts: dict[str, Verdict] = {}
        self.verdict_at = 0.0
        self.labels_in = 0  # labels recorded, ever
        self.judged = -1  # labels_in when the verdicts were last worked out
        self.counts: dict[tuple[str, ...], float] = {}  # counters for /metrics: (family, labels...) -> value
        self.shadow_tasks: set[asyncio.Task] = set()
        self.shadow_pending: dict[str, list[tuple[list[str], list[str], list[Any] | None]]] = {}
        self.rng = random.Random()
        self.identity = members[0].identity
        self.refused: str | None = None  # why feedback and changes are refused here (Ray's several replicas)
        self.log = log
        # the deployment this server is one of, and the newest admin event it follows (serve/fleet_sync.py)
        self.epoch, self.synced, self.sync_failed, self.caught_up = "", 0, 0, log is None
        self.sync_lock = asyncio.Lock()
        self.latency: dict[str, deque[tuple[float, float]]] = {}  # model -> (start, seconds) of its requests
        self.timeline: list[dict[str, Any]] = []  # the log's newest events (fleet_log.keep_in_step)
        self.check_labels(members)

    def may_change(self) -> None:
        if self.refused:
            raise ApiError(501, "not_supported", self.refused)

    # --- the Backend protocol ------------------------------------------------------------------------------

    @property
    def fleet(self) -> Fleet:  # the several models behind the endpoint: this
        return self

    @property
    def ready(self) -> bool:  # warmed up, and (with a log) serving its fleet's newest state (fleet_sync.py)
        return self.caught_up and all(m.backend.ready for m in self.members.values())

    @property
    def queued(self) -> int:
        return sum(m.backend.queued for m in self.members.values())

    async def start(self) -> None:
        for m in self.members.values():
            await m.backend.start()
        if self.log is not None:
            from torchloom.serve.fleet_log import keep_in_step
            from torchloom.serve.fleet_sync import catch_up

            async with self.sync_lock:  # before it is ready: a restarted server serves its fleet's state at once
                await catch_up(self)
            self.caught_up = True
            self.shadow_tasks.add(asyncio.ensure_future(keep_in_step(self)))

    async def stop(self) -> None:
        for task in list(self.shadow_tasks):
            task.cancel()
        for m in self.members.values():
            await m.backend.stop()
        if self.log is not None:
            await asyncio.to_thread(self.log.close)

    def count(self, *key: str, amount: float = 1.0) -> None:
        self.counts[key] = self.counts.get(key, 0.0) + amount

    def route(self, key: str | None) -> Member:
        """The member that answers: the key's point in the split, else a random one."""
        point = key_point(key) if key else self.rng.random() * 100
        edge = 0.0
        for name, share in self.plan.traffic.items():
            edge += share
            if point < edge and share:
                return self.members[name]
        return self.members[max(self.plan.traffic, key=self.plan.traffic.get)]  # rounding at the top

    async def predict(self, texts: list[str], key: str | None = None) -> list[dict[str, Any]]:
        """Answers for `texts` from the routed member, each with its "id" and the member's name ("model");
        the shadows get the same texts, on their own time."""
        member = self.route(key)
        ids = self.new_ids(len(texts))
        shadows = [self.members[s] for s in self.plan.shadows if s != member.name]
        on_items = None
        if shadows:
            sharing = [s for s in shadows if s.encoding is not None and s.encoding == member.encoding]
            others = [s for s in shadows if s not in sharing]
            for s in others:
                self.watch(s, texts, ids)
            if sharing:
                def on_items(items: list[Any]) -> None:
                    for s in sharing:
                        self.watch(s, texts, ids, items)
        started = time.monotonic()
        self.count("requests", member.name)
        try:
            answers = await (member.backend.predict(texts, on_items=on_items) if on_items is not None
                             else member.backend.predict(texts))
        except BaseException as e:
            for i in ids:
                self.records.pop(i, None)
            if isinstance(e, Exception) and not isinstance(e, Overloaded | ShuttingDown):
                self.count("failed", member.name)  # the model's own failure (not a full queue, not a stop)
            raise
        self.latency.setdefault(member.name, deque(maxlen=LATENCY_KEPT)).append((started, time.monotonic() - started))
        for i, answer in zip(ids, answers):
            answer["id"], answer["model"] = i, member.name
            record = self.records.get(i)
            if record is not None:
                record[member.name] = answer["label"]
        self.count("answers", member.name, "answer", amount=len(texts))
        if self.log is not None:
            self.log.predictions(member.name, member.identity.version, "answer", ids, texts, answers)
        return answers

    def new_ids(self, n: int) -> list[str]:
        """n prediction ids, each with an empty record; the oldest records leave past feedback_size."""
        ids = []
        for _ in range(n):
            self.counter += 1
            i = f"{self.prefix}-{self.counter:x}"
            self.records[i] = {}
            ids.append(i)
        while len(self.records) > self.feedback_size:
            old, _ = self.records.popitem(last=False)
            self.labelled.pop(old, None)
            if self.awaiting.pop(old, None) is not None:
                self.count("feedback_late", "never_answered")
        return ids

    def watch(self, shadow: Member, texts: list[str], ids: list[str], items: list[Any] | None = None) -> None:
        """The shadow's answers to `texts`, recorded under their ids when they come; never awaited by the client.
        The texts of the requests that come within SHADOW_GATHER_S go to the shadow in one call: per request, a
        shadow then costs the event loop an append (one call each cost the tiny model's server a third of its
        answers, docs/benchmarks.md)."""
        pending = self.shadow_pending.setdefault(shadow.name, [])
        pending.append((texts, ids, items))
        if len(pending) == 1:
            asyncio.get_running_loop().call_later(SHADOW_GATHER_S, self._flush, shadow.name)

    def _flush(self, name: str) -> None:
        pending = self.shadow_pending.pop(name, [])
        shadow = self.members.get(name)
        if shadow is None or not pending:
            return
        room = shadow.backend.room()
        for encoded in (True, False):  # texts tokenized once (items), and texts the shadow tokenizes itself
            group = [p for p in pending if (p[2] is not None) == encoded]
            texts = [t for p in group for t in p[0]]
            if not texts:
                continue
            if len(texts) > room:  # whole requests' texts, as many as its queue holds now; the rest counted
                fits, kept = [], 0
                for p in group:
                    if kept + len(p[0]) <= room:
                        fits.append(p)
                        kept += len(p[0])
                self.count("shadow_dropped", name, "overloaded", amount=len(texts) - kept)
                group, texts = fits, [t for p in fits for t in p[0]]
                if not texts:
                    continue
            room -= len(texts)
            ids = [i for p in group for i in p[1]]
            items = [x for p in group for x in p[2]] if encoded else None
            task = asyncio.ensure_future(self._shadow(shadow, texts, ids, items))
            self.shadow_tasks.add(task)
            task.add_done_callback(self.shadow_tasks.discard)

    async def _shadow(self, shadow: Member, texts: list[str], ids: list[str], items: list[Any] | None) -> None:
        try:
            answers = await (shadow.backend.predict(texts, items=items) if items is not None
                             else shadow.backend.predict(texts))
        except (Overloaded, ShuttingDown) as e:
            self.count("shadow_dropped", shadow.name, "overloaded" if isinstance(e, Overloaded) else "stopping",
                       amount=len(texts))
            return
        except asyncio.CancelledError:
            raise
        except Exception:  # the model's error: logged by its batcher under an id
            self.count("shadow_dropped", shadow.name, "model_error", amount=len(texts))
            return
        for i, answer in zip(ids, answers):
            record = self.records.get(i)
            if record is not None:
                record[shadow.name] = answer["label"]
                if i in self.awaiting:  # labelled before this shadow answered: credited now
                    self.credit_late(i, shadow.name, answer["label"])
        self.count("answers", shadow.name, "shadow", amount=len(texts))
        if self.log is not None:
            self.log.predictions(shadow.name, shadow.identity.version, "shadow", ids, texts, answers)

    def credit_late(self, prediction_id: str, name: str, answered: str) -> None:
        """A shadow's answer to a text whose label came first: scored as if it had been there (its tally, and its
        pair with the first model's answer in the outcomes), counted in torchloom_feedback_late_total."""
        place = self.awaiting[prediction_id].pop(name, None)
        if not self.awaiting[prediction_id]:
            del self.awaiting[prediction_id]
        if place is None or name not in self.tallies:
            return
        ok = answered == self.labelled[prediction_id]
        self.tallies[name].labels += 1
        self.tallies[name].right += ok
        outcomes = self.outcomes.get(name)
        if outcomes is not None and place < len(outcomes.b):
            outcomes.b[place] = ok
        self.labels_in += 1  # the verdict is worked out again
        self.count("feedback_late", "credited")

    # --- feedback and the verdict --------------------------------------------------------------------------

    def feedback(self, prediction_id: str, label: str) -> dict[str, Any]:
        """Record the true `label` of a prediction: every model that answered it is scored. ApiError 404 for an
        id unknown or past the store, 409 for one already labelled, 422 for a label the models do not have. With a
        log, feedback is the fleet's (an id another replica answered is recalled from it), whatever the replicas."""
        if self.log is None:
            self.may_change()
        record = self.records.get(prediction_id)
        if record is None or not record:
            self.count("feedback", "unknown_id")
            raise ApiError(404, "unknown_id", f"prediction id {prediction_id!r} is unknown or expired (the server"
                                              f" keeps the last {self.feedback_size} predictions:"
                                              " --feedback-size); send feedback sooner")
        if prediction_id in self.labelled:
            self.count("feedback", "duplicate")
            raise ApiError(409, "already_labelled", f"prediction id {prediction_id!r} already has a label; each"
                                                    " prediction takes one")
        labels = self.identity.labels
        if label not in labels:
            self.count("feedback", "invalid_label")
            raise ApiError(422, "unknown_label", f"label {label!r} is not one of the model's labels"
                                                 f" ({', '.join(labels[:20])}); GET /v1/labels lists them")
        self.labelled[prediction_id] = label
        self.labels_in += 1
        if self.log is not None:
            self.log.feedback(prediction_id, label)
        self.count("feedback", "recorded")
        right = {name: answered == label for name, answered in record.items() if answered is not None}
        for name, ok in right.items():
            if name in self.tallies:
                self.tallies[name].labels += 1
                self.tallies[name].right += ok
        control = self.order[0]
        for name in self.order[1:]:
            if control in right or name in right:
                outcomes = self.outcomes.setdefault(name, Outcomes())
                if name not in right and name in self.plan.shadows:  # its answer may come later
                    self.awaiting.setdefault(prediction_id, {})[name] = len(outcomes.b)
                outcomes.add(right.get(control), right.get(name))
        if time.monotonic() - self.verdict_at >= VERDICT_EVERY_S:
            self.judge()
        return {"id": prediction_id, "label": label, "right": right}

    def judge(self) -> dict[str, Verdict]:
        """Each model against the first on the labels they share (worked out again only after new labels: a
        dashboard's reads cost nothing more); a log line when a verdict changes."""
        if self.judged == self.labels_in and self.verdicts.keys() == self.outcomes.keys():
            return self.verdicts
        self.judged = self.labels_in
        self.verdict_at = time.monotonic()
        control = self.order[0]
        for name, outcomes in self.outcomes.items():
            verdict = compare(outcomes, self.alpha, self.n_min, self.min_effect)
            before = self.verdicts.get(name)
            self.verdicts[name] = verdict
            if before is None or before.state != verdict.state:
                log.info("verdict %s against %s: %s", name, control, verdict.line((control, name)))
        return self.verdicts

    def report(self) -> dict[str, Any]:
        """The fleet's part of GET /v1/monitor: models, split, shadows, online accuracy, verdicts."""
        verdicts = self.judge()
        control = self.order[0]
        models = {}
        for name in self.order:
            m = self.members[name]
            models[name] = {**m.identity.brief(),
                            "traffic": self.plan.traffic.get(name, 0.0), "shadow": name in self.plan.shadows,
                            "online_accuracy": self.tallies[name].interval(),
                            "monitor": _brief(m.backend.monitor_report())}
        comparisons = [{"model": name, "against": control, "state": v.state, "test": v.test, "labels": v.labels,
                        "p_value": v.p_value, "level": v.level, "needed": v.needed, "line": v.line((control, name))}
                       for name, v in verdicts.items()]
        return {"models": models, "plan": self.plan.line(), "verdicts": comparisons,
                "feedback": {"kept": len(self.records), "labelled": len(self.labelled)}, "timeline": self.timeline}

    # --- the admin's changes (app.admin_router) ----------------------------------------------------------

    def monitor_reports(self) -> list[tuple[tuple[str, str], dict[str, Any]]]:
        """Each model's name here, version and monitor report: the torchloom_monitor_* gauges' series."""
        return [((n, self.members[n].identity.version), self.members[n].backend.monitor_report()) for n in self.order]

    def monitor_report(self) -> dict[str, Any]:
        """The monitor report of the model most traffic goes to (GET /v1/monitor's top level)."""
        name = max(self.order, key=lambda n: self.plan.traffic.get(n, 0.0))
        return self.members[name].backend.monitor_report()


def _brief(report: dict[str, Any]) -> dict[str, Any]:
    return {k: report.get(k) for k in ("state", "drift", "drifted", "texts", "signals", "stale", "estimated_accuracy")}
