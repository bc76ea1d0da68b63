"""Test-wide settings: eight virtual CPU devices, a persistent compile cache, and strict
compilation (a serving program compiled after warm-up is an error, in every engine the tests
build, subprocess servers included).

These must be set before jax is imported anywhere, which is why they live here.
"""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAXSERVE_STRICT_COMPILES", "1")

import jax  # noqa: E402

_CACHE = os.environ.get(
    "JAXSERVE_TEST_COMPILE_CACHE",
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".jax_cache"),
)
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
