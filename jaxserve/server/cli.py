"""``jaxserve serve`` and ``jaxserve client``: ``register_serve(sub)`` / ``register_client(sub)``
add them to an argparse subparsers object; ``python -m jaxserve.server.cli`` runs them alone.

Heavy imports (jax, the model) happen inside ``run_serve``, so the client never loads jax.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys


# ---------------------------------------------------------------------- serve
def register_serve(sub) -> None:
    p = sub.add_parser("serve", help="serve a model over gRPC (health, reflection, Prometheus metrics)")
    p.add_argument("--model", default=None,
                   help="Hugging Face-format checkpoint directory; default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, default=50051, help="gRPC port (0 = pick a free one)")
    p.add_argument("--metrics-port", type=int, default=9400, help="Prometheus /metrics port (0 = free one, -1 = off)")
    p.add_argument("--max-waiting", type=int, default=256,
                   help="requests waiting for admission before RESOURCE_EXHAUSTED")
    p.add_argument("--replica-id", default=None, help="this replica's name in ModelInfo/metrics (default host:port)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds running requests get to finish on SIGTERM/SIGINT")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="activations and loaded weights (auto: bfloat16 on a GPU, float32 elsewhere)")
    p.add_argument("--kv-format", default=None,
                   help="bf16 | fp8_e4m3 | float32 (default: what a converted checkpoint or --preset holds, else bf16)")
    p.add_argument("--num-devices", type=int, default=1)
    p.add_argument("--num-pages", type=int, default=256)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--max-prefill-seqs", type=int, default=4)
    p.add_argument("--prefill-chunk", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--no-integrity-check", action="store_true")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    from jaxserve.cli_args import add_format_args

    add_format_args(p)
    p.set_defaults(func=run_serve)


def run_serve(args) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from jaxserve.cli_args import enable_compile_cache, ensure_cpu_devices
    from jaxserve.cli_args import format_kwargs

    ensure_cpu_devices(args.num_devices)
    enable_compile_cache()
    from jaxserve.llm import LLM

    llm = LLM(
        args.model, dtype=args.dtype, kv_format=args.kv_format, num_devices=args.num_devices,
        num_pages=args.num_pages, page_size=args.page_size, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_prefill_seqs=args.max_prefill_seqs,
        prefill_chunk=args.prefill_chunk, max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching, integrity_check=not args.no_integrity_check,
        keep_finished=0,  # each request's last output carries its completion
        **format_kwargs(args),
    )
    return asyncio.run(_serve(args, llm))


async def _serve(args, llm) -> int:
    from jaxserve.server.app import Server

    server = Server(llm, host=args.host, port=args.port, max_waiting=args.max_waiting, replica_id=args.replica_id,
                    metrics_port=None if args.metrics_port < 0 else args.metrics_port)
    await server.start()
    print(f"jaxserve: listening on {server.target} (metrics port {server.metrics_port}); warming up "
          f"(health NOT_SERVING until done)", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    ready = asyncio.ensure_future(server.wait_ready())
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({ready, stopping}, return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if ready.done():
        if ready.exception() is not None:
            print(f"jaxserve serve: error: {ready.exception()}", file=sys.stderr, flush=True)
            code = 1
        else:
            i = server.info
            print(f"jaxserve: SERVING on {server.target} ({i.architecture}, weights {i.decode.weights}, "
                  f"kv {i.decode.kv_cache}, fingerprint {i.fingerprint[:12]})", flush=True)
            await stopping
    ready.cancel()
    print(f"jaxserve: draining (up to {args.drain_timeout:g}s)", flush=True)
    await server.stop(args.drain_timeout)
    print("jaxserve: stopped", flush=True)
    return code


# ---------------------------------------------------------------------- client
def _ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by spaces or commas, got {text!r}")


def register_client(sub) -> None:
    p = sub.add_parser("client", help="talk to a running `jaxserve serve` over gRPC")
    p.add_argument("--target", default="127.0.0.1:50051", help="server host:port")
    p.add_argument("--timeout", type=float, default=None, help="deadline per call, seconds")
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


def _with_client(fn):
    """Open a Client for the call; a gRPC error becomes a one-line message and exit code 1."""

    def run(args) -> int:
        import grpc

        from jaxserve.client import Client

        with Client(args.target, timeout=args.timeout) as client:
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
    kw = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
              seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos or None, session_id=args.session,
              request_id=args.request_id, chat_template=args.chat_template and args.prompt is not None)
    if not args.stream:
        r = client.generate(prompt, **kw)
        print(r.text if r.text else list(r.token_ids))
        end, rid = r, r.request_id
    else:
        end = rid = None
        for ev in client.generate_stream(prompt, **kw):
            if ev.HasField("start"):
                rid = ev.start.request_id
            elif ev.HasField("delta"):
                print(ev.delta.text if ev.delta.text else " ".join(map(str, ev.delta.token_ids)), end="", flush=True)
            else:
                end = ev.end
        print()
    u, t = end.usage, end.timing
    ttft = f"{t.time_to_first_token_s * 1000:.1f}ms" if t.HasField("time_to_first_token_s") else "-"
    print(f"[{rid}] {finish_reason(end)}; prompt {u.prompt_tokens} (cached {u.cached_tokens}), "
          f"completion {u.completion_tokens}; ttft {ttft}, total {t.total_s * 1000:.1f}ms", file=sys.stderr)
    return 0


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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="jaxserve-server", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    register_serve(sub)
    register_client(sub)
    args = parser.parse_args(argv)
    try:
        return args.func(args) or 0
    except (ValueError, FileNotFoundError) as e:
        print(f"jaxserve {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
