"""What every local training worker imports before its first step, imported once by the local engine's
fork server (engines/local.py) so that each worker starts as a fork of a process that has them: torch,
transformers' model loading, pyarrow's Parquet reader and torchloom's training loop. A fresh interpreter
per worker spends ~8 CPU s on these imports, per worker and per restart. Importing this module is its
whole job: it touches no device, and the only threads the imports start (OpenBLAS's pool, pyarrow's
jemalloc background thread) are ones their libraries make safe to fork."""

from torchloom.engines.lifeline import fork_server_lifeline
from torchloom.model.env import use_model_env

fork_server_lifeline()  # SIGKILL to this server when its driver ends (engines/lifeline.py)
use_model_env()  # the variables transformers reads when it is imported (the driver has set them too)

import pyarrow.parquet  # noqa: E402, F401
import torch  # noqa: E402, F401
import torch.distributed  # noqa: E402, F401
import transformers.modeling_utils  # noqa: E402, F401
from transformers import AutoConfig, AutoModelForSequenceClassification  # noqa: E402, F401

import torchloom.engines.local  # noqa: E402, F401
import torchloom.train.loop  # noqa: E402, F401
