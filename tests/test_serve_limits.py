"""A bounded server, as a client sees it: the body limit enforced while reading (a 413 before the rest of an
oversized body is sent), memory that stays bounded under concurrent large bodies, slow clients (a slowloris,
slow bodies) dropped after the read timeout without holding the connection cap, a warning (or a refusal) when it
binds beyond loopback without an API key, and a client that disconnects while sending its body counted as such,
not answered 500.

The real server runs in a subprocess (test_serve's `Server`, on 127.0.0.1), clients are real sockets.
"""

from __future__ import annotations

import asyncio
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from urllib.parse import urlsplit

import pytest
from test_serve import ENV, Server, model_dir, needs_http, sample_value, wait_for  # noqa: F401 (model_dir: fixture)

from torchloom.serve.settings import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_CONNECTIONS, ServeSettings, is_loopback

# The server's environment without an API key, whatever the test runner's is.
NO_KEY_ENV = {k: v for k, v in ENV.items() if k != "TORCHLOOM_API_KEY"}
MB = 1_000_000


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):  # noqa: F811 (model_dir: test_serve's fixture)
    """The default limits (4 MB bodies, 128 connections), no API key, on 127.0.0.1."""
    s = Server(model_dir, "--device", "cpu", log_dir=tmp_path_factory.mktemp("limits"))
    yield s
    assert s.terminate() == 0, s.stderr()[-3000:]


def connect(server: Server) -> socket.socket:
    url = urlsplit(server.url)
    return socket.create_connection((url.hostname, url.port), timeout=30)


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """Status, headers (lower-case names) and body of one HTTP/1.1 response with a Content-Length."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the server closed the connection before answering: {data!r}"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    while len(body) < int(headers["content-length"]):
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection in the middle of its answer"
        body += chunk
    return int(lines[0].split()[1]), headers, body


def closed_by_server(sock: socket.socket) -> bool:
    """Whether the server closed the connection (EOF or reset) within the socket's timeout."""
    try:
        return sock.recv(65536) == b""
    except ConnectionResetError:
        return True


def requests_counted(server: Server, status: str) -> float:
    return sample_value(server.metrics(), "torchloom_requests", "torchloom_requests_total", endpoint="/v1/predict",
                        status=status)


def disconnects(server: Server, stage: str) -> float:
    return sample_value(server.metrics(), "torchloom_client_disconnects", "torchloom_client_disconnects_total",
                        stage=stage)


# ---------------------------------------------------------------------------------------------
# the body limit, enforced while reading
# ---------------------------------------------------------------------------------------------


@needs_http
def test_an_oversized_body_gets_413_before_the_rest_is_sent_and_the_connection_closes(server):
    """Content-Length 50 MB, and only its first 1 kB sent: the 413 comes back at once, and the server closes
    the connection, so the other 49.99 MB are never read."""
    before = requests_counted(server, "413")
    with connect(server) as sock:
        sock.sendall(b"POST /v1/predict HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {50 * MB}\r\n\r\n".encode() + b'{"texts": ["' + b"x" * 1000)
        status, headers, body = read_response(sock)
        assert status == 413, body
        error = json.loads(body)["error"]  # the native API's error shape
        assert error["code"] == "body_too_large", error
        assert f"{50 * MB} bytes" in error["message"] and f"the {DEFAULT_MAX_BODY_BYTES} bytes allowed" in error[
            "message"] and "send fewer or shorter texts" in error["message"], error
        assert headers["connection"] == "close"
        assert closed_by_server(sock)  # nothing more is read: the client could not send the rest
    assert requests_counted(server, "413") == before + 1


@needs_http
def test_a_chunked_body_is_cut_off_once_it_passes_the_limit(server):
    """No Content-Length: the server reads until the body passes the limit, then answers 413 and stops. The
    client offers 50 MB in 64 kB chunks; the answer comes after about the limit, not after the 50 MB."""
    chunk = b"y" * 65536
    frame = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
    sent = 0
    with connect(server) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 65536)  # what the client's kernel holds back: little
        sock.sendall(b"POST /v1/predict HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        while sent < 50 * MB and not select.select([sock], [], [], 0)[0]:
            try:
                sock.sendall(frame)
            except (BrokenPipeError, ConnectionResetError):
                break  # the server closed: its answer is in the receive buffer
            sent += len(chunk)
        status, headers, body = read_response(sock)
    assert status == 413 and json.loads(body)["error"]["code"] == "body_too_large", body
    assert "no Content-Length" in json.loads(body)["error"]["message"]
    # What the client got into the socket before it saw the answer: the limit plus what the kernel's socket
    # buffers hold (0.0-0.2 MB seen on loopback; 4 MB allowed); far below the 50 MB offered.
    assert sent < DEFAULT_MAX_BODY_BYTES + 4 * MB, sent


def vm_kb(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


@needs_http
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/<pid>/status")
def test_concurrent_large_bodies_keep_the_servers_memory_bounded(server):
    """16 concurrent bodies of 3.9 MB (just under the 4 MB limit; one short text each, so the model's share
    is negligible): the server's peak RSS grows by less than 16 x 3.9 MB x 4 = 250 MB, i.e. at most about four
    copies of each body at once (read chunks, joined bytes, decoded text, parsed string); 88-126 MB seen on 2
    cores. A body past the limit is refused up front."""
    n, size = 16, 3_900_000
    head = b'{"texts": ["short text"], "pad": "'
    body = head + b"p" * (size - len(head) - 2) + b'"}'
    assert len(body) == size
    pid = server.proc.pid
    server.client.post("/v1/predict", json={"texts": ["warm"]})  # every lazy import and buffer already made
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM (the peak RSS) to the current RSS
    baseline = vm_kb(pid, "VmRSS")

    async def send_all():
        import httpx

        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            return await asyncio.gather(*(client.post("/v1/predict", content=body,
                                                      headers={"Content-Type": "application/json"})
                                          for _ in range(n)))

    responses = asyncio.run(send_all())
    assert [r.status_code for r in responses] == [200] * n, responses[0].text
    growth_mb = (vm_kb(pid, "VmHWM") - baseline) / 1000
    bound_mb = n * size / MB * 4
    assert growth_mb < bound_mb, f"peak RSS grew {growth_mb:.0f} MB for {n} bodies of {size} bytes"
    too_big = b'{"texts": ["a"], "pad": "' + b"p" * DEFAULT_MAX_BODY_BYTES + b'"}'
    r = server.client.post("/v1/predict", content=too_big, headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large", r.text


# ---------------------------------------------------------------------------------------------
# a client that goes away while sending its body
# ---------------------------------------------------------------------------------------------


@needs_http
def test_a_client_that_disconnects_mid_body_is_counted_not_answered_500(server):
    before_500, before_body = requests_counted(server, "500"), disconnects(server, "body")
    with connect(server) as sock:
        sock.sendall(b"POST /v1/predict HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100000\r\n\r\n" + b'{"texts": ["' + b"z" * 1000)
        time.sleep(0.3)  # the handler is reading the body
    wait_for(lambda: disconnects(server, "body") == before_body + 1)
    assert requests_counted(server, "500") == before_500
    assert requests_counted(server, "499") >= 1
    assert "Traceback" not in server.stderr() and "unexpected error" not in server.stderr(), server.stderr()[-3000:]
    assert server.client.post("/v1/predict", json={"texts": ["still serving"]}).status_code == 200


# ---------------------------------------------------------------------------------------------
# binding beyond loopback, and the connection limit
# ---------------------------------------------------------------------------------------------


def start_cli(model: str, *args: str, log_dir) -> tuple[subprocess.Popen, str, object]:
    """`torchloom serve MODEL --port 0 ARGS` without an API key; (process, its URL's port, stderr path)."""
    out_path, err_path = log_dir / "stdout.txt", log_dir / "stderr.txt"
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "torchloom", "serve", model, "--port", "0", "--device", "cpu",
                                 *args], stdout=out, stderr=err, env=NO_KEY_ENV, start_new_session=True)
    deadline = time.monotonic() + 120
    while "listening on " not in out_path.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, err_path.read_text()[-3000:]
        time.sleep(0.1)
    url = out_path.read_text().split("listening on ", 1)[1].split()[0]
    return proc, urlsplit(url).port, err_path


def stop(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@needs_http
def test_binding_every_interface_without_a_key_warns_once(model_dir, tmp_path):  # noqa: F811
    """--host 0.0.0.0 without a key: it starts, with one warning line on stderr that says what to set, and
    serves. Traffic goes to 127.0.0.1 only."""
    proc, port, err_path = start_cli(model_dir, "--host", "0.0.0.0", log_dir=tmp_path)
    try:
        warnings = [line for line in err_path.read_text().splitlines() if "no API key" in line]
        assert len(warnings) == 1, err_path.read_text()
        assert "--host 0.0.0.0" in warnings[0] and "--api-key" in warnings[0] and "TORCHLOOM_API_KEY" in warnings[0]
        assert "--require-api-key" in warnings[0]
        import httpx

        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            wait_for(lambda: client.get("/readyz").status_code == 200, 120)
            assert client.post("/v1/predict", json={"texts": ["open, but warned"]}).status_code == 200
    finally:
        assert stop(proc) == 0, err_path.read_text()[-3000:]


# ---------------------------------------------------------------------------------------------
# slow clients: the read timeout, and the cap on requests served (issue 51 item 2)
# ---------------------------------------------------------------------------------------------

CAP, READ_TIMEOUT = 3, 1.0


@pytest.fixture(scope="module")
def capped(model_dir, tmp_path_factory):  # noqa: F811 (model_dir: test_serve's fixture)
    """--max-connections 3 and a read timeout of 1 s, no API key, on 127.0.0.1."""
    s = Server(model_dir, "--device", "cpu", "--max-connections", str(CAP), "--read-timeout", str(READ_TIMEOUT),
               log_dir=tmp_path_factory.mktemp("capped"))
    yield s
    assert s.terminate() == 0, s.stderr()[-3000:]


def answered_within(server: Server, seconds: float) -> None:
    """/healthz and a predict from fresh clients both answer 200 within `seconds` each."""
    import httpx

    with httpx.Client(base_url=server.url, timeout=seconds) as client:
        started = time.monotonic()
        assert client.get("/healthz").status_code == 200
        r = client.post("/v1/predict", json={"texts": ["a normal client"]})
        assert r.status_code == 200, r.text
        assert time.monotonic() - started < 2 * seconds


def dropped_with_408(sock: socket.socket) -> bool:
    """Whether the server answered 408 and closed (read until EOF within the socket's timeout)."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data.startswith(b"HTTP/1.1 408 ")


@needs_http
def test_a_slowloris_cannot_hold_the_server_and_its_sockets_are_dropped_after_the_read_timeout(capped):
    """4 x --max-connections sockets, each sending a request a header line every 0.2 s: half-sent requests take
    no slot, so /healthz and a normal predict are answered within 1 s while they trickle; each of them is
    answered 408 and closed once the read timeout passes (1 s here), with one log line."""
    url = urlsplit(capped.url)
    logged = capped.stderr().count("its headers did not arrive")
    socks = [socket.create_connection((url.hostname, url.port), timeout=5) for _ in range(4 * CAP)]
    stop_trickling = threading.Event()

    def trickle() -> None:
        for s in socks:
            s.sendall(b"POST /v1/predict HTTP/1.1\r\n")
        for i in range(25):  # 5 s at most: far past the read timeout
            if stop_trickling.wait(0.2):
                return
            for s in socks:
                try:
                    s.sendall(f"X-Slow-{i}: still coming\r\n".encode())
                except OSError:
                    pass  # dropped already

    trickler = threading.Thread(target=trickle, daemon=True)
    trickler.start()
    try:
        time.sleep(0.3)  # every socket has sent its request line and a header line or two
        answered_within(capped, 1.0)
        started = time.monotonic()
        assert all(dropped_with_408(s) for s in socks)
        assert time.monotonic() - started < READ_TIMEOUT + 2
    finally:
        stop_trickling.set()
        trickler.join()
        for s in socks:
            s.close()
    wait_for(lambda: capped.stderr().count("its headers did not arrive") == logged + 4 * CAP, 5)
    assert "Traceback" not in capped.stderr(), capped.stderr()[-3000:]
    answered_within(capped, 1.0)


@needs_http
def test_the_cap_counts_requests_being_served_and_a_slow_body_is_dropped_after_the_read_timeout(capped):
    """--max-connections requests whose bodies trickle fill the cap: a predict gets 503 (JSON, Retry-After,
    Connection: close) and /healthz still 200. The read timeout drops them (408; their handlers see the client
    gone, counted as such, not a 500), and predicts are answered again."""
    import httpx

    url = urlsplit(capped.url)
    before_body = disconnects(capped, "body")
    holders = [socket.create_connection((url.hostname, url.port), timeout=5) for _ in range(CAP)]
    try:
        for s in holders:
            s.sendall(b"POST /v1/predict HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 1000\r\n\r\n" + b'{"texts": ["')
        time.sleep(0.3)  # the server has read their headers: they are being served
        with httpx.Client(base_url=capped.url, timeout=1.0) as client:
            full = client.post("/v1/predict", json={"texts": ["one too many"]})
            assert full.status_code == 503 and full.json()["error"]["code"] == "too_many_connections", full.text
            assert full.headers["retry-after"] == "1" and full.headers["connection"] == "close"
            assert client.get("/healthz").status_code == 200
        assert all(dropped_with_408(s) for s in holders)
    finally:
        for s in holders:
            s.close()
    wait_for(lambda: disconnects(capped, "body") == before_body + CAP)
    assert requests_counted(capped, "503") >= 1 and requests_counted(capped, "500") == 0
    answered_within(capped, 1.0)


@needs_http
def test_loopback_without_a_key_does_not_warn(server):
    assert "no API key" not in server.stderr()


@needs_http
@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
def test_require_api_key_without_one_refuses_to_start_in_one_line(model_dir, host):  # noqa: F811
    from support.command import torchloom

    proc = torchloom("serve", model_dir, "--host", host, "--port", "0", "--require-api-key", timeout=120,
                     env={"TORCHLOOM_API_KEY": None})
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.splitlines()) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "--require-api-key" in proc.stderr and "--api-key" in proc.stderr and "TORCHLOOM_API_KEY" in proc.stderr
    assert "listening on" not in proc.stdout


# ---------------------------------------------------------------------------------------------
# the pieces on their own
# ---------------------------------------------------------------------------------------------


def test_defaults_are_bounded():
    s = ServeSettings("model")
    assert s.max_body_bytes == DEFAULT_MAX_BODY_BYTES <= 4 * MB
    assert s.max_connections == DEFAULT_MAX_CONNECTIONS == 128 and not s.require_api_key
    assert s.read_timeout_s == 10.0


@pytest.mark.parametrize("host, loopback", [("127.0.0.1", True), ("127.0.0.2", True), ("::1", True),
                                            ("localhost", True), ("0.0.0.0", False), ("::", False), ("", False),
                                            ("10.1.2.3", False), ("name.invalid", False)])
def test_which_hosts_count_as_loopback(host, loopback, monkeypatch):
    monkeypatch.delenv("TORCHLOOM_API_KEY", raising=False)
    assert is_loopback(host) is loopback
    warning = ServeSettings("model", host=host).check().exposure_warning()
    assert (warning is None) is loopback
    assert ServeSettings("model", host=host, api_key="k" * 8).check().exposure_warning() is None


@pytest.mark.parametrize("field, value, needle", [("max_body_bytes", 0, "--max-body-bytes 0: must be at least 1"),
                                                   ("max_connections", 0, "--max-connections 0: must be at least 1"),
                                                   ("read_timeout_s", 0, "--read-timeout 0: must be more than 0")])
def test_limit_settings_are_checked(field, value, needle):
    from torchloom.errors import UserError

    with pytest.raises(UserError, match=needle):
        ServeSettings("model", **{field: value}).check()


def test_require_api_key_passes_with_a_key(monkeypatch):
    monkeypatch.setenv("TORCHLOOM_API_KEY", "from-the-environment")
    assert ServeSettings("model", host="0.0.0.0", require_api_key=True).check().exposure_warning() is None


@needs_http
def test_large_bodies_are_parsed_off_the_event_loop():
    from torchloom.serve.api_common import PARSE_INLINE_BYTES, parse_off_loop

    def parse(body: bytes, tag: str) -> tuple[str, int, str]:
        return threading.current_thread().name, len(body), tag

    async def both():
        loop_thread = threading.current_thread().name
        small = await parse_off_loop(parse, b"x" * PARSE_INLINE_BYTES, "small")
        large = await parse_off_loop(parse, b"x" * (PARSE_INLINE_BYTES + 1), "large")
        return loop_thread, small, large

    loop_thread, small, large = asyncio.run(both())
    assert small == (loop_thread, PARSE_INLINE_BYTES, "small")
    assert large[0] != loop_thread and large[1:] == (PARSE_INLINE_BYTES + 1, "large")


@needs_http
def test_load_json_bounds_nesting_and_integers_and_ignores_brackets_in_strings():
    from torchloom.serve.api_common import MAX_INT_DIGITS, MAX_JSON_DEPTH, ApiError, json_depth, load_json

    assert json_depth(b'{"texts": ["[[[[\\"]]]{{", "a"]}') == 2
    assert load_json(b'{"texts": ["' + b"[" * 100 + b'"]}', "") == {"texts": ["[" * 100]}
    deepest = b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH
    assert load_json(deepest, "") and json_depth(deepest) == MAX_JSON_DEPTH
    assert load_json(b"[-" + b"7" * MAX_INT_DIGITS + b"]", "") == [-int("7" * MAX_INT_DIGITS)]
    for body, needle in ((b"[" + deepest + b"]", f"{MAX_JSON_DEPTH + 1} deep"),
                         (b"[-" + b"7" * (MAX_INT_DIGITS + 1) + b"]", f"{MAX_INT_DIGITS + 1} digits")):
        with pytest.raises(ApiError, match=needle) as e:
            load_json(body, "send JSON")
        assert e.value.status == 400 and e.value.code == "invalid_json" and "send JSON" in e.value.message
