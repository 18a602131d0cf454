"""Load a sequence classifier and its tokenizer from a local Hugging Face directory (never a hub)."""

from __future__ import annotations

from pathlib import Path

from torchloom.errors import UserError
from torchloom.model.env import use_model_env


def check_model_dir(path: str) -> str:
    p = Path(path)
    if not (p / "config.json").is_file():
        raise UserError(
            f"model.path {path}: not a Hugging Face model directory (no config.json);"
            " pass a local directory that from_pretrained loads"
        )
    from torchloom.model.export import refuse_pickled_weights

    refuse_pickled_weights(p, "model.path")
    return str(p)


# What each architecture calls its attention-probability dropout.
ATTENTION_DROPOUT_KEYS = ("attention_probs_dropout_prob", "attention_dropout", "attn_pdrop")


def build_classifier(path: str, labels: list[str], attention_dropout: float = -1.0, multi_label: bool = False):
    """The model at `path` with a fresh classification head for `labels` (index = label id).

    attention_dropout >= 0 replaces the model's dropout on attention probabilities; -1 keeps it. multi_label:
    the config says problem_type multi_label_classification, so whoever loads the exported model with
    from_pretrained gets a sigmoid per tag (and Transformers' own loss, binary cross-entropy).
    """
    use_model_env()
    import transformers
    from transformers import AutoConfig, AutoModelForSequenceClassification

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    check_model_dir(path)
    config = AutoConfig.from_pretrained(
        path,
        num_labels=len(labels),
        id2label=dict(enumerate(labels)),
        label2id={label: i for i, label in enumerate(labels)},
        local_files_only=True,
        **({"problem_type": "multi_label_classification"} if multi_label else {}),
    )
    if attention_dropout >= 0:
        for key in ATTENTION_DROPOUT_KEYS:
            if hasattr(config, key):
                setattr(config, key, attention_dropout)
    return AutoModelForSequenceClassification.from_pretrained(path, config=config, local_files_only=True,
                                                              use_safetensors=True)


def load_tokenizer(path: str):
    use_model_env()
    from transformers import AutoTokenizer

    check_model_dir(path)
    return AutoTokenizer.from_pretrained(path, local_files_only=True)
