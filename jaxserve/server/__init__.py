"""The gRPC server: ``jaxserve.v1.JaxServe`` on grpc.aio, plus health, reflection and metrics.

- ``app.py``: ``Server`` (grpc.aio + health + reflection + Prometheus; warm-up, drain) and
  ``ServerThread`` (a Server on a background loop, for synchronous callers).
- ``service.py``: the servicer: validation, streams, error mapping, outcome accounting.
- ``guard.py``: the interceptor in front of every handler: API keys, unparsable request bytes.
- ``auth.py``: API keys (identities) and TLS server credentials.
- ``engine_thread.py``: the engine thread, the only code that touches the LLMEngine;
  ``engine_loop.py``: that thread as the event loop sees it (in this process), and
  ``engine_process.py`` / ``process_engine_loop.py`` / ``engine_worker.py`` /
  ``engine_messages.py``: in a process of its own (``--engine-process``). ``served_model.py``: what the server reads of the model;
  ``model_load.py``: the LLM ``jaxserve serve`` builds.
- ``convert.py``: protos <-> SamplingParams / prompt ids / ModelInfo (formats, fingerprint).
- (``jaxserve.v1.KvHandoff``, its transports and the prefill -> decode client live in the
  disaggregation wing, ``jaxserve.disagg``; ``app.py`` serves its ``service.py``.)
- ``errors.py``: the error catalogue (status codes, retry info).
- ``metrics.py``: the Prometheus metrics.
- ``cli.py``: ``jaxserve serve`` (and ``client_cli.py``: ``jaxserve client``); ``gen_protos.py``
  regenerates stubs.

Nothing is imported here, so ``jaxserve.client`` stays light (no jax).
"""
