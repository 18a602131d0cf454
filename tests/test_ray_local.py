"""A Ray instance torchloom starts for itself: loopback only, Ray's token authentication on."""

from __future__ import annotations

import ipaddress
import os
import socket

import pytest

ray = pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")
pytestmark = pytest.mark.ray  # see tests/support/schedule.py


def test_own_instance_listens_on_loopback_only_with_token_auth(monkeypatch, tmp_path):
    from torchloom.engines.ray import init_ray

    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # Ray writes no token file under ~/.ray
    assert init_ray("")
    try:
        nodes = ray.nodes()
        assert [n["NodeManagerAddress"] for n in nodes] == ["127.0.0.1"]
        ours = {p.pid for p in psutil.Process().children(recursive=True)}
        listening = {(c.laddr.ip, c.pid) for c in psutil.net_connections("tcp")
                     if c.status == psutil.CONN_LISTEN and c.pid in ours}
        assert listening, "the instance should have servers"
        exposed = [(ip, psutil.Process(pid).name()) for ip, pid in listening
                   if not ipaddress.ip_address(ip.removeprefix("::ffff:")).is_loopback]
        assert not exposed, f"listening beyond loopback: {exposed}"
        # the workers run with token authentication, and the driver connected with the token
        mode = ray.get(ray.remote(lambda: os.environ.get("RAY_AUTH_MODE")).remote())
        assert mode == "token"
        assert not (tmp_path / ".ray" / "auth_token").exists()
    finally:
        ray.shutdown()
    from ray._private import ray_constants

    assert ray_constants.ENABLE_RAY_CLUSTER  # restored: a later ray.init may join a real cluster


def test_joining_a_cluster_that_is_not_there_is_one_line(tmp_path):
    # "auto" looks for any GCS process on the machine and for Ray's address file under the temp dir: the
    # child runs in a PID namespace of its own (the suite's other Ray instances are invisible to it) with its
    # own temp dir. An address where nothing listens is refused in seconds; Ray itself retried it for minutes.
    import subprocess
    import sys
    import time

    code = ("import sys\nfrom torchloom.engines.ray import init_ray\nfrom torchloom.errors import UserError\n"
            "try:\n    init_ray(sys.argv[1])\nexcept UserError as e:\n    print(e)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env = {**env, "RAY_ADDRESS": "", "TMPDIR": str(tmp_path)}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]  # closed again: nothing listens there
    for address, isolate in (("auto", ["unshare", "--pid", "--fork", "--mount-proc"]),
                             (f"127.0.0.1:{free}", []), (f"ray://127.0.0.1:{free}", [])):
        started = time.monotonic()
        proc = subprocess.run([*isolate, sys.executable, "-c", code, address], capture_output=True, text=True,
                              timeout=120, cwd=tmp_path, env=env)
        line = proc.stdout.strip()
        assert line.startswith(f"engine.ray_address {address}: no Ray cluster answers there"), \
            proc.stdout + proc.stderr[-2000:]
        assert "leave engine.ray_address empty" in line and "\n" not in line and len(line) < 300
        if isolate:
            assert "Could not find any running Ray instance" in line
        else:
            assert f"127.0.0.1:{free}: Connection refused" in line and time.monotonic() - started < 30


def test_own_instance_is_the_one_its_tasks_find_beside_another_ray():
    # Ray's State API, called with no address in a task or actor (as Ray Train's placement group cleaner calls
    # it), looks for "the" Ray on the machine; beside another instance it failed, the cleaner died, and a Tune
    # trial stopped by ASHA left its workers' CPUs reserved: the next trial waited forever.
    import shutil
    import subprocess
    import sys
    import tempfile
    import time

    from torchloom.engines.ray import init_ray

    other = tempfile.mkdtemp(prefix="tl-other-ray-")  # short: Ray's socket paths must fit in 107 bytes
    code = ("import ray, sys, time; ray.init(num_cpus=0, include_dashboard=False, _temp_dir=sys.argv[1]);"
            " print('up', flush=True); time.sleep(600)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    proc = subprocess.Popen([sys.executable, "-c", code, other], stdout=subprocess.PIPE, text=True,
                            env={**env, "RAY_AUTH_MODE": "disabled"}, start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "up"
        before = time.monotonic()
        assert init_ray("")
        try:
            ours = ray.get_runtime_context().gcs_address

            @ray.remote(num_cpus=0)
            def found() -> tuple[str, list]:
                from ray.util.state import list_nodes

                return os.environ.get("RAY_ADDRESS", ""), [n.node_ip for n in list_nodes()]

            address, nodes = ray.get(found.remote(), timeout=max(30.0, 120 - (time.monotonic() - before)))
            assert address == ours and nodes == ["127.0.0.1"]
        finally:
            ray.shutdown()
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()
        subprocess.run(["pkill", "-9", "-f", other], check=False)
        shutil.rmtree(other, ignore_errors=True)
