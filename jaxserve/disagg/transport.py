"""KV handoff transports: how a decode worker pulls an offered payload from a prefill worker.

One interface, ``offer`` on the prefill side (make the payload pullable) and ``pull`` on the
decode side (get it, with its own watchdog), ``drain`` for an offer nobody will pull:

- ``GrpcTransport``: the bytes of the real pages stream over ``KvHandoff.PullPages`` (chunks
  of ``CHUNK_BYTES``), under a gRPC deadline, on the caller's channel (TLS when the worker has
  ``--worker-ca``) with the caller's API key. Works everywhere; the reference transport.
- ``JaxTransferTransport``: ``jax.experimental.transfer`` (the bucketed payload moves device to
  device over the transfer library's own sockets). Its pulls of an id nobody offers (or one
  already pulled) hang and ignore their timeout, so each pull runs on its own daemon thread
  that the watchdog abandons; the receiver never pulls an expired offer, and the prefill side
  drains an offer nobody pulled by pulling it itself. Its control messages (the offer in
  Prefill's answer, Release) go over gRPC with TLS and keys like everything else, but the
  library's data sockets have neither encryption nor authentication: what protects a payload
  there is that its 64-bit random id is only ever sent over the authenticated gRPC calls, and
  the bytes cross the network in the clear. Use it inside a trusted network only.
- ``device_put`` (two engines in one process): the payload's arrays are placed on the
  receiving pool's devices by ``jax.device_put`` inside ``HandoffPrograms.import_``, so no
  transport object is needed (``LLMEngine.add_request(kv_import=...)`` with the exported payload).

Every failure raises ``PullError`` with a cause (``peer_unavailable``, ``timeout``,
``bad_payload``), which the decode worker turns into ABORTED or a local prefill.
"""
from __future__ import annotations

import asyncio
import logging
import threading

import grpc
import jax

from jaxserve.kv import handoff
from jaxserve.v1 import handoff_pb2 as hpb
from jaxserve.v1 import handoff_pb2_grpc as hpb_grpc

log = logging.getLogger("jaxserve.server")
CHUNK_BYTES = 1 << 20
TRANSPORTS = ("grpc", "transfer")


class PullError(RuntimeError):
    def __init__(self, cause: str, detail: str):
        super().__init__(f"KV pull failed ({cause}): {detail}")
        self.cause = cause


def transfer_uuid(transfer_id: str) -> int:
    """The transfer library's integer id of an offer (its transfer id is 16 hex digits)."""
    return int(transfer_id, 16)


def chunks(data: bytes, corrupt: bool = False):
    """``data`` as PageChunk messages; ``corrupt`` (a test fault) flips one bit of the middle byte."""
    if corrupt and data:
        mid = len(data) // 2
        data = data[:mid] + bytes([data[mid] ^ 0x10]) + data[mid + 1:]
    n = max(1, -(-len(data) // CHUNK_BYTES))
    for i in range(n):
        yield hpb.PageChunk(index=i, data=data[i * CHUNK_BYTES:(i + 1) * CHUNK_BYTES], last=i == n - 1)


class GrpcTransport:
    name = "grpc"

    def __init__(self, channel_for):
        self._channel_for = channel_for  # address -> grpc.aio.Channel (cached by the caller)

    async def pull(self, offer: hpb.HandoffOffer, specs, leaf_axes, num_pages: int, fmt: str,
                   timeout: float, metadata: tuple = ()) -> handoff.KvPayload:
        stub = hpb_grpc.KvHandoffStub(self._channel_for(offer.address))
        parts, expect = [], 0
        try:
            call = stub.PullPages(hpb.PullPagesRequest(transfer_id=offer.transfer_id), timeout=timeout,
                                  metadata=metadata or None)
            async for chunk in call:
                if chunk.index != expect:
                    raise PullError("bad_payload", f"chunk {chunk.index} arrived, {expect} expected")
                parts.append(chunk.data)
                expect += 1
                if chunk.last:
                    break
            else:
                raise PullError("peer_unavailable", "the stream ended before its last chunk")
        except grpc.aio.AioRpcError as e:
            cause = "timeout" if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED else "peer_unavailable"
            raise PullError(cause, f"{e.code().name}: {e.details()}") from None
        try:
            return handoff.from_bytes(b"".join(parts), specs, leaf_axes, num_pages, fmt)
        except ValueError as e:
            raise PullError("bad_payload", str(e)) from None


class JaxTransferTransport:
    """One transfer server per process (started on first use, bound to ``host``; its address
    as others reach it names ``advertise_host`` instead)."""

    name = "transfer"

    def __init__(self, host: str = "127.0.0.1", advertise_host: str | None = None):
        self.host, self.advertise_host = host, advertise_host or host
        self._server = None
        self._lock = threading.Lock()
        self.abandoned = 0  # pulls the watchdog gave up on (their threads stay blocked)

    @property
    def server(self):
        with self._lock:
            if self._server is None:
                from jax.experimental import transfer

                # Transport addresses must be given: without them the server process aborts.
                self._server = transfer.start_transfer_server(jax.local_devices()[0].client, f"{self.host}:0",
                                                              [f"{self.host}:0"])
            return self._server

    @property
    def address(self) -> str:
        """Where peers pull from: the bound port on the advertised host."""
        return f"{self.advertise_host}:{self.server.address().rsplit(':', 1)[1]}"

    def offer(self, transfer_id: str, payload: handoff.KvPayload) -> None:
        """Make ``payload`` pullable once under ``transfer_id`` (whole arrays on one device)."""
        home = jax.local_devices()[0]
        self.server.await_pull(transfer_uuid(transfer_id), [jax.device_put(x, home) for x in payload.leaves])

    async def _pull(self, address: str, uuid: int, specs, timeout: float):
        """``pull`` on a daemon thread; the watchdog abandons it after ``timeout`` seconds."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def run():
            try:
                out = self.server.connect(address).pull(uuid, specs)
                out = [jax.block_until_ready(x) for x in out]
                loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(out))
            except Exception as e:  # noqa: BLE001 - a dead peer: "Connection closed"
                err = e
                loop.call_soon_threadsafe(lambda: fut.done() or fut.set_exception(err))

        threading.Thread(target=run, name=f"kv-pull-{uuid:x}", daemon=True).start()
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
        except asyncio.TimeoutError:
            self.abandoned += 1
            raise PullError("timeout", f"no payload within {timeout:g}s (pull abandoned)") from None
        except PullError:
            raise
        except Exception as e:  # noqa: BLE001
            raise PullError("peer_unavailable", f"{type(e).__name__}: {e}") from None

    async def pull(self, offer: hpb.HandoffOffer, specs, leaf_axes, num_pages: int, fmt: str,
                   timeout: float, metadata: tuple = ()) -> handoff.KvPayload:
        """metadata: unused (the transfer library's sockets carry no credentials)."""
        home = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        specs = [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=home) for s in specs]
        leaves = await self._pull(offer.transfer_address, transfer_uuid(offer.transfer_id), specs, timeout)
        return handoff.KvPayload(fmt, num_pages, specs[0].shape[leaf_axes[0]], list(leaves))

    async def drain(self, transfer_id: str, specs, timeout: float = 10.0) -> bool:
        """Pull our own unpulled offer so the transfer server lets go of it (the library has
        no cancel); False if that did not finish in time."""
        home = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        specs = [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=home) for s in specs]
        try:
            await self._pull(self.server.address(), transfer_uuid(transfer_id), specs, timeout)
            return True
        except PullError as e:
            log.warning("draining KV offer %s: %s", transfer_id, e)
            return False
