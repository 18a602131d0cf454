"""A training Job run from inside the cluster (`torchloom loop --train-on k8s`): the headless Service and the
Indexed Job of k8s/job.py created through the API, watched to their end, and deleted once the Job succeeded.

- Each object's uid is written to the caller's journal the moment it is created: a loop that restarts adopts its
  own Job (the same name with the recorded uid) and watches it on. An object of that name it did not record is
  never touched: one line that says whose it may be and what to do.
- Complete: the Job and its Service are deleted by their recorded uids (a precondition: an object someone made
  again under the name is not deleted), the pods with the Job. Failed: one line with the Job's reason and the
  `kubectl` command that shows its pods' logs; both objects are kept for a person to look at.
- Progress: a line whenever the pods' counts (active, succeeded, failed) change, and every few minutes while
  they do not; an API server that does not answer is waited for (OUTAGE_S), then the error stands.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from torchloom.errors import UserError
from torchloom.k8s.apply import api_client, call, client_module

WHO = "loop: training job"
OUTAGE_S = 300.0  # the API server not answering this long ends the wait
QUIET_S = 300.0  # a progress line at least this often


class JobRun:
    """The objects (k8s/job.train_manifests: the Service, then the Job) of one training, in `namespace`, their uids
    kept in the JSON file `journal`."""

    def __init__(self, objects: list[dict], namespace: str, journal: Path, say: Callable[[str], object]) -> None:
        kubernetes = client_module()
        api = api_client(kubernetes)
        self.core, self.batch = kubernetes.client.CoreV1Api(api), kubernetes.client.BatchV1Api(api)
        self.models = kubernetes.client
        self.objects, self.namespace, self.journal, self.say = objects, namespace, journal, say
        self.job = next(o["metadata"]["name"] for o in objects if o["kind"] == "Job")

    def _api(self, kind: str):
        if kind == "Job":
            return self.batch.read_namespaced_job, self.batch.create_namespaced_job, self.batch.delete_namespaced_job
        return (self.core.read_namespaced_service, self.core.create_namespaced_service,
                self.core.delete_namespaced_service)

    def recorded(self) -> dict[str, str]:
        try:
            return json.loads(self.journal.read_text()).get("uids", {})
        except (OSError, ValueError):
            return {}

    def _record(self, uids: dict[str, str]) -> None:
        tmp = self.journal.with_suffix(".tmp")
        tmp.write_text(json.dumps({"namespace": self.namespace, "job": self.job, "uids": uids}))
        tmp.replace(self.journal)

    def submit(self) -> str:
        """Create what is missing, adopt what this journal recorded; 'created' or 'adopted'."""
        uids = self.recorded()
        adopted = False
        for o in self.objects:
            kind, name = o["kind"], o["metadata"]["name"]
            read, create, _ = self._api(kind)
            found = call(f"reading {kind.lower()} {name}", read, name, self.namespace, missing_ok=True, who=WHO)
            if found is not None:
                if found.metadata.uid != uids.get(kind):
                    raise UserError(f"{WHO}: {kind.lower()} {name} in namespace {self.namespace}: already there and"
                                    " not this loop's (not in its journal); delete it (kubectl -n"
                                    f" {self.namespace} delete {kind.lower()} {name}) if it is a leftover")
                adopted = True
                continue
            made = call(f"creating {kind.lower()} {name}", create, self.namespace, o, who=WHO)
            uids[kind] = made.metadata.uid
            self._record(uids)
        return "adopted" if adopted else "created"

    def wait(self, poll_s: float = 5.0, stop: Callable[[], bool] = lambda: False) -> dict:
        """Until the Job completes (its status counts) or fails (a UserError); `stop` ends the wait (the Job goes
        on, adopted by the next loop)."""
        read = self._api("Job")[0]
        seen, said_at, unanswered = None, time.monotonic(), None
        while not stop():
            try:
                job = call(f"reading job {self.job}", read, self.job, self.namespace, who=WHO)
                unanswered = None
            except UserError:
                unanswered = unanswered or time.monotonic()
                if time.monotonic() - unanswered > OUTAGE_S:
                    raise
                time.sleep(poll_s)
                continue
            status = job.status  # None until the Job controller first writes it
            counts = {k: getattr(status, k, None) or 0 for k in ("active", "succeeded", "failed")}
            waiting = ""
            for condition in getattr(status, "conditions", None) or []:
                if condition.status != "True":
                    continue
                if condition.type == "Suspended":  # Kueue (or a person) holds it until admitted
                    waiting = f", suspended ({condition.reason or 'not admitted yet'})"
                if condition.type == "Complete":
                    self.say(f"loop:   job {self.job}: complete ({counts['succeeded']} pods succeeded)")
                    return counts
                if condition.type == "Failed":
                    raise UserError(f"{WHO} {self.job}: failed ({condition.reason or 'no reason given'}:"
                                    f" {(condition.message or '').strip()[:160]}); its pods' logs: kubectl -n"
                                    f" {self.namespace} logs -l job-name={self.job} --prefix; the Job is kept")
            if (counts, waiting) != seen or time.monotonic() - said_at > QUIET_S:
                self.say(f"loop:   job {self.job}: {counts['active']} pods running, {counts['succeeded']}"
                         f" succeeded, {counts['failed']} failed{waiting}")
                seen, said_at = (counts, waiting), time.monotonic()
            time.sleep(poll_s)
        return {}

    def delete(self) -> list[str]:
        """The recorded objects deleted by their uids (the Job's pods with it); what was deleted."""
        uids, done = self.recorded(), []
        for o in reversed(self.objects):
            kind, name = o["kind"], o["metadata"]["name"]
            if kind not in uids:
                continue
            options = self.models.V1DeleteOptions(propagation_policy="Background",
                                                  preconditions=self.models.V1Preconditions(uid=uids[kind]))
            if call(f"deleting {kind.lower()} {name}", self._api(kind)[2], name, self.namespace, body=options,
                    missing_ok=True, who=WHO) is not None:
                done.append(f"{kind.lower()}/{name}")
        return done
