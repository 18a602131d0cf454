"""The only way anything leaves the training loop: progress, metrics, Ray's report, a pruner, test faults.

The loop calls, on every rank:
  report(eval_record, checkpoint_dir) at every evaluation, the same number of times on each rank;
    a true result asks training to stop (only rank 0's answer counts, and only when may_stop);
  step_done(step) after every optimizer step;
  failed(error) when the rank fails, before it leaves the process group;
and on rank 0 only:
  log(record) for every line written to metrics.jsonl (train and eval records);
  progress(fields) at every log step and when an evaluation starts.
close() is called once when the rank's training ends, successfully or not.

Which reporters a worker gets is the launcher's business (engines/common.py assembles them); the
loop knows only this interface.
"""

from __future__ import annotations


class Reporter:
    may_stop = False  # True: report() may ask to stop, and every rank joins one collective per eval
    stop_reason = ""

    def report(self, metrics: dict, checkpoint_dir: str | None) -> bool | None:
        return None

    def log(self, record: dict) -> None:
        return None

    def progress(self, fields: dict) -> None:
        return None

    def step_done(self, step: int) -> None:
        return None

    def failed(self, error: BaseException) -> None:
        return None

    def close(self) -> None:
        return None


class Reporters(Reporter):
    """Several reporters as one: each sees every call, in order; any one of them may ask to stop."""

    def __init__(self, reporters: list[Reporter]):
        self.reporters = reporters
        self.may_stop = any(r.may_stop for r in reporters)
        self.stop_reason = ""

    def report(self, metrics: dict, checkpoint_dir: str | None) -> bool:
        stop = False
        for r in self.reporters:
            if r.report(metrics, checkpoint_dir) and r.may_stop:
                stop = True
                self.stop_reason = self.stop_reason or r.stop_reason
        return stop

    def _each(self, method: str, *args) -> None:
        for r in self.reporters:
            getattr(r, method)(*args)

    def log(self, record: dict) -> None:
        self._each("log", record)

    def progress(self, fields: dict) -> None:
        self._each("progress", fields)

    def step_done(self, step: int) -> None:
        self._each("step_done", step)

    def failed(self, error: BaseException) -> None:
        self._each("failed", error)

    def close(self) -> None:
        errors = []
        for r in self.reporters:
            try:
                r.close()
            except Exception as e:  # every reporter gets closed; the first failure is raised after
                errors.append(e)
        if errors:
            raise errors[0]


def combine(reporters: list[Reporter | None]) -> Reporter:
    present = [r for r in reporters if r is not None]
    if not present:
        return Reporter()
    return present[0] if len(present) == 1 else Reporters(present)
