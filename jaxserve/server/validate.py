"""Request values checked at the edge into the engine's own types and ranges, for the gRPC
service (``convert``) and the OpenAI HTTP API (``openai_api``) alike.

The engine keeps integers as int32 (top_k, seeds, token ids, counts) and sampling floats as
float32, and its tokenizer takes only valid Unicode. A value outside those is refused here,
as INVALID_ARGUMENT naming the field, before it can reach a step shared with other requests:
a JSON integer has no bound (``top_k: 2147483648`` overflowed an int32 array inside a step
and failed every request in flight), a 401-digit integer overflows a float, a JSON string may
carry a lone surrogate (``"\\ud800"``) that no tokenizer encodes. A JSON body's nesting is
bounded (the parser recurses once per level).
"""
from __future__ import annotations

import json
import math

from jaxserve.engine.sampling_params import as_float32
from jaxserve.server import errors

INT32_MAX = 2**31 - 1
MAX_JSON_DEPTH = 64  # default --max-json-depth: OpenAI's bodies nest 5 levels at most
# The sampling fields and their kinds (SamplingParams then checks each one's range).
SAMPLING_INTS = ("top_k",)
SAMPLING_FLOATS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
_KINDS = {int: "an integer", float: "a number", bool: "a boolean", str: "a string", dict: "an object",
          list: "a list"}


def _bad(name: str, message: str, param: str | None):
    return errors.invalid_argument(f"{name} {message}", param)


def integer(name: str, value, lo: int = 0, hi: int = INT32_MAX, param: str | None = None) -> int:
    """An integer (not a bool) in [lo, hi] (default: a non-negative int32)."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise _bad(name, f"must be an integer, got {_short(value)}", param)
    if not lo <= value <= hi:
        raise _bad(name, f"must be in [{lo}, {hi}], got {_short(value)}", param)
    return value


def number(name: str, value, param: str | None = None) -> float:
    """A number (int or float, not a bool) that is finite as a float32 (the sampler's type);
    its range is SamplingParams' to check."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise _bad(name, f"must be a number, got {_short(value)}", param)
    try:
        x = float(value)
    except OverflowError:  # an integer of hundreds of digits
        raise _bad(name, f"must be finite as a float32, got an integer of about {_digits(value)} digits",
                   param) from None
    if not math.isfinite(x) or not math.isfinite(as_float32(x)):
        raise _bad(name, f"must be finite as a float32 (the precision the sampler uses), got {x!r}", param)
    return x


def text(name: str, value, param: str | None = None) -> str:
    """A string of valid Unicode: no lone surrogate (U+D800-U+DFFF), which has no UTF-8 form."""
    if not isinstance(value, str):
        raise _bad(name, f"must be a string, got {_short(value)}", param)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise _bad(name, f"is not valid Unicode: a lone surrogate U+{ord(value[e.start]):04X} at "
                         f"character {e.start}", param) from None
    return value


def typed(name: str, value, kind, param: str | None = None):
    """``value`` of the JSON type ``kind`` (bool is not an int; ints count as numbers)."""
    if kind is int:
        return integer(name, value, -(2**63), 2**63 - 1, param)
    if kind is float:
        return number(name, value, param)
    if kind is str:
        return text(name, value, param)
    if not isinstance(value, kind):
        raise _bad(name, f"must be {_KINDS[kind]}, got {_short(value)}", param)
    return value


def sampling(values: dict, param=lambda name: name) -> dict:
    """The sampling fields present in ``values`` in the engine's types: top_k a non-negative
    int32, the floats finite float32 (``param(name)``: the field name to report)."""
    out = {}
    for name, value in values.items():
        if name in SAMPLING_INTS:
            out[name] = integer(name, value, param=param(name))
        elif name in SAMPLING_FLOATS:
            out[name] = number(name, value, param=param(name))
        else:
            out[name] = value
    return out


def token_ids(name: str, ids, param: str | None = None) -> list[int]:
    """A list of token ids, each a non-negative int32 (the vocabulary check is the engine's)."""
    if not isinstance(ids, list):
        raise _bad(name, "must be a list of token ids", param)
    bad = next((t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t <= INT32_MAX), None)
    if bad is not None:
        raise _bad(name, f"holds token id {_short(bad)}, outside the vocabulary (and the int32 range "
                         f"[0, {INT32_MAX}])", param)
    return ids


def messages(items, max_messages: int, param: str | None = None) -> list[dict]:
    """Chat messages [{"role", "content"}]: at most ``max_messages`` (checked before anything
    else looks at them), non-empty string roles, string contents, all valid Unicode."""
    if not items:
        raise _bad("messages", "is empty", param)
    if len(items) > max_messages:
        raise errors.invalid_argument(f"{len(items)} messages; the limit is {max_messages} (--max-messages)", param)
    out = []
    for i, m in enumerate(items):
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not role:
            raise _bad(f"messages[{i}].role", "must be a non-empty string", param)
        out.append({"role": text(f"messages[{i}].role", role, param),
                    "content": text(f"messages[{i}].content", content, param)})
    return out


# ---------------------------------------------------------------------- JSON bodies
def json_depth(value, limit: int) -> int:
    """The nesting depth of a parsed JSON value, counted without recursion, stopping once it
    passes `limit` (-> limit + 1)."""
    depth, level = 0, [value]
    while level:
        level = [v for x in level if isinstance(x, (list, dict)) for v in (x.values() if isinstance(x, dict) else x)]
        depth += 1
        if depth > limit:
            return depth
    return depth - 1 if depth else 0


def parse_json(body: bytes, max_depth: int = MAX_JSON_DEPTH):
    """A request body -> its JSON value, or INVALID_ARGUMENT: not UTF-8, not JSON, or nested
    deeper than ``max_depth``. Fewer brackets than the limit cannot nest past it (the usual
    case: one count); otherwise the parser, which refuses at once what nests past the
    interpreter's recursion limit (RecursionError, caught: a 100,000-level body costs
    microseconds), and then a level-by-level walk of what it built."""
    try:
        value = json.loads(body)
    except RecursionError:
        value, deep = None, True
    except (ValueError, UnicodeDecodeError) as e:
        raise errors.invalid_argument(f"the body is not valid JSON: {e}") from None
    else:
        deep = body.count(b"[") + body.count(b"{") > max_depth and json_depth(value, max_depth) > max_depth
    if deep:
        raise errors.invalid_argument(f"the body nests deeper than {max_depth} levels (--max-json-depth)")
    return value


def _short(value) -> str:
    """A value for an error message: long reprs (a 401-digit integer, a huge list) cut."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 10**30:
        return f"an integer of about {_digits(value)} digits"
    r = repr(value)
    return r if len(r) <= 80 else r[:77] + "..."


def _digits(value: int) -> int:
    """Decimal digits of an integer, without converting it (Python refuses str() past 4300)."""
    return int(value.bit_length() * math.log10(2)) + 1
