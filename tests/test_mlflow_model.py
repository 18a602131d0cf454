"""The logged MLflow model carries torchloom's own code, names no torchloom package among its pip requirements
(there is none on PyPI: a name anyone could register), and `mlflow models serve` answers from the carried code."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
from support.net import free_port

mlflow = pytest.importorskip("mlflow")
pytest.importorskip("uvicorn")  # the scoring server of `mlflow models serve`

LABELS = ["money", "music", "sport"]
TEXTS = ["bank shares profit market price", "guitar band song album concert", "match goal team"]

# Put first on PYTHONPATH of the serving processes: it takes every folder holding a `torchloom` package (the
# editable install's src/) off sys.path, so torchloom can only come from the model's own code/, and it writes
# down where each import of torchloom found it.
SITECUSTOMIZE = '''
import os, sys
from importlib.machinery import PathFinder

sys.path[:] = [p for p in sys.path if not os.path.isdir(os.path.join(p or ".", "torchloom"))]


class _Witness:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name != "torchloom":
            return None
        spec = PathFinder.find_spec(name, path)
        with open(os.environ["TORCHLOOM_IMPORT_LOG"], "a") as f:
            f.write(f"{spec.origin if spec else None}\\n")
        return spec


sys.meta_path.insert(0, _Witness)
'''


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    """(tracking URI, run id, exported model dir) of a run holding a tiny model logged by torchloom."""
    import torch
    from mlflow import MlflowClient

    from torchloom.mlflow_model import log_model
    from torchloom.model.build import build_classifier
    from torchloom.model.export import export_model
    from torchloom.model.tiny import write_tiny_model

    tmp = tmp_path_factory.mktemp("mlflow-model")
    base = write_tiny_model(tmp / "tiny")
    torch.manual_seed(0)
    model_dir = export_model(build_classifier(base, LABELS).eval(), base, LABELS, str(tmp / "model"),
                             extra_info={"max_length": 32})
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("mlflow-model", artifact_location=(tmp / "artifacts").as_uri())
    run_id = client.create_run(exp).info.run_id
    log_model(SimpleNamespace(client=client, run_id=run_id), Path(model_dir))
    client.set_terminated(run_id)
    local = Path(mlflow.artifacts.download_artifacts(f"runs:/{run_id}/model", tracking_uri=uri,
                                                     dst_path=str(tmp / "downloaded")))
    return uri, run_id, model_dir, local


def test_the_model_carries_torchloom_and_no_torchloom_requirement(logged):
    import yaml

    *_, local = logged
    code = local / "code" / "torchloom"
    src = Path(__file__).resolve().parents[1] / "src" / "torchloom"
    carried = {p.relative_to(code) for p in code.rglob("*") if p.is_file()}
    sources = {p.relative_to(src) for p in src.rglob("*.py") if "__pycache__" not in p.parts}
    assert sources <= carried and Path("mlflow_model.py") in carried
    assert not [p for p in carried if "__pycache__" in p.parts or p.suffix in (".pyc", ".pyo")]
    size = sum((code / p).stat().st_size for p in carried)
    assert size < 2_000_000, f"code/ holds {size} bytes"
    conf = yaml.safe_load((local / "MLmodel").read_text())["flavors"]["python_function"]
    assert conf["code"] == "code"
    reqs = (local / "requirements.txt").read_text().splitlines()
    assert not [r for r in reqs if "torchloom" in r.lower()], reqs
    assert any(r.startswith("torch==") for r in reqs) and any(r.startswith("transformers==") for r in reqs)
    for env_file in ("conda.yaml", "python_env.yaml"):
        assert "torchloom" not in (local / env_file).read_text().lower()


def test_mlflow_models_serve_as_documented_answers_from_the_carried_code(logged, tmp_path):
    """`MLFLOW_TRACKING_URI=... mlflow models serve -m runs:/<id>/model --env-manager local -p PORT`, as in
    docs/tuning.md, from a temp dir, with torchloom's source folder off sys.path in every process."""
    from torchloom.model.predict import Predictor

    uri, run_id, model_dir, _ = logged
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    log = tmp_path / "imports.log"
    env = {"PATH": f"{Path(sys.executable).parent}{os.pathsep}/usr/bin:/bin", "HOME": str(tmp_path),
           "PYTHONPATH": str(tmp_path / "site"), "TORCHLOOM_IMPORT_LOG": str(log), "HF_HUB_OFFLINE": "1",
           "MLFLOW_TRACKING_URI": uri, "PYTHONUNBUFFERED": "1"}
    probe = subprocess.run([sys.executable, "-c", "import torchloom"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=60)
    assert probe.returncode != 0 and "No module named 'torchloom'" in probe.stderr, probe.stderr
    log.unlink(missing_ok=True)
    port = free_port()
    out = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen(["mlflow", "models", "serve", "-m", f"runs:/{run_id}/model", "--env-manager", "local",
                             "-p", str(port)], cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        body = json.dumps({"dataframe_split": {"columns": ["text"], "data": [[t] for t in TEXTS]}}).encode()
        answer = _post_when_up(f"http://127.0.0.1:{port}/invocations", body, proc, tmp_path / "serve.log")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
        out.close()
    rows = answer["predictions"]
    expected = Predictor(model_dir, device="cpu").predict(TEXTS)
    assert [r["label"] for r in rows] == [e["label"] for e in expected]
    for row, exp in zip(rows, expected):
        assert abs(row["score"] - exp["score"]) < 1e-5
        assert all(abs(row[f"p_{k}"] - v) < 1e-5 for k, v in exp["probabilities"].items())
    origins = log.read_text().splitlines()
    assert origins and all(o.endswith(os.path.join("model", "code", "torchloom", "__init__.py")) for o in origins), \
        origins


def _post_when_up(url: str, body: bytes, proc, log_path: Path, timeout: float = 240) -> dict:
    deadline = time.time() + timeout
    while True:
        if proc.poll() is not None:
            pytest.fail(f"mlflow models serve exited {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as e:
            pytest.fail(f"{url} answered {e.code}: {e.read()[:2000]!r}\n{log_path.read_text()[-3000:]}")
        except OSError:
            if time.time() > deadline:
                pytest.fail(f"no answer from {url}:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.5)
