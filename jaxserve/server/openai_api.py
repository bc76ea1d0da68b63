"""The OpenAI API's JSON <-> engine objects: request bodies of /v1/chat/completions and
/v1/completions to a ``Parsed`` request (prompt, SamplingParams per choice, options), and
engine events to the response objects and stream chunks OpenAI's clients read.

Pure functions (no server state); anything wrong with a body raises ``ServeError``
(INVALID_ARGUMENT with the field at fault as ``param``, which the HTTP layer reports).
"""
from __future__ import annotations

import dataclasses
import json
import time

from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.server import agent_plan, convert, errors, openai_agent_fields as agent_fields, validate

# Fields OpenAI defines that jaxserve does not implement: a request that sets one is refused
# rather than silently served without it.
UNSUPPORTED = ("functions", "function_call", "logit_bias", "suffix", "best_of", "audio", "modalities", "prediction")
# Sampling fields beyond OpenAI's that vLLM and SGLang accept in the body as well.
EXTRA_SAMPLING = {"top_k": int, "min_p": float, "repetition_penalty": float, "ignore_eos": bool}


@dataclasses.dataclass
class Parsed:
    """One request as the server runs it."""

    chat: bool
    model: str
    messages: list[dict] | None  # chat
    prompt: str | list[int] | None  # completions: text or token ids
    sampling: dict  # SamplingParams keywords, except max_tokens (it may depend on the prompt)
    max_tokens: int | None
    n: int
    stream: bool
    include_usage: bool
    logprobs: int | None  # top alternatives per token (0: the sampled token's only); None: off
    session_id: str
    stop: list[str]
    # Structured outputs, tools, template kwargs (jaxserve.server.openai_agents).
    agent: agent_fields.AgentRequest = dataclasses.field(default_factory=agent_fields.AgentRequest)

    @property
    def text(self) -> str:
        """What gets tokenized (for the --max-prompt-bytes check): roles and contents of a chat."""
        if self.messages is not None:
            return "".join(m["role"] + m["content"] for m in self.messages) + (json.dumps(self.agent.tools) if self.agent.tools else "")
        return self.prompt if isinstance(self.prompt, str) else ""

    def params(self, prompt_len: int, max_context: int, max_n: int) -> list[SamplingParams]:
        """SamplingParams per choice. max_tokens unset: 16 for completions (OpenAI's default),
        whatever the context leaves for chat."""
        max_tokens = self.max_tokens
        if max_tokens is None:
            max_tokens = 16 if not self.chat else max_context - prompt_len
            if max_tokens < 1:
                raise errors.invalid_argument(f"the prompt ({prompt_len} tokens) fills the context "
                                              f"({max_context} tokens)", "messages")
        try:
            params = SamplingParams(max_tokens=max_tokens, stop=tuple(self.stop), logprobs=self.logprobs,
                                    **self.sampling)
        except (ValueError, TypeError) as e:
            field = str(e).split(" ", 1)[0]
            raise errors.invalid_argument(str(e), field if field.isidentifier() else None) from e
        return convert.choice_params(params, self.n, max_n)


def _get(body: dict, name: str, kind, default=None):
    """body[name] as the JSON type `kind` (``validate.typed``); default when absent or null."""
    value = body.get(name)
    if value is None:
        return default
    return validate.typed(name, value, kind, name)


def _int(body: dict, name: str, default=None, lo: int = 0):
    """body[name] as an int32 in [lo, 2^31 - 1] (the engine's own range checks follow)."""
    value = body.get(name)
    return default if value is None else validate.integer(name, value, lo, validate.INT32_MAX, name)


def _common(body: dict, chat: bool) -> dict:
    if not isinstance(body, dict):
        raise errors.invalid_argument("the body must be a JSON object")
    for name in UNSUPPORTED:
        if body.get(name) not in (None, [], {}):
            raise errors.invalid_argument(f"{name} is not supported by this server", name)
    model = _get(body, "model", str)
    if not model:
        raise errors.invalid_argument("model is required", "model")
    sampling = {"temperature": _get(body, "temperature", float, 1.0)}
    for name in ("top_p", "presence_penalty", "frequency_penalty"):
        if body.get(name) is not None:
            sampling[name] = _get(body, name, float)
    for name, kind in EXTRA_SAMPLING.items():
        if body.get(name) is not None:
            sampling[name] = _get(body, name, kind)
    sampling = validate.sampling(sampling)  # int32 / float32: the engine's types
    seed = _get(body, "seed", int)
    if seed is not None:  # OpenAI's seeds are any 64-bit integer: folded into the sampler's range
        sampling["seed"] = seed % (convert.SEED_MAX + 1)
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise errors.invalid_argument("stop must be a non-empty string or a list of them", "stop")
    stop = [validate.text(f"stop[{i}]", s, "stop") for i, s in enumerate(stop)]
    ids = body.get("stop_token_ids") or []
    sampling["stop_token_ids"] = tuple(validate.token_ids("stop_token_ids", ids, "stop_token_ids"))
    max_tokens = _int(body, "max_tokens")
    if chat:
        max_tokens = _int(body, "max_completion_tokens", max_tokens)
    options = _get(body, "stream_options", dict, {})
    return dict(chat=chat, model=model, sampling=sampling, max_tokens=max_tokens, n=_int(body, "n", 1),
                stream=_get(body, "stream", bool, False),
                include_usage=_get(options, "include_usage", bool, False),
                session_id=_get(body, "session_id", str, ""), stop=stop,
                agent=agent_fields.parse(body, chat))


def parse_chat(body: dict, max_messages: int) -> Parsed:
    """A chat body; more than `max_messages` messages are refused before any is looked at."""
    common = _common(body, chat=True)
    messages = body.get("messages")
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise errors.invalid_argument("messages must be a list of {role, content} objects", "messages")
    if len(messages) > max_messages:
        raise errors.invalid_argument(f"{len(messages)} messages; the limit is {max_messages} (--max-messages)",
                                      "messages")
    messages = [dict(m, content=_content(m.get("content"), i)) for i, m in enumerate(messages)]
    messages = agent_plan.check_messages(messages, lambda ms: validate.messages(ms, max_messages, "messages"))
    logprobs = None
    if _get(body, "logprobs", bool, False):
        logprobs = _int(body, "top_logprobs", 0)
    elif body.get("top_logprobs") is not None:
        raise errors.invalid_argument("top_logprobs needs logprobs: true", "top_logprobs")
    return Parsed(messages=messages, prompt=None, logprobs=logprobs, **common)


def _content(content, i: int) -> str:
    """A message's content: a string, or text parts [{"type": "text", "text": ...}] joined."""
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise errors.invalid_argument(f"messages[{i}].content: only text parts are supported", "messages")
        return "".join(p["text"] for p in content)
    return content


def parse_completion(body: dict, max_messages: int = 0) -> Parsed:
    """A completions body (`max_messages`: unused, the same signature as parse_chat)."""
    common = _common(body, chat=False)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    ok = isinstance(prompt, str) or (isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt))
    if not ok or not prompt:
        raise errors.invalid_argument("prompt must be a non-empty string or token id list (one prompt "
                                      "per request)", "prompt")
    if isinstance(prompt, str):
        validate.text("prompt", prompt, "prompt")
    else:
        validate.token_ids("prompt", prompt, "prompt")
    if body.get("echo"):
        raise errors.invalid_argument("echo is not supported by this server", "echo")
    return Parsed(messages=None, prompt=prompt, logprobs=_int(body, "logprobs"), **common)


# ---------------------------------------------------------------------- responses
def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int, draft_tokens: int = 0,
          accepted_draft_tokens: int = 0) -> dict:
    """OpenAI's usage object; with speculative decoding's drafts, ``completion_tokens_details``
    says how many draft tokens were accepted (completion tokens) and rejected (verified, not
    returned), as OpenAI reports a prediction's."""
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens,
           "prompt_tokens_details": {"cached_tokens": cached_tokens}}
    if draft_tokens:
        out["completion_tokens_details"] = {"accepted_prediction_tokens": accepted_draft_tokens,
                                            "rejected_prediction_tokens": draft_tokens - accepted_draft_tokens}
    return out


class TokenText:
    """Token id -> its text, for log-probs (special tokens shown; ids-only models: "token_id:N")."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def chat_logprobs(self, token_ids, logprobs) -> list[dict]:
        """Chat's logprobs.content entries: token, logprob, bytes, top_logprobs."""
        def entry(t, lp):
            text = self(t)
            return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

        return [dict(entry(t, lp), top_logprobs=[entry(a, b) for a, b in _ranked(top)])
                for t, (lp, top) in zip(token_ids, logprobs)]

    def completion_logprobs(self, token_ids, logprobs, offset: int) -> dict:
        """Completions' logprobs: tokens, token_logprobs, top_logprobs, text_offset (from `offset`)."""
        tokens = [self(t) for t in token_ids]
        offsets = []
        for tok in tokens:
            offsets.append(offset)
            offset += len(tok)
        return {"tokens": tokens, "token_logprobs": [lp for lp, _ in logprobs],
                "top_logprobs": [{self(a): b for a, b in _ranked(top)} for _, top in logprobs],
                "text_offset": offsets}


def _ranked(top: dict | None):
    return sorted((top or {}).items(), key=lambda x: -x[1])


def choice(req: Parsed, index: int, text: str, finish_reason: str | None, logprobs) -> dict:
    """One choice of a response (or, with finish_reason None and delta text, of a chunk)."""
    if req.chat:
        return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                "finish_reason": finish_reason}
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def chunk_choice(req: Parsed, index: int, text: str | None, finish_reason: str | None, logprobs,
                 first: bool = False) -> dict:
    if req.chat:
        delta = {"role": "assistant", "content": text or ""} if first else ({} if text is None else {"content": text})
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}


def envelope(req: Parsed, rid: str, model: str, created: int, fingerprint: str, chunk: bool) -> dict:
    kind = ("chat.completion" if req.chat else "text_completion") + (".chunk" if chunk and req.chat else "")
    return {"id": rid, "object": kind, "created": created, "model": model, "system_fingerprint": fingerprint}


def now() -> int:
    return int(time.time())
