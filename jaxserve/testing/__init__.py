"""Test support shipped with the package: ``MockEngine`` (``LLMEngine``'s public interface with
arithmetic a test checks by hand, over the engine's own scheduler, block manager and output
processor) and ``MockLLM`` (what the server reads of ``jaxserve.LLM``, over it), so the gRPC and
HTTP servers and the router are tested end to end without a model."""
from jaxserve.testing.mock_engine import MockEngine, next_token
from jaxserve.testing.mock_llm import MockLLM, char_ids, char_tokenizer, greedy_ids

__all__ = ["MockEngine", "MockLLM", "char_ids", "char_tokenizer", "greedy_ids", "next_token"]
