"""The model ``jaxserve serve`` serves: ``load_llm(args)`` builds the ``LLM`` its flags name, in
this process (the default), or in the engine's own process (``--engine-process``: the front end
hands ``functools.partial(load_llm, args)`` to ``engine_process.EngineProcess``)."""
from __future__ import annotations

import logging
import time

log = logging.getLogger("jaxserve.server")


def load_llm(args, group=None):
    """The LLM of `jaxserve serve`'s flags; group: this process's ``multihost`` replica group
    (joined here, before the devices are used), None for one process."""
    from jaxserve.cli_args import engine_kwargs, ensure_cpu_devices, with_default_config
    from jaxserve.server import group as replica_group

    log.info("loading %s", args.model or "the default model")
    ensure_cpu_devices(replica_group.local_device_count(group, args.num_devices))
    t0 = time.perf_counter()
    from jaxserve.cli_args import enable_compile_cache, with_program_cache
    from jaxserve.llm import LLM
    from jaxserve.startup_profile import StartupProfile

    profile = StartupProfile(getattr(args, "started", t0))
    profile.add("imports (jax, jaxserve)", time.perf_counter() - t0)
    if group is None:
        kwargs = with_program_cache(with_default_config(args, engine_kwargs(args)))
    else:  # a multi-process replica keeps the jit path (no program cache): jax's own cache instead
        enable_compile_cache()
        kwargs = {**with_default_config(args, engine_kwargs(args)), "program_cache": "off"}
    num_devices = replica_group.join(group, args.num_devices) if group is not None else args.num_devices or 1
    kv_format = args.kv_format or {"prefill": "bf16", "decode": "fp8_e4m3"}.get(args.role)
    return LLM(args.model, dtype=args.dtype, kv_format=kv_format, num_devices=num_devices,
               keep_finished=0,  # each request's last output carries its completion
               role=args.role, kv_handoff_format=args.kv_handoff_format, profile=profile, **kwargs)
