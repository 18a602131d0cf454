"""Worker side: rank-sharded streaming of a prepared split, batching, exact resume."""

from torchloom.data.eval_rows import eval_batches
from torchloom.data.loader import ShardedLoader, batch_sizes, rank_range

__all__ = ["ShardedLoader", "batch_sizes", "eval_batches", "rank_range"]
