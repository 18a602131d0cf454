"""The environment of every process that loads a model or tokenizer: the driver, each training worker,
a server, a scoring task. Set when a process starts or a model is loaded, never at import."""

from __future__ import annotations

import os

MODEL_ENV = {
    "HF_HUB_OFFLINE": "1",  # models are local directories: nothing may try the hub (slow, or hangs offline)
    "TOKENIZERS_PARALLELISM": "false",  # its thread pool deadlocks a forked child and warns of it
    "TRANSFORMERS_VERBOSITY": "error",  # read when transformers is imported
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
}


def model_env() -> dict[str, str]:
    """MODEL_ENV, where this process has not set a variable itself (a user's own value wins)."""
    return {k: os.environ.get(k, v) for k, v in MODEL_ENV.items()}


def use_model_env() -> None:
    """Give this process model_env(); before transformers is imported, for the variables it reads then."""
    os.environ.update(model_env())
