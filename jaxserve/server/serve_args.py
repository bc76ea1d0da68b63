"""The ``jaxserve serve`` flags: the server's own (addresses, security, ids, queue), the bounds on
one request's work (``ServeLimits``), a worker's role and KV handoff, the multi-process group
and the engine's (``EngineConfig``)."""
from __future__ import annotations

from jaxserve.cli_args import ModelOptions
from jaxserve.server.group import add_group_args


def add_serve_args(p) -> None:
    ModelOptions(dtype="auto", num_devices=None, helps=(("--num-devices", "devices of the mesh (default 1; a "
                                                                          "multi-process replica: every device of "
                                                                          "every process)"),)).add_to(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, default=50051, help="gRPC port (0 = pick a free one)")
    p.add_argument("--http-port", type=int, default=None,
                   help="also serve the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, "
                        "/v1/models, /health) on this port, same host, engine, keys, limits and TLS "
                        "(0 = pick a free one; default off)")
    p.add_argument("--served-model-name", default=None,
                   help="the model's name in the HTTP API (default: the checkpoint's directory name)")
    p.add_argument("--tool-call-parser", default=None, choices=("kimi_k2", "glm45", "glm47", "hermes"),
                   help="the format the model writes tool calls in (default: chosen from the checkpoint's "
                        "architecture and chat template; hermes-style JSON for others)")
    p.add_argument("--reasoning-parser", default=None, choices=("think", "none"),
                   help="split <think>...</think> into reasoning_content (default: think when the chat "
                        "template has it)")
    p.add_argument("--metrics-port", type=int, default=9400, help="Prometheus /metrics port (0 = free one, -1 = off)")
    p.add_argument("--metrics-host", default="127.0.0.1",
                   help="address of the metrics endpoint (plain HTTP, no authentication): loopback unless "
                        "set, whatever --host is")
    p.add_argument("--tls-cert", default=None,
                   help="PEM certificate chain: serve gRPC (and HTTP) over TLS (with --tls-key)")
    p.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    p.add_argument("--tls-client-ca", default=None,
                   help="PEM CA certificate(s): require a client certificate signed by one of them (mTLS)")
    p.add_argument("--api-key", action="append", default=None,
                   help="accept this API key (repeatable; each key is one identity), sent by clients as "
                        "`authorization: Bearer <key>` or `x-api-key`; also read from $JAXSERVE_API_KEY "
                        "(comma-separated), which other local users cannot see in the process list")
    p.add_argument("--max-id-length", type=int, default=256,
                   help="longest request_id / session_id accepted (visible ASCII only; at most 4096)")
    p.add_argument("--max-waiting", type=int, default=256,
                   help="requests waiting for admission before RESOURCE_EXHAUSTED")
    add_limit_args(p)
    add_role_args(p)
    p.add_argument("--replica-id", default=None, help="this replica's name in ModelInfo/metrics (default host:port)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds running requests get to finish on SIGTERM/SIGINT")
    add_group_args(p)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--serve-while-warming", action="store_true",
                   help="report SERVING once the programs that let any batch run are built (largest buckets "
                        "first) and build the rest while serving; batches pad to built buckets meanwhile")
    p.add_argument("--engine-process", action="store_true",
                   help="run the engine in a process of its own, the gRPC / HTTP front end in this one, so "
                        "that the front end's work (stream set-ups, refusals, parsing) never holds the "
                        "engine's interpreter; not with --role prefill/decode or a multi-process replica")
    p.add_argument("--engine-cpus", default=None, metavar="LIST",
                   help="with --engine-process: the CPUs the engine's process runs on (e.g. 0-3,8), the front "
                        "end then on the others (default: both on every CPU this process may use)")
    p.add_argument("--profile-startup", action="store_true",
                   help="log where the start's time went: imports, weights, engine set-up and, per serving "
                        "program and bucket, cache load / trace / lower / compile")
    from jaxserve.cli_args import add_engine_args

    add_engine_args(p.add_argument_group("engine (EngineConfig)"))


def add_limit_args(p) -> None:
    """Bounds on one request's work and on open streams (jaxserve.server.limits)."""
    from jaxserve.server.limits import PROMPT_BYTES_PER_TOKEN, ServeLimits

    d = ServeLimits()
    p.add_argument("--max-prompt-bytes", type=int, default=None,
                   help=f"largest text prompt (UTF-8 bytes), rejected before tokenizing; also bounds Tokenize "
                        f"(default {PROMPT_BYTES_PER_TOKEN} x the model's max context)")
    p.add_argument("--max-stop-strings", type=int, default=d.max_stop_strings,
                   help=f"stop strings per request (default {d.max_stop_strings})")
    p.add_argument("--max-stop-bytes", type=int, default=d.max_stop_bytes,
                   help=f"UTF-8 bytes of a request's stop strings together (default {d.max_stop_bytes})")
    p.add_argument("--max-stop-token-ids", type=int, default=d.max_stop_token_ids,
                   help=f"stop token ids per request (default {d.max_stop_token_ids})")
    p.add_argument("--max-messages", type=int, default=None,
                   help="messages of one chat, refused before the chat template runs (default the model's max "
                        "context: each message costs at least one token)")
    p.add_argument("--max-body-bytes", type=int, default=None,
                   help="largest HTTP request body, refused as soon as that many bytes have arrived, chunked or "
                        "not (default 6 x --max-prompt-bytes + 1 MiB: a prompt within the limit, JSON-escaped)")
    p.add_argument("--max-json-depth", type=int, default=d.max_json_depth,
                   help=f"deepest nesting of an HTTP request body, checked before it is parsed "
                        f"(default {d.max_json_depth})")
    p.add_argument("--max-streams-per-connection", type=int, default=d.max_streams_per_peer,
                   help=f"open GenerateStream calls per client connection before RESOURCE_EXHAUSTED "
                        f"(default {d.max_streams_per_peer})")
    p.add_argument("--max-queued-per-client", type=int, default=d.max_queued_per_client,
                   help=f"requests one client (an API key, else a connection) may have waiting for admission while "
                        f"another client has requests in flight, before RESOURCE_EXHAUSTED; a lone client may fill "
                        f"--max-waiting (0 = no bound; default {d.max_queued_per_client})")
    p.add_argument("--client-refusal-rate", type=float, default=d.client_refusal_rate,
                   help=f"refused requests (invalid, too large, over --max-queued-per-client) a second one client "
                        f"(an API key, else a host) may cause, with a burst of twice that (a refusal counts one more "
                        f"per 64 KiB of request read); past it the client's next "
                        f"requests are refused at the door, before their body is read, with RESOURCE_EXHAUSTED / "
                        f"HTTP 429 and a retry hint (0 = no bound; default {d.client_refusal_rate:g})")
    p.add_argument("--door-hold", type=float, default=d.door_hold_s,
                   help=f"seconds a refusal at the door (--client-refusal-rate) is held before it is answered, at "
                        f"most until the client's door reopens: a client retrying in a loop then sends as many "
                        f"requests as it has calls held, up to 64 a client (0 = at once; default {d.door_hold_s:g})")
    p.add_argument("--max-streams", type=int, default=d.max_streams,
                   help=f"open GenerateStream calls in total before RESOURCE_EXHAUSTED (default {d.max_streams})")
    p.add_argument("--stream-idle-timeout", type=float, default=d.stream_idle_timeout_s,
                   help=f"seconds a stream may wait for its client to read before it is cancelled and its "
                        f"request aborted (default {d.stream_idle_timeout_s:g})")


def add_role_args(p) -> None:
    """Disaggregated serving: the worker's role and its KV handoff (jaxserve.disagg.service)."""
    p.add_argument("--role", choices=("both", "prefill", "decode"), default="both",
                   help="both: prefill and decode here (default); prefill: only the prefill weights, serves "
                        "KvHandoff.Prefill (KV offered to decode workers, default pool bf16); decode: only the "
                        "decode weights, takes handed-off KV (default pool fp8_e4m3). Start every worker of a "
                        "deployment with the same model and weight-format flags")
    p.add_argument("--kv-transport", choices=("grpc", "transfer"), default="grpc",
                   help="how a decode worker pulls offered KV: grpc (a byte stream, KvHandoff.PullPages) or "
                        "transfer (jax.experimental.transfer); a prefill worker offers over this one")
    p.add_argument("--handoff-ttl", type=float, default=30.0,
                   help="seconds a prefill worker keeps an unpulled KV offer before draining it")
    p.add_argument("--pull-timeout", type=float, default=10.0, help="watchdog of one KV pull on a decode worker")
    p.add_argument("--kv-handoff-format", default=None,
                   help="prefill worker: the decode workers' KV format, its export compiled at warm-up "
                        "(default fp8_e4m3)")
    p.add_argument("--advertise-host", default=None,
                   help="the host decode workers reach this one at, named in its KV offers (default --host; "
                        "bound to 0.0.0.0 / ::, a routable address of this machine)")
    from jaxserve.server.auth import add_peer_args

    add_peer_args(p, "decode worker: API key sent to prefill workers (PullPages, Release); default the "
                     "credentials the Decode call came with")


def limits_from(args):
    from jaxserve.server.limits import ServeLimits

    return ServeLimits(max_stop_strings=args.max_stop_strings, max_stop_bytes=args.max_stop_bytes,
                       max_stop_token_ids=args.max_stop_token_ids, max_prompt_bytes=args.max_prompt_bytes,
                       max_streams_per_peer=args.max_streams_per_connection, max_streams=args.max_streams,
                       stream_idle_timeout_s=args.stream_idle_timeout, max_messages=args.max_messages,
                       max_body_bytes=args.max_body_bytes, max_json_depth=args.max_json_depth,
                       max_queued_per_client=args.max_queued_per_client,
                       client_refusal_rate=args.client_refusal_rate, door_hold_s=args.door_hold)
