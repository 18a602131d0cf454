"""Load a sequence classifier and its tokenizer from a local Hugging Face directory (never a hub)."""

from __future__ import annotations

import os
from pathlib import Path

from torchloom.errors import UserError

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def check_model_dir(path: str) -> str:
    p = Path(path)
    if not (p / "config.json").is_file():
        raise UserError(
            f"model.path {path}: not a Hugging Face model directory (no config.json);"
            " pass a local directory that from_pretrained loads"
        )
    return str(p)


def build_classifier(path: str, labels: list[str]):
    """The model at `path` with a fresh classification head for `labels` (index = label id)."""
    import transformers
    from transformers import AutoModelForSequenceClassification

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    check_model_dir(path)
    return AutoModelForSequenceClassification.from_pretrained(
        path,
        num_labels=len(labels),
        id2label=dict(enumerate(labels)),
        label2id={label: i for i, label in enumerate(labels)},
        local_files_only=True,
    )


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    check_model_dir(path)
    return AutoTokenizer.from_pretrained(path, local_files_only=True)
