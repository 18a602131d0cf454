"""A Ray instance torchloom starts for itself (training, tune, `serve --serve-with ray`): its GCS, raylet and
workers listen on 127.0.0.1 only, and Ray's token authentication stays on with a random token of this
process's, held in its environment (which the instance's processes inherit), so nothing is written to
~/.ray and nobody else on the network can submit work to it."""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
from pathlib import Path

from torchloom.errors import UserError, first_line


def start_local_ray(temp_dir: str | Path, num_cpus: int, env_vars: dict[str, str], env: dict[str, str] | None = None,
                    fix: str = "retry when it has room, or set engine.ray_address to a running cluster",
                    **init_args) -> None:
    """ray.init of a new local instance: loopback only, token auth. `env` is set in this process only while
    the instance starts (its processes inherit it); `env_vars` reach every task and actor. An instance that
    does not start is a UserError whose line ends with `fix`."""
    import ray

    if "RAY_AUTH_MODE" not in os.environ and "RAY_AUTH_TOKEN" not in os.environ:
        # Ray turns token authentication on for a new local instance (and refreshes the mode it read at
        # import); with a token in the environment it writes none to ~/.ray. A RAY_AUTH_MODE of the
        # user's is theirs to keep.
        os.environ["RAY_AUTH_TOKEN"] = process_token()
    # Ray announces the token authentication torchloom asked for ("enabled ... set RAY_AUTH_MODE=disabled
    # to opt out"): not about the user's job. Its warning when authentication is off stays.
    logging.getLogger("ray._private.authentication.authentication_token_setup").addFilter(
        lambda record: not record.getMessage().startswith("Token authentication is enabled"))
    # The instance's own processes are told its address. Ray's State API, called with no address inside a task or
    # actor, otherwise looks for "the" instance on the machine, and with any other Ray running there it fails:
    # Ray Train's placement group cleaner then dies, and a Tune trial stopped by ASHA leaves its workers' CPUs
    # reserved, so the next trial waits for them forever (seen with Ray 2.60 beside a second instance).
    port = free_loopback_port()
    env = {**(env or {}), **LOOPBACK_ONLY, "RAY_GCS_SERVER_PORT": str(port)}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        with loopback_node():
            ray.init(num_cpus=num_cpus, _temp_dir=str(temp_dir), logging_level=logging.WARNING,
                     runtime_env={"env_vars": {**env_vars, "RAY_ADDRESS": f"127.0.0.1:{port}"}}, **init_args)
    except Exception as e:
        # Ray's own start-up failures (a raylet not registered within 30 s on a loaded machine, a temp dir it
        # cannot write) are its tracebacks: one line instead, and none of the half-started instance left.
        with contextlib.suppress(Exception):
            ray.shutdown()
        raise UserError(f"ray: the local Ray instance in {temp_dir} did not start ({first_line(e)}); this host may"
                        f" be short of CPU, memory or disk: {fix}") from None
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_TOKEN: list[str] = []


def process_token() -> str:
    """One token per process: Ray keeps the first token it loads for the life of the process."""
    if not _TOKEN:
        _TOKEN.append(secrets.token_hex(32))
    return _TOKEN[0]


# Ray replaces a node IP of 127.0.0.1 by the machine's routable address, and then its GCS, raylet and
# workers listen on every interface, unless clusters are off, as Ray has them on macOS and Windows:
# then the node is 127.0.0.1 and every server binds loopback (seen with Ray 2.60: docs/benchmarks.md).
LOOPBACK_ONLY = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


@contextlib.contextmanager
def loopback_node():
    """This process's Ray, for the start of a local instance: no cluster, so the node is 127.0.0.1.
    Ray reads the switch at import, so the already imported flag is set too, and restored after."""
    try:
        from ray._private import ray_constants
    except ImportError:  # another Ray layout: the environment variable alone (read by the new processes)
        yield
        return
    before = getattr(ray_constants, "ENABLE_RAY_CLUSTER", None)
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        if before is not None:
            ray_constants.ENABLE_RAY_CLUSTER = before
