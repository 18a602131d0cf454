"""MLflow "models from code": the file MLflow stores with a logged torchloom model and runs to load it."""

import mlflow

from torchloom.mlflow_model import TextClassifier

mlflow.models.set_model(TextClassifier())
