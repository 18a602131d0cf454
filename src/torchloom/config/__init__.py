"""Typed configuration: one dataclass per stage, TOML files, `--section.key value` overrides."""

from torchloom.config.load import (
    batch_multiple,
    build,
    elastic_micro_batch,
    from_dict,
    load_saved,
    micro_batch_size,
    ranks_here,
    resolve_workers,
    save,
    to_dict,
    to_toml,
    valid_world_sizes,
    validate,
)
from torchloom.config.schema import (
    Config,
    DataConfig,
    EngineConfig,
    EvalConfig,
    ModelConfig,
    OutputConfig,
    PrepareConfig,
    TrainConfig,
)

__all__ = [
    "Config", "DataConfig", "EngineConfig", "EvalConfig", "ModelConfig", "OutputConfig", "PrepareConfig",
    "TrainConfig", "batch_multiple", "build", "elastic_micro_batch", "from_dict", "load_saved", "micro_batch_size",
    "ranks_here", "resolve_workers", "save", "to_dict", "to_toml", "valid_world_sizes", "validate",
]
