"""What the tests of --overwrite and the ledger share: the CLI (support.command's runner), its one error line,
content that torchloom's readers accept, and projects of other tools that use the names a run uses."""

from __future__ import annotations

import os
import subprocess

from support.command import torchloom

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
__all__ = ["torchloom", "one_error", "real_config", "real_manifest", "FOREIGN", "BUCKET", "CREDENTIALS", "ENV"]


def one_error(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("torchloom: error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    return errors[0]


# Directories with a name torchloom also uses (checkpoints/, config.toml, manifest.json) that are not torchloom's.
FOREIGN = {
    "lightning": {"train.py": "import lightning as L\n", "lightning_logs/version_0/hparams.yaml": "lr: 0.001\n",
                  "checkpoints/epoch=0.ckpt": "weights"},
    "hugo": {"config.toml": 'baseURL = "https://example.org/"\ntitle = "x"\n[params]\n',
             "content/_index.md": "# Home\n", "themes/plain/theme.toml": 'name = "plain"\n'},
    "webapp": {"manifest.json": '{"name": "App", "short_name": "A", "start_url": "/", "icons": []}',
               "index.html": "<!doctype html><title>App</title>\n"},
}


def real_config() -> bytes:
    from torchloom.config import build, to_toml

    return to_toml(build(None, ["--output.dir", "runs/x"])).encode()


def real_manifest() -> bytes:
    from torchloom.manifest import Manifest, Shard, Split

    split = Split(rows=2, shards=[Shard("train/part-0.parquet", 2, [2])], per_class={"a": 1, "b": 1})
    return Manifest(labels=["a", "b"], splits={"train": split}, tokenizer={"path": "m", "hash": "h"},
                    fingerprint="f").to_json().encode()


BUCKET = "torchloom-overwrite"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing-secret",
               "AWS_DEFAULT_REGION": "us-east-1"}
