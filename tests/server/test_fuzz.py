"""Whatever a client sends, the answer is a status it caused (never INTERNAL or UNKNOWN),
nothing is logged as an error, and the server then still gives the exact greedy tokens.

Requests go through a generic channel with identity serializers, so the bytes on the wire
are exactly what the strategies drew: valid messages with hostile field values, and raw
bytes that may not parse at all. Seeded (derandomized) and bounded. On the mock engine's
server (``mock_served``): no model runs, the tokens are the mock's arithmetic.
"""
import logging

import grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxserve.v1 import jaxserve_pb2 as pb

from .conftest import mock_cases

SERVICE = "/jaxserve.v1.JaxServe/"
# path -> kind; health and reflection get raw bytes too (their messages are not ours to fuzz).
METHODS = {SERVICE + name: kind for name, kind in (
    ("Generate", "unary"), ("GenerateStream", "stream"), ("Tokenize", "unary"), ("Detokenize", "unary"),
    ("GetModelInfo", "unary"), ("Abort", "unary"))}
METHODS.update({"/grpc.health.v1.Health/Check": "unary", "/grpc.health.v1.Health/Watch": "stream",
                "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo": "bidi"})
BUGS = (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)
SETTINGS = dict(derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck))

U32 = st.integers(0, 2**32 - 1)
TOKEN = st.one_of(st.integers(0, 49151), U32)
FLOAT = st.floats(allow_nan=True, allow_infinity=True)
VISIBLE = st.characters(min_codepoint=0x21, max_codepoint=0x7E)
IDS = st.one_of(st.text(max_size=10), st.text(VISIBLE, min_size=250, max_size=300),
                st.sampled_from(["", "fuzz-id", "a b", "\x00", "\u00e9", "\u2028", "x" * 20000]))
HEADER = st.one_of(st.none(), st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=300))
# Invalid UTF-8 inside string fields (request_id, text) and a truncated length prefix.
WIRE = [b"\x0a\x02\xc3\x28", b"\x12\x03\xed\xa0\x80", b"\x1a\x05\x0a\x03\x01", b"\x22\xff\xff\xff\xff\x0f"]


def _maybe(draw, strategy):
    return draw(st.one_of(st.none(), strategy))


# Field values a valid request may carry (half the requests use only these, so they run for real).
SANE = {
    "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "min_p": st.floats(0, 1),
    "repetition_penalty": st.floats(0.5, 2), "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2), "top_k": st.integers(0, 300), "seed": st.integers(0, 2**31 - 1),
}
WILD = {name: FLOAT for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                                 "frequency_penalty")}
WILD.update(top_k=st.integers(-2**31, 2**31 - 1), seed=st.integers(-2**63, 2**63 - 1))


@st.composite
def generate_requests(draw):
    wild = draw(st.booleans())
    ids = IDS if wild else st.one_of(st.text(VISIBLE, max_size=12), st.text(VISIBLE, max_size=12), IDS)
    req = pb.GenerateRequest(request_id=draw(ids), session_id=draw(ids),
                             apply_chat_template=draw(st.booleans()) if wild else False)
    kind = draw(st.sampled_from([None, "text", "ids"] if wild else ["text", "ids"]))
    if kind == "text":
        req.text = draw(st.text(max_size=24, min_size=0 if wild else 1))
    elif kind == "ids":
        req.token_ids.SetInParent()
        req.token_ids.ids.extend(draw(st.lists(TOKEN, max_size=6) if wild else
                                      st.lists(st.integers(0, 49151), min_size=1, max_size=6)))
    for name, values in (WILD if wild else SANE).items():
        value = _maybe(draw, values)
        if value is not None:
            setattr(req.sampling, name, value)
    # Short generations only (a valid request runs for real): 0-4 tokens, the default 16, or huge.
    max_tokens = _maybe(draw, st.one_of(st.integers(0, 4), st.integers(2**31, 2**32 - 1)) if wild else
                        st.integers(1, 4))
    if max_tokens is not None:
        req.stop.max_tokens = max_tokens
    req.stop.stop.extend(draw(st.lists(st.text(max_size=3, min_size=0 if wild else 1), max_size=2)))
    req.stop.stop_token_ids.extend(draw(st.lists(TOKEN if wild else st.integers(0, 49151), max_size=3)))
    ignore_eos = _maybe(draw, st.booleans())
    if ignore_eos is not None:
        req.stop.ignore_eos = ignore_eos
    return req.SerializeToString()


def _other_requests():
    def tokenize(text, add, chat):
        req = pb.TokenizeRequest(text=text, apply_chat_template=chat)
        if add is not None:
            req.add_special_tokens = add
        return req.SerializeToString()

    def detokenize(ids, skip):
        req = pb.DetokenizeRequest(token_ids=ids)
        if skip is not None:
            req.skip_special_tokens = skip
        return req.SerializeToString()

    return st.one_of(
        st.tuples(st.just("Tokenize"), st.builds(tokenize, st.text(max_size=40), st.one_of(st.none(), st.booleans()),
                                                  st.booleans())),
        st.tuples(st.just("Detokenize"), st.builds(detokenize, st.lists(TOKEN, max_size=8),
                                                    st.one_of(st.none(), st.booleans()))),
        st.tuples(st.just("Abort"), st.builds(lambda ids: pb.AbortRequest(request_ids=ids).SerializeToString(),
                                               st.lists(IDS, max_size=4))),
        st.tuples(st.just("GetModelInfo"), st.just(b"")),
    )


def _call(channel, method: str, data: bytes, metadata=None):
    """Send raw bytes (identity serializers) -> (status code, details)."""
    path = method if method.startswith("/") else SERVICE + method
    kind = METHODS[path]
    try:
        if kind == "unary":
            channel.unary_unary(path)(data, timeout=60, metadata=metadata)
        else:
            call = (channel.unary_stream(path)(data, timeout=5, metadata=metadata) if kind == "stream" else
                    channel.stream_stream(path)(iter([data]), timeout=5, metadata=metadata))
            for _ in call:
                if path.endswith("/Watch"):  # an open-ended stream: its first answer is enough
                    call.cancel()
                    break
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.CANCELLED and path.endswith("/Watch"):
            return grpc.StatusCode.OK, ""
        return e.code(), e.details()


def test_no_request_gets_internal_or_unknown_and_serving_continues(mock_served, caplog):
    seen = {}

    def check(method, data, metadata=None):
        code, details = _call(channel, method, data, metadata)
        assert code not in BUGS, (method, data, metadata, details)
        seen[code] = seen.get(code, 0) + 1

    @settings(max_examples=120, **SETTINGS)
    @given(generate_requests(), HEADER)
    def fuzz_generate(data, session_header):
        md = (("x-session-affinity", session_header),) if session_header is not None else None
        check("Generate", data, md)
        check("GenerateStream", data, md)

    @settings(max_examples=150, **SETTINGS)
    @given(st.sampled_from(sorted(METHODS)), st.one_of(st.binary(max_size=48), st.sampled_from(WIRE)))
    def fuzz_bytes(method, data):
        check(method, data)

    @settings(max_examples=80, **SETTINGS)
    @given(_other_requests())
    def fuzz_others(case):
        check(*case)

    with caplog.at_level(logging.WARNING), grpc.insecure_channel(mock_served.target) as channel:
        fuzz_generate()
        fuzz_bytes()
        fuzz_others()
    assert seen.get(grpc.StatusCode.OK, 0) >= 20 and seen.get(grpc.StatusCode.INVALID_ARGUMENT, 0) >= 100, seen
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors[:5]]
    assert mock_served.kv().used == 0 and mock_served.server.engine_loop.waiting == 0
    for name in ("ids_greedy", "text_greedy"):  # the mock's arithmetic: each token the previous + 1
        prompt, kw, want = mock_cases()[name]
        r = mock_served.client.generate(prompt, **kw)
        assert (list(r.token_ids), r.text) == (list(want), want.text)
