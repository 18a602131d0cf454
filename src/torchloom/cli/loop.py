"""`torchloom loop`: the controller that retrains, gates, shadows, ramps and promotes or rolls back a served fleet's
model (torchloom.loop; docs/serving.md, "The loop"). `torchloom loop --url URL --log LOG --work DIR` runs until
stopped (`--once`: one step); `torchloom loop history` prints the fleet's events; `torchloom loop resume` lets a
paused loop go on. The admin key comes from an environment variable (--admin-key-env), never the command line."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from torchloom.errors import UserError

ACTIONS = ("run", "history", "resume")


def add_loop_arguments(sp: argparse.ArgumentParser) -> None:
    from torchloom.loop.controller import LoopSettings

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
    g.add_argument("--max-error-rate", type=float, default=d.max_error_rate, help="the shadow's errors (0.01)")
    g.add_argument("--ramp", default=",".join(f"{x:g}" for x in d.ramp), help="the canary's shares in percent;"
                                                                               " promoted after the last (5,25,50)")
    g.add_argument("--canary-labels", type=int, default=d.canary_labels, help="labels on the candidate's answers"
                                                                              " at each share (200)")
    g.add_argument("--min-effect", type=float, default=d.min_effect, help="the accuracy difference the canary"
                                                                          " looks for (0.02)")
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


def settings_of(args):
    from torchloom.loop.controller import LoopSettings

    for flag, value in (("--url", args.url), ("--work", args.work)):
        if not value:
            raise UserError(f"loop: {flag} is missing; e.g. torchloom loop --url http://127.0.0.1:8000 --log"
                            " serve.db --fleet NAME --work loop/")
    for flag, value, low, high in (("--holdout", args.holdout, 0.0, 0.9), ("--alpha", args.alpha, 1e-6, 0.5),
                                   ("--margin", args.margin, 0.0, 1.0), ("--min-agreement", args.min_agreement, 0, 1)):
        if not low <= value <= high:
            raise UserError(f"loop: {flag} {value:g} is not between {low:g} and {high:g}")
    triggers = {"labels": args.on_labels, "drift": args.on_drift, "accuracy": args.on_accuracy_below,
                "schedule": args.every_hours, "alert": 1.0 if args.webhook_port else 0.0}
    return LoopSettings(server=args.url, work=Path(args.work).resolve(), recipe=args.recipe, triggers=triggers,
                        cooldown_s=args.cooldown_hours * 3600, daily_limit=args.daily_limit, holdout=args.holdout,
                        margin=args.margin, class_margin=args.class_margin, alpha=args.alpha,
                        max_slowdown=args.max_slowdown, shadow_texts=args.shadow_texts,
                        min_agreement=args.min_agreement, max_error_rate=args.max_error_rate, ramp=_ramp(args.ramp),
                        canary_labels=args.canary_labels, min_effect=args.min_effect)


def open_log(args):
    from torchloom.monitor.predlog import PredictionLog, log_uri

    given = args.log if args.log is not None else os.environ.get("TORCHLOOM_LOG", "")
    uri = log_uri(given) if given else None
    if uri is None:
        raise UserError("loop: --log is missing; give the server's prediction log (its --log), e.g. --log serve.db")
    return PredictionLog(uri, args.fleet)


def cmd_loop(args: argparse.Namespace, rest: list[str]) -> int:
    if rest:
        raise UserError(f"loop: unknown arguments {' '.join(rest)}; see torchloom loop --help")
    settings = settings_of(args) if args.action == "run" else None
    log = open_log(args)
    try:
        if args.action == "history":
            from torchloom.loop import history

            events = log.events()
            print(history.json_lines(events) if args.json else history.table(events))
            return 0
        if args.action == "resume":
            return _resume(log, args.who or os.environ.get("USER") or "a person")
        return _run(args, settings, log)
    finally:
        log.close()


def _resume(log, who: str) -> int:
    from torchloom.loop.controller import state_of

    stage, cycle = state_of(log.events())
    if stage != "paused":
        print(f"loop resume: the loop of fleet {log.fleet} is not paused (it is {stage}); nothing to do")
        return 0
    log.event("resumed", who, stage="idle", line=f"{who} lets the loop go on (cycle {cycle.get('cycle')} ended)")
    print(f"loop resume: the loop of fleet {log.fleet} goes on from its next trigger")
    return 0


def _run(args, settings, log) -> int:
    from torchloom.loop.controller import Loop, run
    from torchloom.loop.server import Server

    server = Server(settings.server, admin_key_env=args.admin_key_env)
    loop = Loop(settings, log, server, say=lambda line: print(line, flush=True))
    stopping = {"now": False}

    def stop(signum, frame) -> None:
        stopping["now"] = True
        from torchloom.loop import candidate

        if candidate.RUNNING:
            raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop) if not args.once else None
    hook = None
    if args.webhook_port and not args.once:
        from torchloom.loop.webhook import listen

        hook = listen(log, args.webhook_host, args.webhook_port)
        print(f"loop: Alertmanager webhook on http://{args.webhook_host}:{hook.server_address[1]}/", flush=True)
    try:
        if args.once:
            moved, line = loop.step()
            print(f"loop: {line}", flush=True)
            return 0
        return run(loop, args.poll_s, lambda: stopping["now"])
    finally:
        if hook is not None:
            hook.shutdown()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        sys.stdout.flush()
