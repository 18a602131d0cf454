"""Several hosts on one machine for multi-host tests: Linux network namespaces joined by a bridge.

    with Cluster(["a", "b", "c"]) as hosts:
        proc = hosts["a"].popen(["python", "-c", "..."], log=path)

- Each host is a network namespace with one interface (eth0) and its own address from one private
  test range (10.231.X.0/24, X drawn per cluster) that exists only inside these namespaces. The root
  namespace gets no address in it, and no route leads out: nothing can reach any other address.
- The bridge lives in a namespace of its own, so the root namespace's links stay as they were.
- Every process runs inside a host's namespace under its own host name (a UTS namespace), and each
  host's /etc/hosts (through /etc/netns/<ns>/hosts, which `ip netns exec` mounts) names every host,
  so Spark, Ray and torch advertise and resolve addresses as they would on separate machines.
- The hosts share this machine's filesystem, as hosts sharing NFS would.
- Cleanup kills every process in each namespace by pid, then deletes the namespaces and their files,
  whether the test passed or not.
"""

from __future__ import annotations

import os
import random
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path

NETNS_ETC = Path("/etc/netns")


def skip_without_namespaces() -> None:
    """Skip the calling test module where network namespaces cannot be made (not root, no `ip`)."""
    import pytest

    reason = unavailable()
    if reason:
        pytest.skip(f"multi-host tests need network namespaces: {reason}", allow_module_level=True)


def unavailable() -> str | None:
    """Why multi-host tests cannot run here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"the {tool} command is missing"
    probe = f"tlprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class Host:
    def __init__(self, name: str, ns: str, address: str):
        self.name, self.ns, self.address = name, ns, address  # name: the host name every host resolves
        self.procs: list[subprocess.Popen] = []
        self.hidden: list[str] = []  # directories this host does not see (an empty tmpfs over each)

    def command(self, argv: list[str]) -> list[str]:
        """argv run inside this host: its network namespace, its host name, without its hidden directories."""
        mounts = "".join(f"mount -t tmpfs tmpfs {shlex.quote(d)} && " for d in self.hidden)
        return ["ip", "netns", "exec", self.ns, "unshare", "--uts", *(["--mount"] if self.hidden else []),
                "sh", "-c", f'{mounts}hostname {self.name} && exec "$@"', "sh", *argv]

    def popen(self, argv: list[str], log: str | Path, env: dict | None = None, cwd: str | Path | None = None):
        out = open(log, "ab")  # noqa: SIM115 (the process owns it)
        proc = subprocess.Popen(self.command(argv), stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                start_new_session=True)
        out.close()
        self.procs.append(proc)
        return proc

    def run(self, argv: list[str], env: dict | None = None, timeout: float = 120, cwd=None):
        return subprocess.run(self.command(argv), env=env, capture_output=True, text=True, timeout=timeout,
                              cwd=cwd)

    def pids(self) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", self.ns], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]

    def kill_all(self) -> None:
        """SIGKILL every process in this host, as a power loss would."""
        for _ in range(5):
            pids = self.pids()
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.2)

    def link_down(self) -> None:
        _ip("-n", self.ns, "link", "set", "eth0", "down")


class Cluster:
    """`names` become hosts; `hosts[name]` is a Host. Use as a context manager."""

    def __init__(self, names: list[str]):
        tag = f"{os.getpid() % 10000}{random.randrange(100):02d}"
        self.subnet = f"10.231.{random.randrange(1, 255)}"
        self.bridge_ns = f"tlbr{tag}"
        self.hosts = {n: Host(f"tl{n}{tag}", f"tl{n}{tag}", f"{self.subnet}.{i + 1}") for i, n in enumerate(names)}

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def __enter__(self) -> Cluster:
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _create(self) -> None:
        _ip("netns", "add", self.bridge_ns)
        _ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.bridge_ns, "link", "set", "br0", "up")
        hosts_file = "127.0.0.1 localhost\n" + "".join(f"{h.address} {h.name}\n" for h in self.hosts.values())
        for i, h in enumerate(self.hosts.values()):
            _ip("netns", "add", h.ns)
            (NETNS_ETC / h.ns).mkdir(parents=True, exist_ok=True)
            (NETNS_ETC / h.ns / "hosts").write_text(hosts_file)
            peer = f"tlv{i}{self.bridge_ns[4:]}"[:15]
            _ip("link", "add", peer, "type", "veth", "peer", "name", "eth0", "netns", h.ns)
            _ip("link", "set", peer, "netns", self.bridge_ns)
            _ip("-n", self.bridge_ns, "link", "set", peer, "master", "br0")
            _ip("-n", self.bridge_ns, "link", "set", peer, "up")
            _ip("-n", h.ns, "addr", "add", f"{h.address}/24", "dev", "eth0")
            _ip("-n", h.ns, "link", "set", "eth0", "up")
            _ip("-n", h.ns, "link", "set", "lo", "up")

    def close(self) -> None:
        for h in self.hosts.values():
            h.kill_all()
            for p in h.procs:
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
        for ns in [*(h.ns for h in self.hosts.values()), self.bridge_ns]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)
