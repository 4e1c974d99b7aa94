#!/usr/bin/env bash
# kvtier-npu-copy on a CUDA machine: the GPU-marked ordering tests, then the copy benchmark.
# Takes under five minutes on one GPU. Run from anywhere inside the repository:
#
#     packages/npu-copy/scripts/gpu_check.sh [OUT_DIR]     # default OUT_DIR: out/gpu-check
#
# Uses $PYTHON (default python3) when it already has a CUDA torch; otherwise creates a venv
# under OUT_DIR and installs torch from the package index (the default Linux wheel is a
# CUDA build). Where pytest and hypothesis are already there, nothing is installed (the
# package runs from the source tree), so it also works on a machine with no index.
# Writes OUT_DIR/pytest.log, OUT_DIR/bench.json and OUT_DIR/bench.txt.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
OUT="${1:-$ROOT/out/gpu-check}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
cd "$ROOT"

has_cuda_torch() {
  "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null
}

if ! has_cuda_torch "$PY"; then
  echo "== no CUDA torch in $PY: creating $OUT/venv and installing torch"
  "$PY" -m venv "$OUT/venv"
  PY="$OUT/venv/bin/python"
  "$PY" -m pip install -q --upgrade pip
  "$PY" -m pip install -q "torch>=2.6"
fi
has_test_tools() {
  "$1" -c 'import pytest, hypothesis' 2>/dev/null
}
if has_test_tools "$PY"; then
  # Offline machines (a GPU box with no package index) already have what the tests need:
  # use the package from the source tree instead of installing it.
  export PYTHONPATH="$ROOT/packages/npu-copy/src${PYTHONPATH:+:$PYTHONPATH}"
  echo "== using packages/npu-copy/src from the source tree (no install)"
else
  "$PY" -m pip install -q -e packages/npu-copy "pytest>=8" "hypothesis>=6.100"
fi
if ! has_cuda_torch "$PY"; then
  echo "torch cannot see a CUDA GPU here (torch.cuda.is_available() is false)" >&2
  exit 1
fi
"$PY" -c 'import torch; print("torch", torch.__version__, "on", torch.cuda.get_device_name())'

echo "== GPU-marked tests"
status=0
timeout 180 "$PY" -m pytest -p no:cacheprovider -m gpu -rs packages/npu-copy/tests \
  2>&1 | tee "$OUT/pytest.log" || status=1

echo "== kvtier-copy-bench"
timeout 100 "$PY" -m kvtier.npu_copy.bench --device cuda --json "$OUT/bench.json" \
  2>&1 | tee "$OUT/bench.txt" || status=1

echo "== results in $OUT (exit $status)"
exit "$status"
