"""torchloom: labelled text to a served classifier with distributed PyTorch on local, Spark or Ray."""

__version__ = "0.1.0"
