"""The torchrun engine: one worker, for launchers torchloom does not drive itself (torchrun on each node).

    torchrun --nnodes N --nproc-per-node 8 ... -m torchloom.engines.torchrun --output.dir RUN [--config F] [--k v ...]

The same config options as `torchloom train`; the run directory must hold prepared data and be on
storage every node sees. A restart by torchrun (--max-restarts) resumes from the latest checkpoint.
"""

from __future__ import annotations

import os
import sys

from torchloom.config import build, to_dict
from torchloom.engines.common import run_worker
from torchloom.errors import UserError
from torchloom.rundir import RunDir


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    config_file = None
    if "--config" in argv:
        i = argv.index("--config")
        config_file = argv[i + 1] if i + 1 < len(argv) else None
        del argv[i:i + 2]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        cfg = build(config_file, argv)
    except UserError as e:
        print(f"torchloom: error: {e}", file=sys.stderr)
        return 2
    # torchrun gives every launch a run id (TORCHELASTIC_RUN_ID); restarts keep it.
    launch_id = os.environ.get("TORCHELASTIC_RUN_ID", "torchrun")
    try:
        run_worker(to_dict(cfg), str(RunDir(cfg.output.dir).root), launch_id)
    except UserError as e:  # one line, not a traceback; torchrun reports the exit code
        print(f"torchloom: error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
