"""Fair share between clients over the real server (tiny model), and the per-client queue
bound of ``Generations`` (with a stand-in engine loop: no model needed for it).

The server test checks the order of admission in the engine, not timings: one connection
holds every slot with more queued, a second connection's request is admitted before that
backlog; when the first client disconnects, every page comes back.
"""
import asyncio
import types

import grpc
import pytest

from jaxserve.client import AsyncClient
from jaxserve.server import errors
from jaxserve.server.generations import Generations, client_identity

from .conftest import ENGINE, IDS_B, on_the_mock_server


served, cases = on_the_mock_server()


def test_a_second_client_is_admitted_before_the_first_clients_backlog(served):
    slots = ENGINE["max_num_seqs"]
    loop_ = served.server.engine_loop

    def first_token(rid):
        stream = served.server.service.active[rid]
        return loop_.call(lambda e: e.get_request(stream.engine_id).first_token_time).result(10)

    async def main():
        # Each on a connection of its own (channels in one process share one by default).
        own = [("grpc.use_local_subchannel_pool", 1)]
        hog, good = (AsyncClient(served.target, timeout=60, channel=grpc.aio.insecure_channel(served.target, options=own))
                     for _ in range(2))
        started = asyncio.Queue()

        async def hog_one(i):  # 3 + 50 tokens: 7 pages each, every slot fits in the pool
            async for msg in hog.generate_stream([11, 12, 13], max_tokens=50, ignore_eos=True,
                                                 request_id=f"hog-{i}"):
                if msg.HasField("start"):
                    started.put_nowait(i)

        tasks = [asyncio.create_task(hog_one(i)) for i in range(slots + 2)]
        try:
            first = [await asyncio.wait_for(started.get(), 30) for _ in range(slots)]
            backlog = sorted(set(range(slots + 2)) - set(first))
            good_t = hog_t = None
            async for msg in good.generate_stream(IDS_B, max_tokens=4, ignore_eos=True, request_id="good"):
                if msg.HasField("delta") and good_t is None:
                    good_t = first_token("good")
                    hog_t = [first_token(f"hog-{i}") for i in backlog]
            # The backlog was queued first, yet the second client's request ran before it.
            assert good_t is not None and all(t is None or t > good_t for t in hog_t), (good_t, hog_t)
            assert loop_.call(lambda e: e.snapshot().preemptions).result(10) >= 1
        finally:
            for t in tasks:
                t.cancel()  # the first client disconnects
            await asyncio.gather(*tasks, return_exceptions=True)
            await hog.close()
            await good.close()

    asyncio.run(main())
    assert served.eventually_idle(), "a disconnected client's requests must free their pages"


# ---- the per-client queue bound (Generations with a stand-in engine loop) ---------------------


class _Loop:
    def __init__(self):
        self.waiting, self.recent_duration_s, self.sent = 0, 1.0, []

    def submit(self, stream, ids, params, **kw):
        self.waiting += 1
        self.sent.append(stream)


def _gens(limit):
    counter = types.SimpleNamespace(inc=lambda *a: None, set=lambda *a: None)
    metrics = types.SimpleNamespace(session_requests=counter, active_sessions=counter)
    g = Generations(_Loop(), metrics, max_waiting=100, max_num_seqs=4, max_queued_per_client=limit)
    g.phase = "serving"
    return g


def test_a_client_alone_may_queue_past_its_bound():
    g = _gens(2)
    for i in range(5):
        g.submit([1], [object()], f"a{i}", "", "", 0.0, client="A")
    assert len(g.engine_loop.sent) == 5


def test_a_client_at_its_bound_is_refused_while_another_is_in_flight():
    g = _gens(2)
    g.submit([1], [object()], "b0", "", "", 0.0, client="B")
    for i in range(2):
        g.submit([1], [object()], f"a{i}", "", "", 0.0, client="A")
    with pytest.raises(errors.ServeError) as e:
        g.submit([1], [object()], "a2", "", "", 0.0, client="A")
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-queued-per-client" in e.value.message
    assert e.value.retry_after_s > 0
    g.submit([1], [object()], "b1", "", "", 0.0, client="B")  # the other client is not held back
    g.engine_loop.sent[1].admitted = True  # one of A's is admitted: A may queue one more
    g.submit([1], [object()], "a3", "", "", 0.0, client="A")
    with pytest.raises(errors.ServeError):  # n choices count as n requests
        _two = [object(), object()]
        g.submit([1], _two, "a4", "", "", 0.0, client="A")


def test_no_bound_when_zero_and_the_identity_prefers_the_key():
    g = _gens(0)
    g.submit([1], [object()], "b0", "", "", 0.0, client="B")
    for i in range(10):
        g.submit([1], [object()], f"a{i}", "", "", 0.0, client="A")
    assert client_identity("key:0123456789ab", "ipv4:127.0.0.1:5555") == "key:0123456789ab"
    assert client_identity("", "ipv4:127.0.0.1:5555") == "ipv4:127.0.0.1:5555"
