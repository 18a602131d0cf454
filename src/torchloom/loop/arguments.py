"""`torchloom loop`'s flags and settings (standard library only: `torchloom k8s loop` checks the flags it passes on
with this parser, loading nothing else)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

from torchloom.errors import UserError


@dataclass
class LoopSettings:
    server: str
    work: Path
    recipe: str = ""
    triggers: dict[str, float] = field(default_factory=lambda: {"labels": 500.0})
    cooldown_s: float = 6 * 3600.0
    daily_limit: int = 4
    holdout: float = 0.2
    margin: float = 0.02
    class_margin: float = 0.05
    alpha: float = 0.05
    max_slowdown: float = 1.5
    shadow_texts: int = 500
    min_agreement: float = 0.5
    max_error_rate: float = 0.01
    max_p99_ratio: float = 2.0
    ramp: list[float] = field(default_factory=lambda: [5.0, 25.0, 50.0])
    canary_labels: int = 200
    min_effect: float = 0.02
    watch_s: float = 3600.0  # after promotion, the new champion's limits watched this long (0: not watched)
    who: str = "torchloom loop"
    train_on: str = "here"  # or "k8s": the candidate's training as an Indexed Job (loop/candidate_job.py)
    store: str = ""  # with train_on k8s: where the candidates' runs go (every pod reads and writes it)


ACTIONS = ("run", "history", "resume")


def add_loop_arguments(sp: argparse.ArgumentParser) -> None:
    d = LoopSettings(server="", work=Path())
    sp.add_argument("action", nargs="?", default="run", choices=ACTIONS,
                    help="run (the default: watch and act), history (the events), resume (after a pause)")
    sp.add_argument("--url", help="the server, e.g. http://127.0.0.1:8000 (run)")
    sp.add_argument("--log", default=None, help="the server's prediction log (its --log: a SQLite file or"
                                                " postgresql://...; default $TORCHLOOM_LOG)")
    sp.add_argument("--fleet", required=True, help="the fleet's name in the log (the server's --fleet-name)")
    sp.add_argument("--work", help="where snapshots and candidates' runs go (run)")
    sp.add_argument("--recipe", default="", help="the champion's run directory (default: the one its model was"
                                                 " exported into)")
    sp.add_argument("--train-on", choices=("here", "k8s"), default="here",
                    help="where the candidate trains: here (a child process, the recipe's engine) or k8s (the"
                         " Indexed Job `torchloom k8s train` writes, created from the loop's pod; needs --store)")
    sp.add_argument("--store", default="", help="with --train-on k8s: the store prefix the candidates' runs go"
                                                " to, e.g. s3://bucket/loop (the Job's pods read and write it)")
    t = sp.add_argument_group("triggers (0: off)")
    t.add_argument("--on-labels", type=int, default=500, help="retrain after this many new labels (default 500)")
    t.add_argument("--on-drift", type=int, default=1000, help="retrain when the champion's traffic drifted, over at"
                                                              " least this many texts (default 1000)")
    t.add_argument("--on-accuracy-below", type=float, default=0.0, help="retrain when the estimated accuracy is"
                                                                       " under this (default off)")
    t.add_argument("--every-hours", type=float, default=0.0, help="retrain on a schedule (default off)")
    t.add_argument("--webhook-port", type=int, default=0, help="listen for Alertmanager's webhook here (default"
                                                               " off); --webhook-host 127.0.0.1")
    t.add_argument("--webhook-host", default="127.0.0.1")
    t.add_argument("--cooldown-hours", type=float, default=d.cooldown_s / 3600, help="after a trigger fires"
                                                                                     " (default 6)")
    t.add_argument("--daily-limit", type=int, default=d.daily_limit, help="firings per trigger a day (default 4)")
    g = sp.add_argument_group("gates")
    g.add_argument("--holdout", type=float, default=d.holdout, help="the newest labels' share held out of training"
                                                                    " for the gate (default 0.2)")
    g.add_argument("--margin", type=float, default=d.margin, help="non-inferiority margin in accuracy (0.02)")
    g.add_argument("--class-margin", type=float, default=d.class_margin, help="a class's recall may drop at most"
                                                                              " this (0.05)")
    g.add_argument("--alpha", type=float, default=d.alpha, help="each test's level (0.05)")
    g.add_argument("--max-slowdown", type=float, default=d.max_slowdown, help="candidate's latency over the"
                                                                              " champion's at most (1.5)")
    g.add_argument("--shadow-texts", type=int, default=d.shadow_texts, help="texts the shadow answers first (500)")
    g.add_argument("--min-agreement", type=float, default=d.min_agreement, help="the shadow's agreement (0.5)")
    g.add_argument("--max-error-rate", type=float, default=d.max_error_rate, help="the shadow's and the canary's"
                   " errors (0.01)")
    g.add_argument("--max-p99-ratio", type=float, default=d.max_p99_ratio, help="the canary rolls back when the"
                   " candidate's recent p99 is over this times the champion's (2.0)")
    g.add_argument("--ramp", default=",".join(f"{x:g}" for x in d.ramp), help="the canary's shares in percent;"
                                                                               " promoted after the last (5,25,50)")
    g.add_argument("--canary-labels", type=int, default=d.canary_labels, help="labels on the candidate's answers"
                                                                              " at each share (200)")
    g.add_argument("--min-effect", type=float, default=d.min_effect, help="the accuracy difference the canary"
                                                                          " looks for (0.02)")
    g.add_argument("--watch-hours", type=float, default=d.watch_s / 3600, help="after promotion, roll back when the"
                   " new champion's error rate or p99 breaks the canary's limits within this long (1; 0: off)")
    sp.add_argument("--poll-s", type=float, default=30.0, help="seconds between looks while waiting (30)")
    sp.add_argument("--once", action="store_true", help="one step, then exit")
    sp.add_argument("--json", action="store_true", help="history: JSON lines")
    sp.add_argument("--who", default="", help="resume: who says go on (default $USER)")
    sp.add_argument("--admin-key-env", default="TORCHLOOM_ADMIN_KEY", metavar="NAME",
                    help="the environment variable holding the server's admin key (default TORCHLOOM_ADMIN_KEY)")


def _ramp(given: str) -> list[float]:
    try:
        shares = [float(x) for x in given.split(",") if x.strip()]
    except ValueError:
        shares = []
    if not shares or any(not 0 < x < 100 for x in shares) or shares != sorted(shares):
        raise UserError(f"--ramp {given}: give rising shares in percent between 0 and 100, e.g. --ramp 5,25,50 (the"
                        " candidate is promoted after the last)")
    return shares


def settings_of(args) -> LoopSettings:
    for flag, value in (("--url", args.url), ("--work", args.work)):
        if not value:
            raise UserError(f"loop: {flag} is missing; e.g. torchloom loop --url http://127.0.0.1:8000 --log"
                            " serve.db --fleet NAME --work loop/")
    for flag, value, low, high in (("--holdout", args.holdout, 0.0, 0.9), ("--alpha", args.alpha, 1e-6, 0.5),
                                   ("--margin", args.margin, 0.0, 1.0), ("--min-agreement", args.min_agreement, 0, 1)):
        if not low <= value <= high:
            raise UserError(f"loop: {flag} {value:g} is not between {low:g} and {high:g}")
    check_where(args)
    triggers = {"labels": args.on_labels, "drift": args.on_drift, "accuracy": args.on_accuracy_below,
                "schedule": args.every_hours, "alert": 1.0 if args.webhook_port else 0.0}
    import socket

    return LoopSettings(who=f"torchloom loop@{socket.gethostname()}",
                        server=args.url, work=Path(args.work).resolve(), recipe=args.recipe, triggers=triggers,
                        cooldown_s=args.cooldown_hours * 3600, daily_limit=args.daily_limit, holdout=args.holdout,
                        margin=args.margin, class_margin=args.class_margin, alpha=args.alpha,
                        max_slowdown=args.max_slowdown, shadow_texts=args.shadow_texts,
                        min_agreement=args.min_agreement, max_error_rate=args.max_error_rate,
                        max_p99_ratio=args.max_p99_ratio, ramp=_ramp(args.ramp),
                        canary_labels=args.canary_labels, min_effect=args.min_effect, train_on=args.train_on,
                        watch_s=max(0.0, args.watch_hours) * 3600,
                        store=args.store.rstrip("/"))


def check_where(args) -> None:
    """--train-on k8s needs a store every pod reaches; a store without it is a flag that would do nothing."""
    from torchloom.uri import is_uri

    if args.train_on == "k8s" and not is_uri(args.store):
        raise UserError(f"--store {args.store or '(none)'}: --train-on k8s trains the candidate in pods that read"
                        " and write its run on a store; give one, e.g. --store s3://bucket/loop")
    if args.store and args.train_on != "k8s":
        raise UserError(f"--store {args.store}: only --train-on k8s puts the candidates' runs on a store; add"
                        " --train-on k8s or leave --store out")
