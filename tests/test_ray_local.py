"""A Ray instance torchloom starts for itself: loopback only, Ray's token authentication on."""

from __future__ import annotations

import ipaddress
import os

import pytest

ray = pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")


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
