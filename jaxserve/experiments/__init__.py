"""Format experiments: reproduce the article's trade-off tables on this
machine with the real default model, and add what the article did not: quality measured on
real text with bootstrap confidence intervals, and repeated seeds for sampled generation.

- ``capacity``: decode throughput against concurrency under a fixed KV byte budget, BF16 vs
  FP8 KV, up to where each runs out of KV (interleaved in one run).
- ``weights``: decode tok/s at 1 and several concurrent requests, and prefill tok/s, for
  bf16, fp8 and int4 weights and the phase-aware configuration (prefill fp8, decode int4).
- ``quality``: perplexity, KL divergence and top-1 agreement against the float32 reference
  for every KV and weight format, on CPython's pydoc topics, with bootstrap 95% intervals;
  sampled generation with repeated seeds.

CLI: ``jaxserve experiment ...`` (``cli.register``) or ``python -m jaxserve.experiments ...``.
"""
