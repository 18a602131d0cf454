#!/usr/bin/env bash
# Set up .venv (if needed) and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# Two xdist workers (tests/support/schedule.py: which tests share one); TORCHLOOM_TEST_WORKERS=0: in this process.
exec .venv/bin/python -m pytest -q -n "${TORCHLOOM_TEST_WORKERS:-2}" --dist loadgroup --no-loadscope-reorder "$@"
