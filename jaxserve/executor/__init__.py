"""Program execution: the model runner (``runner.py``: weights, KV pools, page generations, the
calls) composed of its parts (``step_programs.py``, ``weights.py``, ``state.py``, ``guard.py``, and
the disaggregation wing's ``HandoffCalls``: ``jaxserve.disagg.programs``), the padding buckets
every bucketed program uses (``buckets.py``), the ahead-of-time program set and its disk cache
(``programs.py``, ``program_cache.py``), the one interface of the ahead-of-time and jit paths
(``sources.py``) and warm-up (``warmup.py``). It imports no engine code."""
