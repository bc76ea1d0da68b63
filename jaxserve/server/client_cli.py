"""``jaxserve client``: talk to a running ``jaxserve serve`` (``register_client(sub)`` adds it
to an argparse subparsers object). Imports no jax, so it starts at once.
"""
from __future__ import annotations

import argparse
import json
import sys


def _ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by spaces or commas, got {text!r}")


def register_client(sub) -> None:
    p = sub.add_parser("client", help="talk to a running `jaxserve serve` over gRPC")
    p.add_argument("--target", default="127.0.0.1:50051", help="server host:port")
    p.add_argument("--timeout", type=float, default=None, help="deadline per call, seconds")
    p.add_argument("--api-key", default=None,
                   help="API key sent as `authorization: Bearer <key>` (default: $JAXSERVE_API_KEY)")
    p.add_argument("--tls", action="store_true", help="connect with TLS (system root certificates unless --tls-ca)")
    p.add_argument("--tls-ca", default=None, help="PEM root certificate(s) to verify the server with (implies --tls)")
    p.add_argument("--tls-cert", default=None, help="PEM client certificate, for a server that requires one (mTLS)")
    p.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    csub = p.add_subparsers(dest="client_command", required=True)

    g = csub.add_parser("generate", help="generate from a text prompt (or --prompt-ids)")
    g.add_argument("prompt", nargs="?", default=None)
    g.add_argument("--prompt-ids", type=_ids, default=None, help="token ids '1,2,3' instead of text")
    g.add_argument("--stream", action="store_true", help="print tokens as they arrive")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--chat-template", action=argparse.BooleanOptionalAction, default=True,
                   help="wrap the text prompt in the model's chat template as a user turn")
    g.add_argument("--session", default="", help="session id (sent as x-session-affinity)")
    g.add_argument("--request-id", default="")
    _agent_arguments(g)
    g.set_defaults(func=_client_generate)

    csub.add_parser("info", help="model info (JSON)").set_defaults(func=_client_info)
    h = csub.add_parser("health", help="grpc.health.v1 status")
    h.add_argument("--wait", type=float, default=0.0, help="wait up to this many seconds for SERVING")
    h.set_defaults(func=_client_health)
    t = csub.add_parser("tokenize", help="text -> token ids")
    t.add_argument("text")
    t.add_argument("--chat-template", action="store_true")
    t.set_defaults(func=_client_tokenize)
    d = csub.add_parser("detokenize", help="token ids -> text")
    d.add_argument("ids", type=_ids)
    d.set_defaults(func=_client_detokenize)
    a = csub.add_parser("abort", help="abort running requests by id")
    a.add_argument("request_ids", nargs="+")
    a.set_defaults(func=_client_abort)


def _agent_arguments(g) -> None:
    """Structured outputs and tools (a text prompt with any of them goes as one user turn)."""
    c = g.add_mutually_exclusive_group()
    c.add_argument("--json-schema", default=None, help="constrain the output to this JSON schema (JSON text or @FILE)")
    c.add_argument("--json-object", action="store_true", help="constrain the output to a JSON object")
    c.add_argument("--regex", default=None, help="constrain the output to match this regex")
    c.add_argument("--grammar", default=None, help="constrain the output to this Lark grammar (text or @FILE)")
    g.add_argument("--tools", default=None,
                   help="functions the model may call: a JSON list of OpenAI tools or functions (or @FILE)")
    g.add_argument("--tool-choice", default=None,
                   help="none | auto | required | the NAME of a function that must be called")
    g.add_argument("--parallel-tool-calls", action=argparse.BooleanOptionalAction, default=None,
                   help="let the model make several calls (server default: yes)")


def _text_or_file(value: str | None) -> str | None:
    if value is not None and value.startswith("@"):
        with open(value[1:], encoding="utf-8") as f:
            return f.read()
    return value


def agent_kwargs(args) -> dict:
    """build_request's agent keyword arguments from the generate flags ({} when none is given)."""
    kw = {}
    schema, grammar = _text_or_file(args.json_schema), _text_or_file(args.grammar)
    for kind, value in (("json_schema", schema), ("regex", args.regex), ("grammar", grammar),
                        ("json_object", args.json_object or None)):
        if value is not None:
            kw["structured"] = {kind: value}
    if args.tools is not None:
        tools = json.loads(_text_or_file(args.tools))
        if not isinstance(tools, list):
            raise ValueError("--tools must be a JSON list")
        kw["tools"] = tools
    if args.tool_choice is not None:
        from jaxserve.client_agents import CHOICES

        kw["tool_choice"] = args.tool_choice if args.tool_choice in CHOICES else {"name": args.tool_choice}
    if args.parallel_tool_calls is not None:
        kw["parallel_tool_calls"] = args.parallel_tool_calls
    return kw


def _connection(args) -> dict:
    """Client keyword arguments for the key and TLS options."""
    import os
    from pathlib import Path

    from jaxserve.server.auth import API_KEY_ENV

    read = lambda path: Path(path).read_bytes() if path else None  # noqa: E731
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ValueError("--tls-cert and --tls-key go together")
    tls = args.tls or bool(args.tls_ca or args.tls_cert)
    key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV, "").split(",")[0].strip()
    return dict(api_key=key or None, tls=tls, root_certificates=read(args.tls_ca),
                private_key=read(args.tls_key), certificate_chain=read(args.tls_cert))


def _with_client(fn):
    """Open a Client for the call; a gRPC error becomes a one-line message and exit code 1."""

    def run(args) -> int:
        import grpc

        from jaxserve.client import Client

        with Client(args.target, timeout=args.timeout, **_connection(args)) as client:
            try:
                return fn(client, args) or 0
            except grpc.RpcError as e:
                print(f"jaxserve client: error: {e.code().name}: {e.details()}", file=sys.stderr)
                return 1

    return run


@_with_client
def _client_generate(client, args) -> int:
    from jaxserve.client import finish_reason

    if (args.prompt is None) == (args.prompt_ids is None):
        raise ValueError("give a text prompt or --prompt-ids (one of them)")
    prompt = args.prompt if args.prompt is not None else args.prompt_ids
    agent = agent_kwargs(args)
    chat = args.chat_template and args.prompt is not None
    if chat and set(agent) - {"structured"}:  # tools need a conversation
        prompt, chat = [{"role": "user", "content": args.prompt}], False
    kw = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
              seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos or None, session_id=args.session,
              request_id=args.request_id, chat_template=chat, **agent)
    if not args.stream:
        r = client.generate(prompt, **kw)
        text = r.content if r.content or r.tool_calls else r.text  # parsed: the answer beside its calls
        if text or not r.tool_calls:
            print(text or list(r.token_ids))
        for c in r.tool_calls:  # one JSON object a line
            print(json.dumps({"id": c.id, "name": c.name, "arguments": c.arguments}))
        end, rid = r, r.request_id
    else:
        end = rid = None
        for ev in client.generate_stream(prompt, **kw):
            if ev.HasField("start"):
                rid = ev.start.request_id
            elif ev.HasField("delta"):
                print(delta_output(ev.delta, args.prompt is not None), end="", flush=True)
            else:
                end = ev.end
        print()
    u, t = end.usage, end.timing
    ttft = f"{t.time_to_first_token_s * 1000:.1f}ms" if t.HasField("time_to_first_token_s") else "-"
    print(f"[{rid}] {finish_reason(end)}; prompt {u.prompt_tokens} (cached {u.cached_tokens}), "
          f"completion {u.completion_tokens}; ttft {ttft}, total {t.total_s * 1000:.1f}ms", file=sys.stderr)
    return 0


def delta_output(delta, text_prompt: bool) -> str:
    """What `generate --stream` prints for one delta: its text. Token ids only for a prompt given
    as ids whose delta has no text (a model without a tokenizer); a text prompt's special tokens
    (EOS) have no text and print nothing."""
    if delta.text or text_prompt:
        return delta.text
    return " ".join(map(str, delta.token_ids)) + " "


@_with_client
def _client_info(client, args) -> int:
    from google.protobuf import json_format

    print(json.dumps(json_format.MessageToDict(client.model_info(), preserving_proto_field_name=True), indent=2))


@_with_client
def _client_health(client, args) -> int:
    if args.wait > 0:
        try:
            client.wait_ready(args.wait)
        except TimeoutError:
            pass
    status = client.health()
    print(status)
    return 0 if status == "SERVING" else 1


@_with_client
def _client_tokenize(client, args) -> int:
    print(" ".join(map(str, client.tokenize(args.text, chat_template=args.chat_template))))


@_with_client
def _client_detokenize(client, args) -> int:
    print(client.detokenize(args.ids))


@_with_client
def _client_abort(client, args) -> int:
    r = client.abort(*args.request_ids)
    print(json.dumps({"aborted": list(r.aborted), "not_found": list(r.not_found)}))
