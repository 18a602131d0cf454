"""MLflow "models from code": the file MLflow stores with a logged torchloom model and runs to load it.

MLflow puts the model's `code/` folder (torchloom's own package, logged as `code_paths`) first on `sys.path`
before it runs this file, so the import below needs no torchloom installed where the model is served."""

import mlflow

from torchloom.mlflow_model import TextClassifier

mlflow.models.set_model(TextClassifier())
