"""Start-up cost of the handoff fingerprint's weight hash on the default model (SmolLM2-135M):
a host sha256 over every leaf (what it was) vs the device digest (``weights_digest``: the
same for any mesh or process layout), same process, same leaves, side by side.

    .venv/bin/python bench/handoff_digest.py   # -> bench/results/handoff_digest.json
"""
import hashlib
import json
import os
import time

import jax
import numpy as np
from flax import nnx
from jaxserve.loader import load_model
from jaxserve.disagg.programs import weights_digest
from jaxserve.checkpoint.gguf import default_model_dir


def old_digest(leaves):
    h = hashlib.sha256()
    for i, leaf in enumerate(leaves):
        a = np.ascontiguousarray(np.asarray(leaf))
        h.update(f"{i}:{a.dtype.name}:{a.shape};".encode())
        h.update(a.reshape(-1).view(np.uint8))
    return h.hexdigest()


_, model = load_model(str(default_model_dir(progress=False)))
leaves = jax.tree.leaves(nnx.split(model)[1])
nbytes = sum(x.nbytes for x in leaves)
out = {"leaves": len(leaves), "bytes": nbytes, "load_avg": os.getloadavg()[0]}
t = time.perf_counter(); weights_digest(leaves); out["device_first_s"] = time.perf_counter() - t
for rep in range(2):
    t = time.perf_counter(); old_digest(leaves); out.setdefault("sha256_s", []).append(time.perf_counter() - t)
    t = time.perf_counter(); weights_digest(leaves); out.setdefault("device_s", []).append(time.perf_counter() - t)
print(json.dumps(out))
os.makedirs("bench/results", exist_ok=True)
with open("bench/results/handoff_digest.json", "w") as f:
    json.dump(out, f, indent=1)
