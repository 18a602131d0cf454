"""Without MLflow installed: one line saying the run is not tracked, and the job goes on."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from torchloom.data.synthetic import write_synthetic_dataset
from torchloom.model.tiny import write_tiny_model


def test_a_run_without_mlflow_says_so_in_one_line_and_trains(tmp_path):
    hidden = tmp_path / "no-mlflow" / "mlflow"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text('raise ImportError("No module named \'mlflow\'")\n')
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": f"{hidden.parent}{os.pathsep}"
           + os.environ.get("PYTHONPATH", "")}
    env.pop("MLFLOW_TRACKING_URI", None)
    model = write_tiny_model(tmp_path / "tiny")
    rd = tmp_path / "run"
    write_synthetic_dataset(rd / "data", rows={"train": 24, "val": 8, "test": 8})
    args = [sys.executable, "-m", "torchloom", "train", "--output.dir", str(rd), "--model.path", model,
            "--engine.workers", "1", "--train.epochs", "1", "--train.batch_size", "8", "--train.precision", "fp32"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    notes = [line for line in proc.stderr.splitlines() if "MLflow is not installed" in line]
    assert notes == ["torchloom: tracking: MLflow is not installed, so this run is not tracked"
                     " (pip install 'mlflow-skinny>=3.0' 'pandas>=2.2'; --tracking.enabled false silences this)"
                     ], proc.stderr[-3000:]
    assert (rd / "checkpoints").is_dir()
    # asked for by URI, its absence is an error, before anything runs
    shutil.rmtree(rd / "checkpoints")
    proc = subprocess.run([*args, "--tracking.uri", f"sqlite:///{tmp_path / 'm.db'}"], capture_output=True,
                          text=True, timeout=300, env=env)
    assert proc.returncode == 2 and "tracking.uri is set but MLflow is not installed" in proc.stderr, proc.stderr
    assert not (rd / "checkpoints").exists()
