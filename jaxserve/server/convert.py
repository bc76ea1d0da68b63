"""Protos <-> engine objects: requests to (prompt ids, SamplingParams), results to responses,
and the model's identity (formats per phase, fingerprint) for GetModelInfo.

Pure functions of their arguments (no engine state), so handlers call them on the event
loop; anything wrong with the input raises ``ServeError`` with the right status code.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib

import numpy as np

from jaxserve.engine.speculative.setup import describe as describe_speculative
from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.multihost.digest import shard_digest
from jaxserve.server import errors, validate
from jaxserve.v1 import jaxserve_pb2 as pb

SEED_MAX = 2**31 - 1  # the engine's sampler keeps seeds in int32
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty",
                    "presence_penalty", "frequency_penalty")
FINISH_REASONS = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH, "abort": pb.FINISH_REASON_ABORT}


MAX_ID_LENGTH = 256  # default limit on request and session ids
ID_LENGTH_CAP = 4096  # echoed ids (and the replica id) must fit in response headers


def check_id(kind: str, value: str, max_length: int) -> str:
    """A request / session id as the server echoes it in response headers: at most
    `max_length` characters of visible ASCII (0x21-0x7E; no spaces, controls or non-ASCII)."""
    if len(value) > max_length:
        raise errors.invalid_argument(f"{kind} is {len(value)} characters long; the limit is {max_length}")
    bad = next((c for c in value if not 0x21 <= ord(c) <= 0x7E), None)
    if bad is not None:
        raise errors.invalid_argument(f"{kind} contains {bad!r} (U+{ord(bad):04X}); only visible ASCII "
                                      f"(0x21-0x7E, no spaces or control characters) is allowed")
    return value


def check_id_options(max_id_length: int, replica_id: str | None) -> None:
    """Server options that end up in headers: ValueError (an operator's mistake) if unfit."""
    if not 1 <= max_id_length <= ID_LENGTH_CAP:
        raise ValueError(f"--max-id-length must be in [1, {ID_LENGTH_CAP}], got {max_id_length}")
    if replica_id is not None:
        try:
            check_id("--replica-id", replica_id, ID_LENGTH_CAP)
        except errors.ServeError as e:
            raise ValueError(e.message) from None


def sampling_params(req: pb.GenerateRequest) -> SamplingParams:
    """Only the fields the client set reach SamplingParams (unset = the engine default)."""
    kw = validate.sampling({f: getattr(req.sampling, f) for f in _SAMPLING_FIELDS if req.sampling.HasField(f)})
    if "seed" in kw and not 0 <= kw["seed"] <= SEED_MAX:
        raise errors.invalid_argument(f"seed must be in [0, {SEED_MAX}], got {kw['seed']}")
    if req.sampling.HasField("logprobs"):
        kw["logprobs"] = req.sampling.logprobs
    stop = req.stop
    if stop.HasField("max_tokens"):
        kw["max_tokens"] = validate.integer("max_tokens", stop.max_tokens)
    if stop.HasField("ignore_eos"):
        kw["ignore_eos"] = stop.ignore_eos
    kw["stop"] = tuple(stop.stop)
    kw["stop_token_ids"] = tuple(validate.token_ids("stop_token_ids", list(stop.stop_token_ids)))
    if req.HasField("structured"):
        kw["structured"] = structured_output(req.structured)
    try:
        return SamplingParams(**kw)
    except (ValueError, TypeError) as e:
        raise errors.invalid_argument(str(e)) from e


def structured_output(so: pb.StructuredOutput):
    """The proto's grammar -> a StructuredOutput (INVALID_ARGUMENT when none is set)."""
    from jaxserve.structured.spec import StructuredOutput

    kind = so.WhichOneof("kind")
    if kind is None or (kind == "json_object" and not so.json_object):
        raise errors.invalid_argument("structured: set one of json_schema, json_object, regex, grammar")
    try:
        return StructuredOutput(kind, "" if kind == "json_object" else getattr(so, kind))
    except ValueError as e:
        raise errors.invalid_argument(f"structured: {e}") from None


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice `index` of a request with `seed` (n > 1): choice 0 keeps the seed,
    so n=1 and choice 0 of n=k sample the same tokens; None stays None (the engine draws)."""
    if seed is None or index == 0:
        return seed
    digest = hashlib.sha256(f"jaxserve-choice:{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:4], "little") % (SEED_MAX + 1)


def choice_params(params: SamplingParams, n: int, max_n: int) -> list[SamplingParams]:
    """One SamplingParams per choice (n in [1, max_n], else INVALID_ARGUMENT naming `n`)."""
    if not 1 <= n <= max_n:
        raise errors.invalid_argument(f"n must be in [1, {max_n}] (the server's max_num_seqs), got {n}")
    return [dataclasses.replace(params, seed=choice_seed(params.seed, i)) for i in range(n)]


def _need_tokenizer(tokenizer, what: str):
    if tokenizer is None:
        raise errors.failed_precondition(f"this model has no tokenizer: {what}")


def encode_text(tokenizer, text: str, chat_template: bool, add_special_tokens: bool = True) -> list[int]:
    """Text -> ids exactly as ``LLM.generate`` tokenizes a string prompt."""
    _need_tokenizer(tokenizer, "send token ids instead of text")
    if chat_template:
        if not tokenizer.chat_template:
            raise errors.failed_precondition("this model has no chat template")
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}])
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def check_messages(messages, max_messages: int) -> list[dict]:
    """Chat messages [{"role", "content"}]: at most `max_messages`, string roles and contents,
    valid Unicode, non-empty (``validate.messages``)."""
    return validate.messages(messages, max_messages)


def encode_chat(tokenizer, messages: list[dict]) -> list[int]:
    """A conversation -> ids: the model's chat template (ending with the assistant's turn to
    answer), then encoded as ``encode_text`` encodes a templated text."""
    _need_tokenizer(tokenizer, "chat messages need the model's tokenizer and chat template")
    if not tokenizer.chat_template:
        raise errors.failed_precondition("this model has no chat template")
    try:
        text = tokenizer.apply_chat_template(messages)
    except Exception as e:  # the template may raise (e.g. roles out of order)
        raise errors.invalid_argument(f"the chat template rejected the messages: {e}") from e
    return tokenizer.encode(text)


def prompt_ids(req: pb.GenerateRequest, tokenizer, max_messages: int) -> list[int]:
    kind = req.WhichOneof("prompt")
    if req.messages:
        if kind is not None or req.apply_chat_template:
            raise errors.invalid_argument("set messages or a prompt (text / token_ids), not both")
        messages = check_messages([{"role": m.role, "content": m.content} for m in req.messages], max_messages)
        return encode_chat(tokenizer, messages)
    if kind is None:
        raise errors.invalid_argument("empty prompt: set text, token_ids or messages")
    if kind == "token_ids":
        if req.apply_chat_template:
            raise errors.invalid_argument("apply_chat_template needs a text prompt")
        ids = validate.token_ids("token_ids", list(req.token_ids.ids))
    else:
        ids = encode_text(tokenizer, req.text, req.apply_chat_template)
    if not ids:
        raise errors.invalid_argument("empty prompt")
    return ids


def decode_ids(tokenizer, ids, vocab_size: int, skip_special_tokens: bool) -> str:
    _need_tokenizer(tokenizer, "nothing to detokenize with")
    bad = [t for t in ids if t >= vocab_size]
    if bad:
        raise errors.invalid_argument(f"token id {bad[0]} outside the vocabulary [0, {vocab_size})")
    return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


# ---------------------------------------------------------------------- results
def usage(u) -> pb.Usage:
    return pb.Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens, cached_tokens=u.cached_tokens,
                    draft_tokens=u.draft_tokens, accepted_draft_tokens=u.accepted_draft_tokens)


def generate_response(request_id: str, session_id: str, ids, texts, lps, ends) -> pb.GenerateResponse:
    """A whole Generate reply from each choice's ids, texts, logprobs and end (reason, usage,
    TTFT, total seconds): choice 0 in the top-level fields; with n > 1 every choice in `choices` and the
    usage of all together (the prompt counted once)."""
    (reason, u, ttft, total), n = ends[0], len(ends)
    resp = pb.GenerateResponse(
        request_id=request_id, session_id=session_id, token_ids=ids[0], text=texts[0],
        finish_reason=FINISH_REASONS[reason], usage=usage(u),
        timing=timing(ttft, total), logprobs=lps[0])
    if n > 1:
        resp.usage.completion_tokens = sum(e[1].completion_tokens for e in ends)
        firsts = [e[2] for e in ends if e[2] is not None]
        resp.timing.CopyFrom(timing(min(firsts) if firsts else None, max(e[3] for e in ends)))
        resp.choices.extend(pb.Choice(index=i, token_ids=ids[i], text=texts[i], logprobs=lps[i],
                                      finish_reason=FINISH_REASONS[ends[i][0]],
                                      completion_tokens=ends[i][1].completion_tokens) for i in range(n))
    return resp


def token_logprobs(token_ids, logprobs) -> list[pb.TokenLogprob]:
    """Engine log-probs [(logprob, {id: logprob})] of `token_ids` -> TokenLogprob messages."""
    if logprobs is None:
        return []
    return [pb.TokenLogprob(token_id=t, logprob=lp, top=[pb.TopLogprob(token_id=i, logprob=v)
                                                         for i, v in sorted((top or {}).items(), key=lambda x: -x[1])])
            for t, (lp, top) in zip(token_ids, logprobs)]


def timing(ttft_s: float | None, total_s: float) -> pb.Timing:
    t = pb.Timing(total_s=total_s)
    if ttft_s is not None:
        t.time_to_first_token_s = ttft_s
    return t


# ---------------------------------------------------------------------- model identity
def phase_formats(llm) -> dict[str, dict[str, str]]:
    """Weight and KV formats per phase: the weight format each phase's program reads
    (``LLM.weight_formats``: prefill reads the decode copy under
    prefill_from_decode_weights; unset = as loaded, reported as the loaded dtype) and the KV
    format of the one page pool both phases share; a prefill worker holds no decode weights
    ("not held")."""
    paths, held = llm.weight_paths(), llm.weight_formats()
    return {phase: {"weights": str(held[phase] or llm.dtype) if phase in held else "not held",
                    "kv_cache": llm.fmt.name, "matmul_path": paths[phase]}
            for phase in ("prefill", "decode")}


def fingerprint(params, formats: dict, peer_digests=()) -> str:
    """sha256 over every weight (index, dtype, shape, bytes, in load order) + the formats. A
    weight sharded over several processes (a multi-process replica) is hashed as the shards
    this process owns plus ``peer_digests``, the other processes' ``shard_digest``s."""
    h = hashlib.sha256()
    h.update(shard_digest(params).encode())
    for d in peer_digests:
        h.update(d.encode())
    for i, leaf in enumerate(params):
        if not getattr(leaf, "is_fully_addressable", True):
            continue  # in shard_digest
        a = np.ascontiguousarray(np.asarray(leaf))
        h.update(f"{i}:{a.dtype.name}:{a.shape};".encode())
        h.update(a.reshape(-1).view(np.uint8))  # byte view: works for bfloat16 / fp8 too
    h.update(json.dumps(formats, sort_keys=True).encode())
    return h.hexdigest()


def model_name(llm) -> str:
    """The checkpoint's directory name: GetModelInfo never discloses where it lives."""
    path = str(getattr(llm, "model_path", "") or "")
    return pathlib.PurePath(path).name if path else ""


def model_info(llm, max_waiting: int, replica_id: str, peer_digests=()) -> pb.ModelInfo:
    """The static part of GetModelInfo (kv_pages is filled per call). Hashes every weight:
    call once at startup (``peer_digests``: see ``fingerprint``)."""
    formats = phase_formats(llm)
    eng = llm.engine
    tok = llm.tokenizer
    return pb.ModelInfo(
        architecture=llm.cfg.architecture,
        model=model_name(llm),
        dtype=llm.dtype,
        prefill=pb.PhaseFormats(**formats["prefill"]),
        decode=pb.PhaseFormats(**formats["decode"]),
        page_size=eng.config.page_size,
        num_pages=eng.config.num_pages,
        max_context=eng.max_model_len,
        vocab_size=llm.cfg.vocab_size,
        fingerprint=fingerprint(llm.weights(), formats, peer_digests),
        has_tokenizer=tok is not None,
        eos_token_ids=sorted(eng.eos_token_ids),
        max_num_seqs=eng.config.max_num_seqs,
        max_waiting=max_waiting,
        integrity_check=eng.config.integrity_check,
        replica_id=replica_id,
        memory=memory_report(llm.memory_report()),
        role=eng.config.role,
        kv_layout=eng.kv_layout(),
        handoff_fingerprint=eng.handoff_fingerprint(),
        speculative=describe_speculative(eng.config),
    )


def memory_report(rep: dict) -> pb.MemoryReport:
    w = rep["weight_bytes"]
    return pb.MemoryReport(
        weight_bytes_prefill=w["prefill"], weight_bytes_decode=w["decode"], weight_bytes_resident=w["resident"],
        kv_bytes=rep["kv_bytes"], kv_pages=rep["kv_pages"], kv_bytes_per_token=rep["kv_bytes_per_token"],
        max_cached_tokens=rep["max_cached_tokens"],
    )
