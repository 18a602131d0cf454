"""A real S3 server for the tests that use an object store."""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
import subprocess
import sys
import time

import pytest

from support.env import restore
from support.net import free_port

_SERVER: dict = {}  # this process's moto server: {"proc", "port"}; one per xdist worker, stopped when it exits


def shared_server(log_dir) -> int:
    """The port of this process's S3 server (moto's, over HTTP on 127.0.0.1), started on first use: a module does
    not wait for a server of its own (about 2 s each); each user empties its bucket (s3_server)."""
    proc = _SERVER.get("proc")
    if proc is not None and proc.poll() is None:
        return _SERVER["port"]
    port = free_port()
    log = open(os.path.join(log_dir, "s3-server.log"), "w")
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if time.time() > deadline:
                proc.kill()
                pytest.fail("the moto S3 server did not start")
            time.sleep(0.2)
    _SERVER.update(proc=proc, port=port)
    atexit.register(_stop, proc)
    return port


def _stop(proc) -> None:
    proc.terminate()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def fresh_bucket(port: int, bucket: str) -> None:
    """`bucket` on the server, empty (made, or emptied of what an earlier module left there)."""
    from pyarrow import fs as pafs

    s3 = pafs.S3FileSystem(endpoint_override=f"http://127.0.0.1:{port}", scheme="http", allow_bucket_creation=True,
                           region="us-east-1", access_key="testing", secret_key="testing")
    if s3.get_file_info(bucket).type == pafs.FileType.NotFound:
        s3.create_dir(bucket)
    else:
        s3.delete_dir_contents(bucket, missing_dir_ok=True)


@contextlib.contextmanager
def s3_server(log_dir, bucket: str, credentials: dict, front=None):
    """A real S3 server (this process's moto server, shared_server) with one empty bucket, for the tests that
    use an object store. This process and its children reach it through AWS_ENDPOINT_URL, as a user's
    S3-compatible store: at the server's port, or at `front(port)`'s (a proxy in front of it). Yields the port
    clients use; the environment is restored."""
    from torchloom.store import storage

    port = shared_server(log_dir)
    fresh_bucket(port, bucket)
    client_port = front(port) if front else port
    saved = {k: os.environ.get(k) for k in [*credentials, "AWS_ENDPOINT_URL"]}
    os.environ.update({**credentials, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{client_port}"})
    storage._filesystem.cache_clear()
    try:
        yield client_port
    finally:
        restore(saved)
        storage._filesystem.cache_clear()
