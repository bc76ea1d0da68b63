#!/usr/bin/env bash
# gpu_check.sh on a lent GPU machine that reaches no package registry and cannot receive the
# default model (its wheel is larger than what travels). Prepare here, once, in the repo root:
#   .whl/            cp312 wheels of the packages the machine's image lacks (grpcio and its
#                    health/reflection/status, protobuf, fastapi + pydantic, uvicorn, gguf, llguidance)
#   .gpu/smollm2/    the default model's config.json, generation_config.json, tokenizer files and
#                    tensors.json ({name: [dtype, shape]} read from the converted model's safetensors
#                    header)
# (both ignored through .git/info/exclude), then run with carry [".whl", ".gpu"]:
#   bash bench/gpu_lease.sh            # gpu_check.sh, its files packed into $OUT/gpu_check.tar.gz
#   bash bench/gpu_lease.sh CMD ARGS   # or any command after the same preparation
# The SmolLM2 rows then run a checkpoint of the default model's exact shapes with random weights:
# their speed is the real model's (same bytes, same programs, EOS ignored); their tokens are not.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/gpu}
mkdir -p "$OUT"
RES=$(mktemp -d)  # gpu_check's files, packed into $OUT at the end (the lease returns few files)
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
if [ -f .gpu/smollm2/tensors.json ]; then
  python3 - <<'PY'
import json, numpy as np
from safetensors.numpy import save_file
d = ".gpu/smollm2"
spec = json.load(open(f"{d}/tensors.json"))
rng = np.random.default_rng(0)
dt = {"F32": np.float32, "F16": np.float16}
out = {}
for name, (dtype, shape) in spec.items():
    if name.endswith("norm.weight"):
        out[name] = np.ones(shape, dt[dtype])
    else:
        out[name] = (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(dt[dtype])
save_file(out, f"{d}/model.safetensors")
print("random-weight SmolLM2-135M shapes:", sum(v.size for v in out.values()), "parameters")
PY
  export SMOLLM2_MODEL=.gpu/smollm2
fi
python3 -c "import jax, jaxserve; print('jax', jax.__version__, jax.devices())" || exit 1
if [ $# -gt 0 ]; then "$@"; exit; fi
bash bench/gpu_check.sh "$RES" 2>&1 | tee "$OUT/gpu_check.log"
tar -czf "$OUT/gpu_check.tar.gz" -C "$RES" .
