"""``jaxserve route``: the router in front of ``jaxserve serve`` workers.

    jaxserve route --worker 10.0.0.1:50051 --worker 10.0.0.2:50051          # colocated workers
    jaxserve route --prefill 10.0.0.1:50051 --decode 10.0.0.2:50051          # separate pools

``python -m jaxserve.router.cli route ...`` runs it alone (no jax import). SIGTERM / SIGINT drain
it (running requests get --drain-timeout seconds) and exit with code 0.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

log = logging.getLogger("jaxserve.router")


def register_route(sub) -> None:
    from jaxserve.server.limits import ServeLimits

    d = ServeLimits()
    p = sub.add_parser("route", help="route jaxserve.v1.JaxServe requests over workers (prefix and session "
                                     "affinity, health checks, disaggregated prefill/decode)")
    p.add_argument("--worker", action="append", default=[], metavar="ADDR",
                   help="a colocated worker (`jaxserve serve`, role both), host:port; repeatable")
    p.add_argument("--prefill", action="append", default=[], metavar="ADDR",
                   help="a prefill worker (`jaxserve serve --role prefill`); repeatable")
    p.add_argument("--decode", action="append", default=[], metavar="ADDR",
                   help="a decode worker (`jaxserve serve --role decode`); repeatable")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, default=50050, help="gRPC port (0 = pick a free one)")
    p.add_argument("--metrics-port", type=int, default=9410, help="Prometheus /metrics port (0 = free one, -1 = off)")
    p.add_argument("--metrics-host", default="127.0.0.1", help="address of the metrics endpoint")
    p.add_argument("--tls-cert", default=None, help="PEM certificate chain: serve gRPC over TLS (with --tls-key)")
    p.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    p.add_argument("--tls-client-ca", default=None, help="PEM CA certificate(s): require client certificates")
    p.add_argument("--api-key", action="append", default=None,
                   help="accept this API key at the router (repeatable; also $JAXSERVE_API_KEY); without it "
                        "the clients' credentials are passed on and the workers check them")
    from jaxserve.server.auth import add_peer_args

    add_peer_args(p, "API key the router sends to every worker (instead of the client's credentials)")
    p.add_argument("--health-interval", type=float, default=1.0, help="seconds between worker health checks")
    p.add_argument("--health-timeout", type=float, default=1.0, help="seconds a health check may take")
    p.add_argument("--unhealthy-after", type=int, default=2,
                   help="failed health checks in a row that take a worker out (its calls move elsewhere)")
    p.add_argument("--session-ttl", type=float, default=600.0,
                   help="seconds a session stays pinned to its worker after its last request")
    p.add_argument("--prefix-index-entries", type=int, default=100_000,
                   help="page hashes the router remembers for prefix affinity (least recently used dropped)")
    p.add_argument("--max-id-length", type=int, default=256, help="longest request_id / session_id accepted")
    p.add_argument("--max-streams-per-connection", type=int, default=d.max_streams_per_peer,
                   help=f"open GenerateStream calls per client connection (default {d.max_streams_per_peer})")
    p.add_argument("--max-streams", type=int, default=d.max_streams,
                   help=f"open GenerateStream calls in total (default {d.max_streams})")
    p.add_argument("--stream-idle-timeout", type=float, default=d.stream_idle_timeout_s,
                   help="seconds a stream may wait for its client to read before it is cancelled")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds running requests get on SIGTERM")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=run_route)


def _router(args):
    from jaxserve.router.app import Router
    from jaxserve.server import auth, convert
    from jaxserve.server.limits import ServeLimits

    workers = ([(a, "both") for a in args.worker] + [(a, "prefill") for a in args.prefill]
               + [(a, "decode") for a in args.decode])
    convert.check_id_options(args.max_id_length, None)
    limits = ServeLimits(max_streams_per_peer=args.max_streams_per_connection, max_streams=args.max_streams,
                         stream_idle_timeout_s=args.stream_idle_timeout)
    return Router(workers, host=args.host, port=args.port,
                  metrics_port=None if args.metrics_port < 0 else args.metrics_port, metrics_host=args.metrics_host,
                  credentials=auth.server_credentials(args.tls_cert, args.tls_key, args.tls_client_ca),
                  keys=auth.keys_from(args.api_key), peer=auth.peer_from_args(args),
                  max_id_length=args.max_id_length, limits=limits, health_interval_s=args.health_interval,
                  health_timeout_s=args.health_timeout, unhealthy_after=args.unhealthy_after,
                  session_ttl_s=args.session_ttl, prefix_entries=args.prefix_index_entries)


async def _route(args) -> int:
    router = _router(args)  # ValueError: exit code 2, before binding
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await router.start()
    up = [w.address for w in router.pool.workers if w.up]
    print(f"jaxserve: routing on {router.target} (metrics port {router.metrics_port}) to "
          f"{len(router.pool.workers)} worker(s), {len(up)} up", flush=True)
    await stop.wait()
    print(f"jaxserve: draining (up to {args.drain_timeout:g}s)", flush=True)
    await router.stop(args.drain_timeout)
    print("jaxserve: stopped", flush=True)
    return 0


def run_route(args) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return asyncio.run(_route(args))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="jaxserve-router", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    register_route(sub)
    args = parser.parse_args(argv)
    try:
        return args.func(args) or 0
    except ValueError as e:
        print(f"jaxserve {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
