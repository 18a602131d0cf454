"""The torchrun engine: one worker, for launchers torchloom does not drive itself (torchrun on each node).

    torchrun --nnodes N --nproc-per-node 8 ... -m torchloom.engines.torchrun --output.dir RUN [--config F] [--k v ...]

The same config options as `torchloom train`; the run directory must hold prepared data and be on
storage every node sees. A restart by torchrun (--max-restarts) resumes from the latest checkpoint.
Across nodes, export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 on each: with torch's shared rendezvous
store (its default), a node that joins after a restart waits forever for the master address, and
the nodes' restart counts (which key the store) can differ.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys

from torchloom.config import build, to_dict
from torchloom.engines.common import NotRestarted, Preempted, RestartLimit, is_peer_loss
from torchloom.engines.worker import run_worker, worker_env
from torchloom.errors import UserError, first_line, one_line
from torchloom.runs.rundir import RunDir
from torchloom.runs.runfiles import RunFiles

# A file the launcher's wrapper names (k8s/job.py's pod script): made when this node's ranks end preempted, so
# that a torchrun which then fails (the rendezvous went with a preempted pod 0) is told apart from a failure.
PREEMPTED_MARKER_ENV = "TORCHLOOM_PREEMPTED_MARKER"
PREEMPTED_MARK = "torchloom: preempted"  # the file's content: only a file that says it is deleted or counted


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    config_file = None
    if "--config" in argv:
        i = argv.index("--config")
        config_file = argv[i + 1] if i + 1 < len(argv) else None
        del argv[i:i + 2]
    os.environ.update(worker_env())  # this process is the worker: torchrun started it with the user's environment
    try:
        cfg = build(config_file, argv)
    except UserError as e:
        print(f"torchloom: error: {one_line(e)}", file=sys.stderr)
        return 2
    warning = rendezvous_warning(os.environ)
    if warning:
        print(f"torchloom: warning: {warning}", file=sys.stderr, flush=True)
    # torchrun gives every launch a run id (TORCHELASTIC_RUN_ID); restarts keep it.
    launch_id = os.environ.get("TORCHELASTIC_RUN_ID", "torchrun")
    marker = os.environ.get(PREEMPTED_MARKER_ENV)
    if marker:  # this attempt's outcome, not an earlier one's
        clear_mark(marker)
    try:
        result = _train(cfg, launch_id)
        if result.preemptions:
            # Not done: exit 75 so that torchrun starts the workers again, with the hosts that are left or
            # a replacement, and they go on from this step's checkpoint (torchrun counts it in its own
            # --max-restarts; engine.max_restarts does not count it).
            p = result.preemptions[-1]
            if os.environ.get("RANK", "0") == "0":
                print(f"torchloom: train: preempted at step {p['step']} (notice: {p['notice']}); torchrun starts"
                      " the workers again if its --max-restarts allows, else run again with --train.resume latest",
                      file=sys.stderr, flush=True)
            if marker:  # for the launcher's wrapper: this node's ranks ended preempted (a peer's notice, or its own)
                with contextlib.suppress(FileExistsError), open(marker, "x", encoding="utf-8") as f:
                    f.write(PREEMPTED_MARK)
            return Preempted.exit_code
    except UserError as e:  # one line, not a traceback; torchrun reports the exit code
        print(f"torchloom: error: {one_line(e)}", file=sys.stderr, flush=True)
        return 2
    except (NotRestarted, RestartLimit) as e:  # the restarted worker's refusal: the cause was told before
        print(f"torchloom: rank {os.environ.get('RANK', '0')}: {one_line(e)}", file=sys.stderr, flush=True)
        return 1
    except Exception as e:
        if not is_peer_loss(str(e)):
            raise
        # A consequence, not a cause: the rank that went away is named at the restart.
        print(f"torchloom: rank {os.environ.get('RANK', '0')} on host {socket.gethostname()}: a peer stopped"
              f" answering ({first_line(e)}); torchrun restarts the workers if --max-restarts allows", file=sys.stderr,
              flush=True)
        return 1
    return 0


def _train(cfg, launch_id: str):
    """This rank's training; rank 0 records what the training writes in the run's ledger (runs/ledger.py), as
    `torchloom train` does, so that a later --overwrite knows the checkpoints as torchloom's (a fresh start over an
    earlier training's checkpoints is refused in run_worker, as on every engine)."""
    files = RunFiles(RunDir(cfg.output.dir))
    recording = files.place.recording() if os.environ.get("RANK", "0") == "0" else contextlib.nullcontext()
    with recording:
        return run_worker(to_dict(cfg), files.rd.location, launch_id)


def clear_mark(marker: str) -> None:
    """An earlier attempt's mark deleted; a file there that is not torchloom's mark is left as it is."""
    ours = False
    with contextlib.suppress(OSError), open(marker, encoding="utf-8", errors="replace") as f:
        ours = f.read() == PREEMPTED_MARK
    if ours:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(marker)


def rendezvous_warning(env) -> str:
    """What rank 0 warns of at a multi-node launch that could restart but whose nodes could not rejoin."""
    if env.get("RANK", "0") != "0" or env.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return ""
    nodes = int(env.get("GROUP_WORLD_SIZE", "1") or 1)
    restarts = int(env.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    shared = env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    if nodes < 2 or restarts < 1 or not shared or env.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") == "1":
        return ""
    return ("with torch's shared rendezvous store, a restart after a node failed can hang (a node that joins"
            " waits forever for the master address, and restart counts differ between nodes);"
            " export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 on every node")


if __name__ == "__main__":
    raise SystemExit(main())
