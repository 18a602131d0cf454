"""The exported model as an MLflow pyfunc model, served by `mlflow models serve` or loaded with
`mlflow.pyfunc.load_model`: input a table with a `text` column (or a list of strings), output one row
per text with `label`, `score` and one `p_<label>` column per label, the same numbers as
`torchloom predict` (the model dir itself travels as an artifact).

The model carries torchloom's own code (`code/torchloom`, MLflow's `code_paths`), and MLflow puts that
folder first on `sys.path` when it loads the model: torchloom is not a package on PyPI, so it is not among
the model's pip requirements, where a name anyone could register would install a stranger's code."""

from __future__ import annotations

import shutil
import tempfile
import warnings
from pathlib import Path

try:
    from mlflow.pyfunc import PythonModel
except ImportError:  # only needed when MLflow is installed
    PythonModel = object

class TextClassifier(PythonModel):
    # The input is deliberately loose (a table with a text column, or a list of texts): no type-hint
    # validation, and no warning at class definition suggesting it.
    _skip_type_hint_validation = True

    def load_context(self, context) -> None:
        from torchloom.model.predict import Predictor

        self.predictor = Predictor(context.artifacts["model_dir"], device="cpu")

    def predict(self, context, model_input, params=None):
        import pandas as pd

        if isinstance(model_input, pd.DataFrame):
            column = "text" if "text" in model_input.columns else model_input.columns[0]
            texts = [str(t) for t in model_input[column].tolist()]
        elif isinstance(model_input, str):
            texts = [model_input]
        else:
            texts = [str(t) for t in model_input]
        rows = []
        for pred in self.predictor.predict(texts):
            row = {"label": pred["label"], "score": pred["score"]}
            if "labels" in pred:  # a multi-label model: its tags over their thresholds
                row["labels"] = pred["labels"]
            row.update({f"p_{k}": v for k, v in pred["probabilities"].items()})
            rows.append(row)
        return pd.DataFrame(rows)


def requirements() -> list[str]:
    """The third-party packages the model needs, pinned; torchloom itself travels as code (`code_paths`)."""
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for pkg in ("torch", "transformers", "tokenizers", "pandas"):
        try:
            v = version(pkg)
        except PackageNotFoundError:
            continue
        out.append(f"{pkg}=={v.split('+')[0]}")
    return out


def stage_package(tmp: Path) -> Path:
    """A copy of the torchloom package to carry with the model: sources only, no caches or dot-files."""
    out = tmp / "stage" / "torchloom"
    shutil.copytree(Path(__file__).parent, out, ignore=shutil.ignore_patterns("__pycache__", "*.py[cod]", ".*"))
    return out


def log_model(tracker, model_dir: Path) -> None:
    import mlflow.pyfunc
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, Schema

    signature = ModelSignature(inputs=Schema([ColSpec("string", "text")]),
                               outputs=Schema([ColSpec("string", "label"), ColSpec("double", "score")]))
    code = Path(__file__).with_name("mlflow_pyfunc.py")
    with tempfile.TemporaryDirectory(prefix="torchloom-mlflow-") as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # advice about type hints and input examples, once per model
        path = Path(tmp) / "model"
        mlflow.pyfunc.save_model(
            path=str(path), python_model=str(code), artifacts={"model_dir": str(model_dir)},
            code_paths=[str(stage_package(Path(tmp)))], signature=signature, pip_requirements=requirements(),
        )
        tracker.client.log_artifacts(tracker.run_id, str(path), "model")
