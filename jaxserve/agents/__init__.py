"""What agent models write besides plain text, turned into OpenAI's message fields: tool calls
(``tool_parsers.py``: the registry and the choice by checkpoint; ``kimi_k2.py``, ``glm.py``,
``hermes.py``: one format each), reasoning (``reasoning.py``: ``<think>...</think>``), the whole
message and its stream (``message.py``), and the grammars that enforce a required or named tool
choice (``tool_grammar.py``). Pure host code: strings in, strings and dicts out.

Every parser is a *prefix parser*: ``parse(text, final)`` gives what is certain of a message
from its text so far (content with any possible start of a marker held back, the calls whose
names are known with the argument text so far). Each snapshot extends the one before, so a
stream is the differences between successive snapshots and its sum is the final parse: the
streamed result equals the non-streamed one however the text is split.
"""
