"""A router (``RouterThread``) in front of in-process fake workers, with fast health checks."""
from __future__ import annotations

import contextlib
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from .fakes import LoopThread, start_fakes


@pytest.fixture(scope="session")
def fake_loop():
    return LoopThread()


@contextlib.contextmanager
def routed(fake_loop, roles: dict[str, str], **router_kwargs):
    """roles: fake name -> "both" | "prefill" | "decode". Yields (router thread, Client, {name: fake})."""
    from jaxserve.client import Client
    from jaxserve.router.app import RouterThread

    fakes = dict(zip(roles, fake_loop.run(start_fakes(list(roles)))))
    kw = dict(health_interval_s=0.1, health_timeout_s=0.5, unhealthy_after=1) | router_kwargs
    rt = RouterThread([(f.address, roles[n]) for n, f in fakes.items()], **kw).start()
    client = Client(rt.target, timeout=15)
    try:
        yield rt, client, fakes
    finally:
        client.close()
        rt.stop()
        for f in fakes.values():
            fake_loop.run(f.server.stop(0))


def health(target: str, service: str = "") -> str:
    with grpc.insecure_channel(target) as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


def scrape(port: int) -> dict:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def metric(rt, name: str, **labels) -> float:
    return scrape(rt.router.metrics_port).get((name, tuple(sorted(labels.items()))), 0.0)


def eventually(fn, timeout: float = 5.0):
    end = time.monotonic() + timeout
    while True:
        value = fn()
        if value or time.monotonic() > end:
            return value
        time.sleep(0.02)


def session_for(address: str, addresses, prefix: str = "sess") -> str:
    """A session id whose rendezvous choice among `addresses` is `address`."""
    from jaxserve.router.affinity import rendezvous_order

    return next(s for s in (f"{prefix}-{i}" for i in range(1000)) if rendezvous_order(s, list(addresses))[0] == address)
