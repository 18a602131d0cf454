"""Notices of preemption on Ray (train/preemption.py has the protocol): SIGTERM to a Ray Train worker, and
Ray draining the worker's node (`ray drain-node`, or an autoscaler taking back a spot node).

Ray Train runs the training function in a thread of the worker actor, where no signal handler can be set,
and Ray's task loop sets its own SIGTERM handler (exit at once). So the workers start with a setup hook
(Ray's worker-process setup hook, run on the main thread before the task loop) that arms torchloom's
SIGTERM watch and keeps Ray's handler from replacing it. This module is imported by that hook: nothing
heavy at import.
"""

from __future__ import annotations

import socket
import threading
import time

# Ray's own variable for a worker-process setup hook given as "module.function" (what
# runtime_env={"worker_process_setup_hook": ...} sets for a job).
SETUP_HOOK_ENV = "__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR"
DRAIN_POLL_S = 2.0  # how often one worker per node asks the GCS whether its node is being drained


def setup_hook_env() -> dict[str, str]:
    """The workers' environment entry that runs `arm` at each worker process's start."""
    return {SETUP_HOOK_ENV: f"{__name__}.arm"}


def arm() -> None:
    """Ray's setup hook, on the worker's main thread: SIGTERM becomes a notice, and Ray's task loop does
    not replace the handler with its own (which exits at once, losing the steps since the last checkpoint)."""
    from torchloom.train import preemption

    if not preemption.arm_sigterm():
        return
    try:
        import ray._private.utils as ray_utils
    except ImportError:
        return
    ray_utils.set_sigterm_handler = _keep_ours


def _keep_ours(handler) -> None:
    """Ray's task loop asks to set its SIGTERM handler: torchloom's watch stays (it ends the process
    itself, after the checkpoint or the grace period)."""


def draining_nodes() -> dict[str, int]:
    """The nodes Ray is draining, {node id hex: deadline in ms (0: none)}; {} where Ray cannot say."""
    try:
        import ray._private.state

        return dict(ray._private.state.state.get_draining_nodes())
    except Exception:
        return {}


def watch_drain(every_s: float = DRAIN_POLL_S) -> None:
    """A thread that gives the notice when Ray drains this worker's node (a preempted spot node, `ray
    drain-node`). One worker per node is enough: the flag reaches every rank at the next step boundary."""
    import ray

    from torchloom.train import preemption

    node = ray.get_runtime_context().get_node_id()

    def poll() -> None:
        while not preemption.NOTICE.given:
            deadline_ms = draining_nodes().get(node)
            if deadline_ms is not None:
                left = max(0.0, deadline_ms / 1000 - time.time())
                left = f", {left:.0f} s before its deadline" if deadline_ms else ""
                preemption.NOTICE.give(f"Ray drains node {node[:8]} on host {socket.gethostname()}{left}")
                return
            time.sleep(every_s)

    threading.Thread(target=poll, name="torchloom-ray-drain", daemon=True).start()
