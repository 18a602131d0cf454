"""Hosts that share nothing but an S3 store (issue 28): torchrun on two hosts, the run on s3:// served by a
real S3 server (moto's) on a host of its own. No host sees another's files: each has a private cache (its
staging copy of the run), the others' are hidden, and so are the prepared data and the reference run. The
job must end at the local engine's weights, bit for bit, read back from the store.
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

import pytest
from engine_reference import LAST, assert_same_weights, reference

from cluster.netns import Cluster, unavailable
from cluster.test_multihost import clean_env, rank_hosts, torchrun_argv

pytest.importorskip("moto")
reason = unavailable()
if reason:
    pytest.skip(f"multi-host tests need network namespaces: {reason}", allow_module_level=True)

BUCKET = "tl-cluster"
RUN = f"s3://{BUCKET}/runs/torchrun"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "cluster-key", "AWS_SECRET_ACCESS_KEY": "cluster-secret",
               "AWS_DEFAULT_REGION": "us-east-1"}

# Run on the store's host: make the bucket, upload the prepared data (manifest.json last).
UPLOAD = """
import sys
from pyarrow import fs
from torchloom import storage
fs.S3FileSystem(endpoint_override=sys.argv[1], scheme="http", allow_bucket_creation=True,
                region="us-east-1").create_dir(sys.argv[2])
storage.push_tree(sys.argv[3], sys.argv[4], last=("manifest.json",))
"""
DOWNLOAD = """
import sys
from torchloom import storage
storage.pull_tree(sys.argv[1], sys.argv[2])
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return reference(tmp_path_factory.mktemp("store"))


def test_torchrun_on_two_hosts_sharing_only_an_s3_store_trains_the_local_weights(setup, tmp_path):
    model = tmp_path / "model"  # installed on every host, as the package would be
    shutil.copytree(setup["model"], model)
    with Cluster(["s", "b", "c"]) as hosts:
        s, b, c = hosts["s"], hosts["b"], hosts["c"]
        caches = {h.name: tmp_path / f"cache-{h.name}" for h in (s, b, c)}
        for h in (b, c):  # nothing of the run on a shared directory: the store connects them
            h.hidden += [str(setup["root"]), *(str(p) for name, p in caches.items() if name != h.name)]
        for p in caches.values():
            p.mkdir()
        port = 5000
        endpoint = f"http://{s.name}:{port}"
        env = clean_env(TMPDIR=str(tmp_path), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", AWS_ENDPOINT_URL=endpoint,
                        **CREDENTIALS)
        logs = {h.name: tmp_path / f"{h.name}.log" for h in (s, b, c)}
        s.popen([sys.executable, "-m", "moto.server", "-H", "0.0.0.0", "-p", str(port)], log=logs[s.name], env=env)
        deadline = time.monotonic() + 60
        while True:
            up = s.run([sys.executable, "-c", UPLOAD, endpoint, BUCKET, str(setup["data"]), f"{RUN}/data"],
                       env={**env, "TORCHLOOM_CACHE": str(caches[s.name])}, timeout=60)
            if up.returncode == 0:
                break
            assert time.monotonic() < deadline, up.stderr[-2000:]
            time.sleep(1)
        argv = [a if a != str(setup["model"]) else str(model)
                for a in torchrun_argv(Path("/unused"), setup, b.name, "tl-store", 0)]
        argv[argv.index("--output.dir") + 1] = RUN
        procs = [h.popen(argv, log=logs[h.name], env={**env, "TORCHLOOM_CACHE": str(caches[h.name])}) for h in (b, c)]
        for p in procs:
            p.wait(timeout=300)
        text = {h: p.read_text(errors="replace") for h, p in logs.items()}
        assert all(p.returncode == 0 for p in procs), text[b.name][-3000:] + text[c.name][-3000:]
        assert set(rank_hosts(text[b.name]).values()) == {b.name} and set(rank_hosts(text[c.name]).values()) == {c.name}
        back = tmp_path / "back"
        got = s.run([sys.executable, "-c", DOWNLOAD, f"{RUN}/checkpoints/{LAST}", str(back)],
                    env={**env, "TORCHLOOM_CACHE": str(caches[s.name])}, timeout=120)
        assert got.returncode == 0, got.stderr[-2000:]
    assert (back / "meta.json").is_file()
    assert_same_weights(setup["ref"] / "checkpoints" / LAST, back)
