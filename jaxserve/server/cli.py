"""``jaxserve serve`` and ``jaxserve client``: ``register_serve(sub)`` / ``register_client(sub)``
add them to an argparse subparsers object; ``python -m jaxserve.server.cli`` runs them alone.

Heavy imports (jax, the model) happen inside ``run_serve``, so the client never loads jax.
SIGTERM / SIGINT end ``serve`` with exit code 0 at any point: while loading it exits at once;
once the server is bound it drains (``Server.stop``), without waiting for a warm-up compile.
"""
from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import os
import signal
import sys
import time

from jaxserve.disagg.role import WorkerRole
from jaxserve.server import announce
from jaxserve.server.client_cli import register_client
from jaxserve.server.serve_args import add_serve_args, limits_from

__all__ = ["limits_from", "main", "register_client", "register_serve", "run_serve"]

log = logging.getLogger("jaxserve.server")
_SIGNALS = (signal.SIGINT, signal.SIGTERM)


# ---------------------------------------------------------------------- serve
def register_serve(sub) -> None:
    p = sub.add_parser("serve", help="serve a model over gRPC (health, reflection, Prometheus metrics) "
                                     "and optionally the OpenAI-compatible HTTP API")
    add_serve_args(p)
    p.set_defaults(func=run_serve)


def _exit_now(signum, frame):
    """SIGTERM / SIGINT before the event loop took the signals over (imports, model load):
    nothing is bound or running yet, so the process just ends, at once and with code 0.
    (Raising instead would be lost whenever the signal lands in a callback such as a gc hook.)
    A conversion of the default model cut short here leaves a directory the next start removes."""
    # os.write, not print: the signal may have interrupted a print on the main thread.
    os.write(1, f"jaxserve: {signal.Signals(signum).name} before serving; stopped\n".encode())
    os._exit(0)


def run_serve(args) -> int:
    args.started = time.perf_counter()
    for sig in _SIGNALS:  # until _serve's event loop takes them over
        signal.signal(sig, _exit_now)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    code, engine_stopped = _run(args)
    for sig in _SIGNALS:  # drained: a late signal must not turn exit code 0 into a kill
        signal.signal(sig, signal.SIG_IGN)
    if not engine_stopped:
        # A warm-up is still compiling on the engine thread and cannot be interrupted;
        # tearing the interpreter down under it aborts the process (SIGABRT). Nothing is
        # left to save: the ports are closed and the requests answered.
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(code)
    return code


def _run(args) -> tuple[int, bool]:
    from jaxserve.checkpoint.gguf import remove_stale_conversions
    from jaxserve.server import auth, convert

    # Everything an operator can get wrong is checked before the (slow) model load.
    keys = auth.keys_from(args.api_key)
    credentials = auth.server_credentials(args.tls_cert, args.tls_key, args.tls_client_ca)
    args.peer = auth.peer_from_args(args)
    if WorkerRole(args.role).hands_off or args.advertise_host is not None:
        from jaxserve.server.address import advertised_host

        advertised_host(args.host, args.advertise_host)
    convert.check_id_options(args.max_id_length, args.replica_id)
    args.limits = limits_from(args)  # ValueError (exit code 2) before the model loads
    for path in remove_stale_conversions():
        log.info("removed %s, left by a conversion whose process died", path)
    from jaxserve.server import group as replica_group

    group = replica_group.group_from_args(args)
    if args.engine_process:
        return _run_engine_process(args, group, keys, credentials)
    if args.engine_cpus is not None:
        raise ValueError("--engine-cpus places the engine's own process: it needs --engine-process")
    from jaxserve.server.model_load import load_llm

    llm = load_llm(args, group)
    if group is not None and not group.is_leader:
        code = replica_group.follow(group, llm)
        return code, code == 0
    leader = replica_group.lead(group, llm) if group is not None else None
    return asyncio.run(_serve(args, llm, keys, credentials, leader))


def _run_engine_process(args, group, keys, credentials) -> tuple[int, bool]:
    """``--engine-process``: the model loads and the engine runs in a process of its own."""
    import functools

    from jaxserve.server.engine_process import EngineProcess, parse_cpus
    from jaxserve.server.model_load import load_llm

    if group is not None or WorkerRole(args.role).hands_off:
        raise ValueError("--engine-process serves one process's engine: not with --role prefill/decode "
                         "(KV handoff reaches the engine itself) or a multi-process replica")
    cpus = parse_cpus(args.engine_cpus) if args.engine_cpus is not None else None
    spec = argparse.Namespace(**{k: v for k, v in vars(args).items() if k != "func"})
    model = EngineProcess(functools.partial(load_llm, spec), log_level=args.log_level, cpus=cpus,
                          profile_startup=args.profile_startup)
    try:
        code, _ = asyncio.run(_serve(args, model, keys, credentials))
    finally:
        model.close()
    return code, True


def _warn_if_exposed(host: str, keys, credentials) -> None:
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        loopback = False
    if loopback:
        return
    if not keys.enabled:
        log.warning("listening on %s with no API key: any client that reaches it may generate and abort "
                    "requests (--api-key / $JAXSERVE_API_KEY)", host)
    elif credentials is None:
        log.warning("listening on %s without TLS: API keys cross the network in plaintext (--tls-cert)", host)


async def _serve(args, llm, keys, credentials, leader=None) -> tuple[int, bool]:
    """-> (exit code, whether the engine thread has ended). leader: process 0's step channel
    of a multi-process replica; a lost process ends the server with EXIT_PEER_LOST."""
    from jaxserve.server.app import Server

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in _SIGNALS:
        loop.add_signal_handler(sig, stop.set)
    from jaxserve.server.http_server import HttpTls

    http_tls = HttpTls(args.tls_cert, args.tls_key, args.tls_client_ca) if credentials is not None else None
    server = Server(llm, host=args.host, port=args.port, max_waiting=args.max_waiting, replica_id=args.replica_id,
                    metrics_port=None if args.metrics_port < 0 else args.metrics_port,
                    metrics_host=args.metrics_host, credentials=credentials, keys=keys,
                    max_id_length=args.max_id_length, limits=args.limits, http_port=args.http_port,
                    http_tls=http_tls, served_model_name=args.served_model_name, kv_transport=args.kv_transport,
                    handoff_ttl_s=args.handoff_ttl, pull_timeout_s=args.pull_timeout, group=leader,
                    serve_while_warming=args.serve_while_warming, advertise_host=args.advertise_host,
                    peer=args.peer,
                    tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser)
    await server.start()
    _print_listening(args, server, keys, credentials)
    ready = asyncio.ensure_future(server.wait_ready())
    stopping = asyncio.ensure_future(stop.wait())
    lost = asyncio.ensure_future(server.replica_lost.wait())
    await asyncio.wait({ready, stopping}, return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if ready.done() and not server.replica_lost.is_set():
        if ready.exception() is not None:
            print(f"jaxserve serve: error: {ready.exception()}", file=sys.stderr, flush=True)
            code = 1
        else:
            _print_serving(args, server, llm)
            await asyncio.wait({stopping, lost}, return_when=asyncio.FIRST_COMPLETED)
    if server.replica_lost.is_set():
        lost.cancel()
        return await _replica_lost(args, server)
    ready.cancel()
    lost.cancel()
    print(f"jaxserve: draining (up to {args.drain_timeout:g}s)", flush=True)
    await server.stop(args.drain_timeout)
    if leader is not None:
        leader.close()  # the other processes end their loops
    print("jaxserve: stopped", flush=True)
    return code, server.engine_stopped


def _print_listening(args, server, keys, credentials) -> None:
    security = (f"{'TLS' if credentials is not None else 'plaintext'}, "
                f"{f'{len(keys)} API key(s)' if keys.enabled else 'no API key'}")
    # "metrics port N)" is parsed by scripts (bench/load_test.py): keep it last in the parentheses.
    print(f"jaxserve: listening on {server.target} ({security}, metrics on {args.metrics_host}, "
          f"metrics port {server.metrics_port}); warming up (health NOT_SERVING until done)", flush=True)
    if server.http_target is not None:
        print(f"jaxserve: OpenAI-compatible HTTP API on {server.http_target} (model "
              f"{server.served_model_name!r})", flush=True)
    _warn_if_exposed(args.host, keys, credentials)
    announce.log_handoff(server, args.peer, args.kv_transport)


def _print_serving(args, server, llm) -> None:
    i = server.info
    if args.profile_startup and hasattr(llm, "profile"):
        llm.profile.add("warm-up: build the serving programs", server.warmup_seconds)
        log.info("%s", llm.profile.report(llm.engine.programs))
    held = i.decode if WorkerRole(i.role).decodes else i.prefill  # the phase whose weights this worker holds
    print(f"jaxserve: SERVING on {server.target} ({i.architecture}, role {i.role}, weights "
          f"{held.weights}, kv {held.kv_cache}, fingerprint {i.fingerprint[:12]})", flush=True)


async def _replica_lost(args, server) -> tuple[int, bool]:
    """A process of the replica is gone: health is NOT_SERVING and the requests in flight have
    failed (``Server``). Health stays visible for --peer-timeout seconds (probes and routers
    see it), then the process exits with EXIT_PEER_LOST so the launcher restarts the group; the
    engine thread is not waited for (its collective may never return)."""
    from jaxserve.multihost.launch import EXIT_PEER_LOST

    print(f"jaxserve: {server.failure}; NOT_SERVING, exiting in {args.peer_timeout:g}s "
          f"(code {EXIT_PEER_LOST})", flush=True)
    await asyncio.sleep(args.peer_timeout)
    return EXIT_PEER_LOST, False


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
