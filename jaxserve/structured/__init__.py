"""Structured outputs: a per-request grammar (JSON schema, any JSON object, regex, Lark) compiled
by llguidance against the checkpoint's tokenizer into a token bitmask per decoding step.

``spec.py``: ``StructuredOutput``, what a request asks for (pure data, no llguidance);
``compiler.py``: ``GrammarCompiler``, spec -> a validated matcher, bounded in size and lexer fuel;
``constraints.py``: ``Constraints``, what the engine holds: each constrained sequence's matcher,
the packed masks of a sampling batch (computed on a worker thread while the device runs the
step), advancing the matchers with the sampled tokens, and the counters the metrics read.
"""
