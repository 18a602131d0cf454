"""Running the torchloom command as a user does, as another host would: its own private cache."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def torchloom(*args: str, cache: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    """`python -m torchloom ARGS` with TORCHLOOM_CACHE=cache (a host that has seen only what that cache holds)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "TORCHLOOM_CACHE": str(cache),
           "TORCHLOOM_CPU_BF16": "0"}
    return subprocess.run([sys.executable, "-m", "torchloom", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)
