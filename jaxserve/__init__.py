"""jaxserve: a JAX/XLA inference engine for mixture-of-experts language models."""
from __future__ import annotations

__version__ = "0.1.0"


def __getattr__(name):
    # Lazy so that `import jaxserve` (e.g. for the CLI's --help) does not import jax.
    if name == "LLM":
        from jaxserve.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "__version__"]
