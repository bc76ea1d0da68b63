"""What the server reads of the model it serves, wherever its engine runs.

``Server`` and the fronts never touch an ``LLM`` directly: they read a ``ServedModel``, of two
kinds:
- ``LocalModel``: an ``LLM`` (or ``jaxserve.testing.MockLLM``) in this process, its engine on a
  thread of this process (``engine_loop.EngineLoop``); what KV handoff and multi-process
  replicas need (they reach the engine itself);
- ``engine_process.EngineProcess``: the engine in a process of its own, so that what the event
  loop does (stream set-ups, refusals, parsing) never holds the engine's interpreter.
"""
from __future__ import annotations

import asyncio
from typing import Callable

from jaxserve.server import convert
from jaxserve.v1 import jaxserve_pb2 as pb


class ServedModel:
    """tokenizer (None: token ids only), cfg (the model's config: architecture, model_type,
    vocab_size), programs (``compiled`` / ``loaded`` counts, warm-up progress), engine (the
    ``LLMEngine`` when it lives in this process, else None)."""

    tokenizer = None
    cfg = None
    programs = None
    engine = None

    def model_info(self, max_waiting: int, replica_id: str, peer_digests=()) -> pb.ModelInfo:
        """GetModelInfo's static part (``convert.model_info``)."""
        raise NotImplementedError

    def weight_path_rows(self) -> dict:
        """Per phase, the matmul path of each weight (``LLM.weight_path_rows``)."""
        raise NotImplementedError

    def check_structured(self, spec) -> None:
        """Raise ValueError if the grammar ``spec`` cannot compile (blocking; any thread)."""
        raise NotImplementedError

    def engine_loop(self, metrics, loop: asyncio.AbstractEventLoop, on_ready: Callable[[], None],
                    on_failed: Callable[[BaseException], None], on_lost: Callable[[str], None],
                    explain_error=None, on_progress=None, serve_while_warming: bool = False):
        """The engine as the event loop sees it (``engine_loop``'s interface). on_lost(reason):
        the engine is gone while serving (its process died)."""
        raise NotImplementedError


class LocalModel(ServedModel):
    def __init__(self, llm):
        self.llm = llm
        self.tokenizer, self.cfg, self.engine = llm.tokenizer, llm.cfg, llm.engine
        self.programs = llm.engine.programs

    def model_info(self, max_waiting: int, replica_id: str, peer_digests=()) -> pb.ModelInfo:
        return convert.model_info(self.llm, max_waiting, replica_id, peer_digests)

    def weight_path_rows(self) -> dict:
        return self.llm.weight_path_rows()

    def check_structured(self, spec) -> None:
        self.engine.check_structured(spec)

    def engine_loop(self, metrics, loop, on_ready, on_failed, on_lost, explain_error=None, on_progress=None,
                    serve_while_warming: bool = False):
        from jaxserve.server.engine_loop import EngineLoop

        return EngineLoop(self.engine, metrics, loop, on_ready, on_failed, explain_error=explain_error,
                          on_progress=on_progress, serve_while_warming=serve_while_warming)


def served(model) -> ServedModel:
    """``model`` as a ServedModel: itself if it is one, else an LLM in this process."""
    return model if isinstance(model, ServedModel) else LocalModel(model)
