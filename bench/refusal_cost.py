"""What one refused stream start costs the server (issue 27's churn): server CPU per
GenerateStream refused at the door (RESOURCE_EXHAUSTED before any check of the message),
against a bare grpc.aio server whose handler refuses at once, side by side in one run.

    .venv/bin/python bench/refusal_cost.py --clients 200 --rounds 10 --repeats 3

Servers (each in this process, on its own event loop thread; one is loaded at a time):
- jaxserve: ``ServerThread`` over the mock engine, with two API keys; the refused key's door is
  closed by its first rounds (each dropped stream counts against its refusal bucket), so the
  timed rounds are door refusals, what a churning client meets;
- bare-abort: a grpc.aio server whose GenerateStream handler calls ``context.abort`` at once;
- bare-return: the same handler setting the code and returning.
The client (a process of its own) opens --clients connections and starts one stream on each per
round, waiting for every answer before the next round. CPU is this process's user + system time
over the timed rounds (gRPC's own threads included), per start; the servers take turns --repeats
times and the medians are printed.
"""
from __future__ import annotations

import argparse
import asyncio
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

REFUSED, OTHER = "refused-client-key-0123456789", "other-client-key-0123456789"
METHOD = ("jaxserve.v1.JaxServe", "GenerateStream")
CLIENT = r'''
import asyncio, sys, time, grpc
from jaxserve.client import AsyncClient
target, n, rounds, key = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
async def main():
    opts = [("grpc.use_local_subchannel_pool", 1)]  # a connection each
    clients = [AsyncClient(target, timeout=60, api_key=key, channel=grpc.aio.insecure_channel(target, options=opts))
               for _ in range(n)]
    codes = {}
    async def one(c):
        call = c.generate_stream([5, 6, 7], max_tokens=64)
        try:
            async for _ in call:
                break
            codes["OK"] = codes.get("OK", 0) + 1
        except grpc.RpcError as e:
            codes[e.code().name] = codes.get(e.code().name, 0) + 1
        finally:
            call.cancel()
    for r in range(rounds + 2):  # two untimed rounds: connections made, the door closed
        if r == 2:
            codes.clear()
            print("GO", flush=True)
        await asyncio.gather(*(one(c) for c in clients))
    print("DONE", codes, flush=True)
asyncio.run(main())
'''


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class BareServer:
    """A grpc.aio server on a thread of its own whose GenerateStream refuses every call."""

    def __init__(self, abort: bool):
        self.abort, self.loop, self.port = abort, asyncio.new_event_loop(), None
        ready = threading.Event()
        threading.Thread(target=self._main, args=(ready,), daemon=True).start()
        ready.wait()

    async def _refuse(self, request, context):
        if self.abort:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "refused")
        context.set_code(grpc.StatusCode.RESOURCE_EXHAUSTED)
        context.set_details("refused")
        return
        yield  # an async generator: a unary-stream handler

    def _main(self, ready) -> None:
        asyncio.set_event_loop(self.loop)

        async def start():
            self.server = grpc.aio.server()
            handler = grpc.unary_stream_rpc_method_handler(self._refuse)
            self.server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(METHOD[0], {METHOD[1]: handler})])
            self.port = self.server.add_insecure_port("127.0.0.1:0")
            await self.server.start()

        self.loop.run_until_complete(start())
        ready.set()
        self.loop.run_forever()

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"


def timed(target: str, clients: int, rounds: int) -> tuple[float, dict]:
    """(server CPU ms per start, the clients' outcomes) over the timed rounds."""
    env = {"PYTHONPATH": str(REPO)}
    p = subprocess.Popen([sys.executable, "-c", CLIENT, target, str(clients), str(rounds), REFUSED],
                         stdout=subprocess.PIPE, text=True, env=env)
    c0, codes = None, {}
    for line in p.stdout:
        if line.startswith("GO"):
            c0 = cpu_s()
        elif line.startswith("DONE"):
            c1 = cpu_s()
            codes = eval(line[5:])  # noqa: S307 - the dict our own client printed
    p.wait()
    return 1000 * (c1 - c0) / (clients * rounds), codes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from jaxserve.server.app import ServerThread
    from jaxserve.server.auth import ApiKeys
    from jaxserve.testing.mock_llm import MockLLM

    from jaxserve.server.limits import ServeLimits

    # no hold (--door-hold 0): each refusal answered at once, as the bare servers do
    st = ServerThread(MockLLM(), keys=ApiKeys([REFUSED, OTHER]), metrics_port=None,
                      limits=ServeLimits(door_hold_s=0.0)).start()
    st.wait_ready(timeout=60)
    servers = {"jaxserve": st.target, "bare-abort": BareServer(True).target, "bare-return": BareServer(False).target}
    ms = {name: [] for name in servers}
    for _ in range(args.repeats):
        for name, target in servers.items():
            cost, codes = timed(target, args.clients, args.rounds)
            ms[name].append(cost)
            print(f"{name:12s} {cost:.3f} ms CPU per refused start  {codes}", flush=True)
    print("\n| server | CPU per refused stream start (median) | runs |\n|---|---|---|")
    for name, xs in ms.items():
        print(f"| {name} | {statistics.median(xs):.3f} ms | {', '.join(f'{x:.3f}' for x in xs)} |")
    st.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
