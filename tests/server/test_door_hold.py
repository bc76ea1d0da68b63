"""The door's hold (``jaxserve.server.refusals.DoorHold``): a refusal at the door is answered when
the client's door reopens or ``--door-hold`` seconds later, whichever is sooner; a client has at
most ``max_held`` calls held; the other clients are served meanwhile.

The hold alone on the event loop, then a real server on the mock engine with two API keys
(a real HTTP client over a real socket and gRPC clients)."""
import asyncio
import threading
import time

import grpc
import pytest

from jaxserve.server.auth import identity_of
from jaxserve.server.refusals import DoorHold

from .conftest import LIMITS, MAX_WAITING, MOCK_ENGINE, MODEL_NAME, http_call

BAD, GOOD = "bad-client-key", "good-client-key"
RATE, HOLD = 0.5, 0.8  # the bad client's door reopens 2 s after it closes; a refusal is held 0.8 s


def test_hold_sleeps_the_shorter_of_the_wait_and_the_hold_for_max_held_calls():
    async def run():
        door = DoorHold(0.3, max_held=2)

        async def timed(client, wait):
            t = time.perf_counter()
            await door.hold(client, wait)
            return time.perf_counter() - t

        both = asyncio.gather(timed("a", 5.0), timed("a", 5.0))
        await asyncio.sleep(0.05)
        assert door.held("a") == 2
        third, other = await timed("a", 5.0), asyncio.ensure_future(timed("b", 5.0))  # "a" is at its bound
        assert third < 0.05
        held = await both
        assert all(0.29 < s < 2.0 for s in held), held
        assert 0.29 < await other < 2.0  # another client has its own bound
        assert door.held("a") == door.held("b") == 0
        assert await timed("a", 0.1) < 0.29  # the door reopens before the hold ends
        assert await DoorHold(0.0).hold("a", 5.0) is None

    asyncio.run(run())
    with pytest.raises(ValueError, match="door hold"):
        DoorHold(-1)


@pytest.fixture(scope="module")
def held():
    from jaxserve.server.app import ServerThread
    from jaxserve.server.auth import ApiKeys
    from jaxserve.server.limits import ServeLimits
    from jaxserve.testing import MockLLM

    limits = ServeLimits(**{**LIMITS, "client_refusal_rate": RATE, "door_hold_s": HOLD})
    st = ServerThread(MockLLM(**MOCK_ENGINE), max_waiting=MAX_WAITING, limits=limits, http_port=0,
                      served_model_name=MODEL_NAME, keys=ApiKeys([BAD, GOOD])).start()
    st.wait_ready()
    yield st
    st.stop()


def _post(st, key, body):
    return http_call(st.http_target + "/completions", body, {"authorization": f"Bearer {key}"})


def test_a_refusal_at_the_door_is_held_while_other_clients_are_served(held):
    from jaxserve.client import Client

    bad_body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2, "temperature": -1}
    assert _post(held, BAD, bad_body)[0] == 400  # its one token (burst 1): the door closes
    t = time.perf_counter()
    status, body, _ = _post(held, BAD, bad_body)
    assert status == 429 and "--client-refusal-rate" in body["error"]["message"]
    assert time.perf_counter() - t > 0.75 * HOLD  # held before it was answered
    ends, errors = {}, []

    def bad_call(i):
        try:
            with Client(held.target, timeout=30, api_key=BAD) as c:
                c.generate([5, 6, 7], max_tokens=2)
        except grpc.RpcError as e:
            errors.append(e.code())
        ends[i] = time.perf_counter()

    t = time.perf_counter()
    calls = [threading.Thread(target=bad_call, args=(i,)) for i in range(4)]
    for c in calls:
        c.start()
    time.sleep(0.2)
    assert held.server.core.door.held(identity_of(BAD)) >= 1  # a dict read: safe off the event loop
    with Client(held.target, timeout=30, api_key=GOOD) as c:
        assert len(c.generate([5, 6, 7], max_tokens=2).token_ids) == 2
    good_done = time.perf_counter()
    for c in calls:
        c.join(30)
    assert errors == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 4
    assert all(end > good_done for end in ends.values())  # the good client was not kept behind them
    assert min(ends.values()) - t > 0.75 * HOLD
