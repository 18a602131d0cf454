"""The loop's gates, each a test whose assumptions are written here (docs/serving.md, "The loop").

Offline, on texts with true labels both models score (the champion's frozen test split; the newest labelled
slice, held out of training):
    non-inferiority   per text d = (candidate right) - (champion right), in {-1, 0, 1}. H0: the mean of d is at
                      most -margin (the candidate worse by the margin or more); refused unless the one-sided
                      normal test on the paired mean rejects H0 at level alpha, i.e. the lower confidence bound of
                      the accuracy difference lies above -margin. Assumes the texts independent draws of what the
                      model will see and the labels true; the normal approximation wants some tens of texts (a
                      set under MIN_TEXTS is reported and not gated).
    per-class harm    for each true class, its texts the two models score differently: the class is harmed when
                      its recall drops by more than class_margin and McNemar's exact test (one-sided) finds the
                      champion better at level alpha / classes (Bonferroni over the classes): a small class is
                      judged on evidence of harm, not refused for want of texts.
    latency           both models time the same texts in this process, alternately, best of ROUNDS; refused
                      above max_slowdown times the champion's and LATENCY_FLOOR_MS a text slower (a fraction of a
                      millisecond is the machine's noise, not a slower model).
Shadow (the candidate answers every text, returns none; from the prediction log):
    agreement         the share of texts both answered alike, with its 95 % Wilson interval: refused when the
                      interval lies below min_agreement, unless the labels that came meanwhile show the candidate
                      better (a better model disagrees exactly where the champion is wrong)
    errors            texts the candidate failed on (its model's errors), at most max_error_rate of them
    labels            McNemar's exact test on the labelled texts both answered (monitor/ab.py `once`): refused when
                      the champion is better
Canary (a share of the traffic answered by the candidate): monitor/ab.py's sequential verdict (unpaired: each
text answered by one of them) on the labels since the ramp began; the champion better is harm: rolled back. And
limits, read from the server's /metrics at once (no labels needed): the candidate's error rate on its requests
at this share, and its recent p99 against the champion's (`limits`): a breach is rolled back too.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from typing import Any

from torchloom.monitor.ab import Outcomes, Tally, _normal_sf, _z, compare, mcnemar, once

MIN_TEXTS = 30
MIN_REQUESTS = 20  # the canary's error rate is judged from this many of the candidate's requests on
MIN_TIMED = 100  # and its p99 from this many requests of each in the last minute (over fewer, p99 is the maximum)
P99_FLOOR_S = 0.05  # a p99 this much above the champion's at least, beyond the ratio, is a breach
ROUNDS = 3
LATENCY_TEXTS = 256
LATENCY_FLOOR_MS = 1.0  # per text: slower by less than this is no slowdown (with the ratio: both must hold)


def paired(champion_right: list[bool], candidate_right: list[bool], margin: float, alpha: float) -> dict[str, Any]:
    """The non-inferiority test (module docstring) as a record: n, both accuracies, the difference, its lower
    bound, the p-value, passed."""
    n = len(champion_right)
    d = [int(b) - int(a) for a, b in zip(champion_right, candidate_right)]
    mean = sum(d) / n if n else 0.0
    var = sum((x - mean) ** 2 for x in d) / (n - 1) if n > 1 else 0.0
    se = math.sqrt(var / n) if n else 0.0
    if se > 0:
        p = _normal_sf((mean + margin) / se)
        low = mean - _z(alpha) * se
    else:
        p, low = (0.0 if mean > -margin else 1.0), mean
    return {"n": n, "champion": _share(champion_right), "candidate": _share(candidate_right), "difference": mean,
            "lower_bound": low, "margin": margin, "p_value": p, "passed": bool(n) and p < alpha}


def harmed_classes(labels: list[str], champion_right: list[bool], candidate_right: list[bool], margin: float,
                   alpha: float) -> list[dict[str, Any]]:
    """The classes whose recall the candidate lowers by more than `margin`, with evidence (module docstring)."""
    by: dict[str, list[tuple[bool, bool]]] = defaultdict(list)
    for y, a, b in zip(labels, champion_right, candidate_right):
        by[y].append((a, b))
    level = alpha / max(len(by), 1)
    harmed = []
    for label, pairs in sorted(by.items()):
        lost = sum(1 for a, b in pairs if a and not b)  # the champion right, the candidate wrong
        won = sum(1 for a, b in pairs if b and not a)
        drop = (lost - won) / len(pairs)
        p = mcnemar(lost, won) / 2 if lost > won else 1.0  # one-sided: the champion better
        if drop > margin and p < level:
            harmed.append({"label": label, "n": len(pairs), "recall_drop": drop, "p_value": p, "level": level})
    return harmed


def offline(champion_dir: str, candidate_dir: str, sets: dict[str, tuple[list[str], list[str]]], margin: float,
            class_margin: float, alpha: float, max_slowdown: float) -> dict[str, Any]:
    """The offline gate on each set of labelled texts, and the latency side by side: {passed, why, sets,
    latency}."""
    from torchloom.model.predict import Predictor

    models = {"champion": Predictor(champion_dir), "candidate": Predictor(candidate_dir)}
    out: dict[str, Any] = {"sets": {}, "why": []}
    for name, (texts, labels) in sets.items():
        answers = {k: [a["label"] for a in p.predict(texts)] if texts else [] for k, p in models.items()}
        right = {k: [a == y for a, y in zip(v, labels)] for k, v in answers.items()}
        record = paired(right["champion"], right["candidate"], margin, alpha)
        record["harmed_classes"] = harmed_classes(labels, right["champion"], right["candidate"], class_margin, alpha)
        record["gated"] = len(texts) >= MIN_TEXTS
        out["sets"][name] = record
        if record["gated"] and not record["passed"]:
            out["why"].append(f"{name}: accuracy {record['candidate']:.3f} against the champion's"
                              f" {record['champion']:.3f} (n {record['n']}; lower bound of the difference"
                              f" {record['lower_bound']:+.3f}, not above -{margin:g}; p = {record['p_value']:.2g})")
        if record["gated"] and record["harmed_classes"]:
            out["why"].append(f"{name}: class {', '.join(c['label'] for c in record['harmed_classes'])} worse by more"
                              f" than {class_margin:g} in recall")
    sample = next((texts for texts, _ in sets.values() if texts), [])[:LATENCY_TEXTS]
    out["latency"] = latency(models, sample)
    if too_slow(out["latency"], max_slowdown):
        took = out["latency"]
        out["why"].append(f"latency: {took['ratio']:.2f} times the champion's, {took['candidate_ms']:.1f} ms a text"
                          f" (at most {max_slowdown:g} times, or {LATENCY_FLOOR_MS:g} ms slower)")
    out["passed"] = not out["why"]
    return out


def too_slow(latency: dict[str, float], max_slowdown: float) -> bool:
    """Over max_slowdown times the champion's time a text, and LATENCY_FLOOR_MS slower at least."""
    return latency["ratio"] > max_slowdown and latency["candidate_ms"] - latency["champion_ms"] > LATENCY_FLOOR_MS


def latency(models: dict[str, Any], texts: list[str]) -> dict[str, float]:
    """Seconds per text of each model on the same texts, alternately, best of ROUNDS; the candidate's over the
    champion's."""
    best = {k: math.inf for k in models}
    if not texts:
        return {"champion_ms": 0.0, "candidate_ms": 0.0, "ratio": 1.0, "texts": 0}
    for _ in range(ROUNDS):
        for k, p in models.items():
            started = time.perf_counter()
            p.predict(texts)
            best[k] = min(best[k], (time.perf_counter() - started) / len(texts))
    return {"champion_ms": best["champion"] * 1e3, "candidate_ms": best["candidate"] * 1e3,
            "ratio": best["candidate"] / max(best["champion"], 1e-12), "texts": len(texts)}


def agreement(log, champion: str, candidate: str, since: float) -> dict[str, Any]:
    """How often the candidate, as a shadow since `since`, answered as the champion did: n, agreed, interval."""
    rows = log.read("SELECT COUNT(*), SUM(CASE WHEN s.answer = a.answer THEN 1 ELSE 0 END) FROM tl_predictions s"
                    " JOIN tl_predictions a ON a.fleet = s.fleet AND a.id = s.id AND a.model = ? AND a.role = 'answer'"
                    " WHERE s.fleet = ? AND s.model = ? AND s.role = 'shadow' AND s.at >= ?",
                    (champion, log.fleet, candidate, since))
    n, agreed = int(rows[0][0] or 0), int(rows[0][1] or 0)
    return {"n": n, "agreed": agreed, "interval": Tally(n, agreed).interval()}


def outcomes(log, champion: str, candidate: str, since: float) -> Outcomes:
    """Per label since `since`: whether each model's answer (as the one that answered, or as a shadow) was right."""
    found = Outcomes()
    for item in log.labelled(0, None, since):
        a, b = item.answers.get(champion), item.answers.get(candidate)
        found.add(None if a is None else a[2] == item.label, None if b is None else b[2] == item.label)
    return found


def shadow(log, champion: str, candidate: str, since: float, errors: float, min_agreement: float,
           max_error_rate: float, alpha: float) -> dict[str, Any]:
    """The shadow gate (module docstring): {passed, why, agreement, errors, labels}."""
    agree = agreement(log, champion, candidate, since)
    verdict = once(outcomes(log, champion, candidate, since), alpha)
    why = []
    better = verdict.state == "b_better"
    if verdict.state == "a_better":
        why.append(f"labels: {verdict.line(('the champion', 'the candidate'))}")
    interval = agree["interval"]
    if interval and interval["high"] < min_agreement and not better:
        why.append(f"agreement: {interval['value']:.3f} (95 % interval {interval['low']:.3f} to {interval['high']:.3f},"
                   f" n {agree['n']}) below {min_agreement:g}")
    total = agree["n"] + errors
    if total and errors / total > max_error_rate:
        why.append(f"errors: the candidate failed on {errors:g} of {total:g} texts (at most {max_error_rate:g})")
    return {"passed": not why, "why": why, "agreement": agree, "errors": errors,
            "labels": {"state": verdict.state, "n": verdict.labels, "p_value": verdict.p_value,
                       "line": verdict.line(("champion", "candidate"))}}


def canary(log, champion: str, candidate: str, since: float, step_since: float, n_min: int, alpha: float,
           min_effect: float) -> dict[str, Any]:
    """The canary's sequential verdict since the ramp began, and the candidate's labels in this step."""
    seen = outcomes(log, champion, candidate, since)
    step = outcomes(log, champion, candidate, step_since)
    verdict = compare(seen, alpha, n_min, min_effect)
    return {"state": verdict.state, "harm": verdict.state == "a_better", "test": verdict.test,
            "labels": verdict.labels, "p_value": verdict.p_value, "level": verdict.level,
            "line": verdict.line(("champion", "candidate")),
            "candidate_labels_this_step": sum(1 for x in step.b if x is not None)}


def limits(before: dict[str, float], now: dict[str, float], max_error_rate: float, max_p99_ratio: float
           ) -> dict[str, Any]:
    """The canary's limits on the candidate (loop/server.py model_numbers, at the share's start and now): its error
    rate on the requests since (MIN_REQUESTS at least), and its recent p99 against the champion's (both over
    MIN_TIMED requests, and P99_FLOOR_S apart at least: a few milliseconds' jitter is no breach)."""
    if now["requests"] < before.get("requests", 0):  # the server restarted: its counters began again
        before = {}
    n = now["requests"] - before.get("requests", 0)
    failed = now["failed"] - before.get("failed", 0)
    why = []
    if n >= MIN_REQUESTS and failed / n > max_error_rate:
        why.append(f"error rate {failed / n:.3f} on {n:g} requests (at most {max_error_rate:g})")
    cand, champ = now["candidate_p99"], now["champion_p99"]
    if (min(now["candidate_count"], now["champion_count"]) >= MIN_TIMED and cand > max_p99_ratio * champ
            and cand - champ > P99_FLOOR_S):
        why.append(f"p99 {cand * 1e3:.0f} ms against the champion's {champ * 1e3:.0f} ms (at most {max_p99_ratio:g}"
                   " times)")
    return {"breached": bool(why), "why": why, "requests": n, "failed": failed, "candidate_p99": cand,
            "champion_p99": champ}


def _share(right: list[bool]) -> float:
    return sum(right) / len(right) if right else 0.0
