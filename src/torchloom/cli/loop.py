"""`torchloom loop`: the controller that retrains, gates, shadows, ramps and promotes or rolls back a served fleet's
model (torchloom.loop; docs/serving.md, "The loop"). `torchloom loop --url URL --log LOG --work DIR` runs until
stopped (`--once`: one step); `torchloom loop history` prints the fleet's events; `torchloom loop resume` lets a
paused loop go on. The admin key comes from an environment variable (--admin-key-env), never the command line."""

from __future__ import annotations

import argparse
import os
import signal
import sys

from torchloom.errors import UserError
from torchloom.loop.arguments import settings_of


def open_log(args):
    from torchloom.monitor.predlog import PredictionLog, log_uri

    given = args.log if args.log is not None else os.environ.get("TORCHLOOM_LOG", "")
    uri = log_uri(given) if given else None
    if uri is None:
        raise UserError("loop: --log is missing; give the server's prediction log (its --log), e.g. --log serve.db")
    if uri.startswith("sqlite:///"):  # the server makes the log: a file that is not there is a wrong path
        from pathlib import Path

        path = Path(uri[len("sqlite:///"):])
        if not path.is_file():
            raise UserError(f"loop: --log {given}: no such file; give the file the server writes (its --log), or"
                            " start torchloom serve --log first")
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

    from torchloom.loop.lease import LoopLease

    lease = LoopLease(log, settings.who, loop.say)  # one loop per fleet (loop/lease.py)
    lease.take(wait=not args.once)
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
        return run(loop, args.poll_s, lambda: stopping["now"] or lease.lost)
    finally:
        lease.release()
        if hook is not None:
            hook.shutdown()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        sys.stdout.flush()
