"""A real S3 server for the tests that use an object store."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time

import pytest

from support.env import restore
from support.net import free_port


@contextlib.contextmanager
def s3_server(log_dir, bucket: str, credentials: dict, front=None):
    """A real S3 server (moto's, over HTTP on 127.0.0.1) with one bucket, for the storage tests. This process
    and its children reach it through AWS_ENDPOINT_URL, as a user's S3-compatible store: at the server's port,
    or at `front(port)`'s (a proxy in front of it). Yields the port clients use; the environment is restored."""
    from torchloom.store import storage

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
    client_port = front(port) if front else port
    saved = {k: os.environ.get(k) for k in [*credentials, "AWS_ENDPOINT_URL"]}
    os.environ.update({**credentials, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{client_port}"})
    storage._filesystem.cache_clear()
    from pyarrow import fs as pafs

    pafs.S3FileSystem(endpoint_override=f"http://127.0.0.1:{port}", scheme="http", allow_bucket_creation=True,
                      region="us-east-1").create_dir(bucket)
    try:
        yield client_port
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        restore(saved)
        storage._filesystem.cache_clear()
