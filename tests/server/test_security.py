"""API keys, TLS / mTLS, Abort ownership, the metrics endpoint on loopback, and a ModelInfo
that does not disclose the checkpoint's path."""
import asyncio
import ssl
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2_grpc

from jaxserve.client import Client, finish_reason
from jaxserve.server.address import advertised_host, is_unspecified, join
from jaxserve.server.auth import ApiKeys, PeerCredentials, forwarded, identity_of, keys_from, server_credentials
from jaxserve.server.guard import needs_key

from .certs import make_certs
from .conftest import CONVERSATION, http_call
from .serve_process import ServeProcess, serve_args, server_env

UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED


def test_api_keys_from_either_header_and_nothing_else():
    keys = ApiKeys(["k-one", "k-two"])
    one, two = identity_of("k-one"), identity_of("k-two")
    assert one != two and "k-one" not in one
    assert keys.identity([("authorization", "Bearer k-one")]) == one
    assert keys.identity([("authorization", "bearer  k-two ")]) == two
    assert keys.identity([("x-api-key", "k-two")]) == two
    for md in ([], None, [("authorization", "Bearer k-on")], [("authorization", "k-one")],
               [("x-api-key", "k-one2")], [("x-other", "k-one")], [("authorization", "Basic k-one")]):
        assert keys.identity(md) is None, md
    assert ApiKeys().identity([]) == "" and not ApiKeys().enabled  # no keys: everyone, one identity
    with pytest.raises(ValueError):
        ApiKeys(["has space"])


def test_keys_come_from_flags_and_the_environment():
    keys = keys_from(["a1"], {"JAXSERVE_API_KEY": "b2, c3"})
    assert len(keys) == 3 and keys.identity([("x-api-key", "c3")]) == identity_of("c3")
    assert not keys_from(None, {}).enabled


def test_tls_options_must_come_in_pairs():
    for cert, key, ca in (("c.pem", None, None), (None, "k.pem", None), (None, None, "ca.pem")):
        with pytest.raises(ValueError):
            server_credentials(cert, key, ca)
    assert server_credentials(None, None) is None


def test_every_service_needs_a_key_but_health_and_reflection():
    for method in ("/jaxserve.v1.JaxServe/Generate", "/jaxserve.v1.KvHandoff/PullPages",
                   "/jaxserve.v1.KvHandoff/Decode", "/some.future.Service/Call", "/bogus"):
        assert needs_key(method), method
    for method in ("/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch",
                   "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"):
        assert not needs_key(method), method


def test_peer_credentials_come_in_consistent_sets(tmp_path):
    with pytest.raises(ValueError, match="both --worker-cert and --worker-key"):
        PeerCredentials(ca=b"ca", cert=b"c")
    with pytest.raises(ValueError, match="needs --worker-ca"):
        PeerCredentials(cert=b"c", key=b"k")
    with pytest.raises(ValueError, match="visible ASCII"):
        PeerCredentials(api_key="two words")
    assert PeerCredentials(api_key="k1").metadata == (("authorization", "Bearer k1"),)
    assert PeerCredentials().metadata == () and not PeerCredentials().tls
    (tmp_path / "ca.pem").write_bytes(b"CA")
    p = PeerCredentials.from_files(str(tmp_path / "ca.pem"), environ={"JAXSERVE_WORKER_API_KEY": " env-k "})
    assert (p.ca, p.tls, p.api_key) == (b"CA", True, "env-k")
    assert PeerCredentials.from_files(api_key="flag", environ={"JAXSERVE_WORKER_API_KEY": "env"}).api_key == "flag"
    md = [("authorization", "Bearer x"), ("x-api-key", "y"), ("x-session-affinity", "s"), ("x-api-key", b"z")]
    assert forwarded(md) == (("authorization", "Bearer x"), ("x-api-key", "y"))


def test_the_advertised_host_is_one_peers_can_reach():
    assert advertised_host("10.1.2.3") == "10.1.2.3"
    assert advertised_host("127.0.0.1", "worker-3.example") == "worker-3.example"
    for bad in ("0.0.0.0", "::", "[::]", ""):
        assert is_unspecified(bad)
        with pytest.raises(ValueError, match="not an address peers can connect to"):
            advertised_host("127.0.0.1", bad)
    for bind in ("0.0.0.0", "::"):  # every interface: this machine's routable address, or a refusal
        try:
            host = advertised_host(bind)
        except ValueError as e:
            assert "--advertise-host" in str(e)
        else:
            assert not is_unspecified(host) and not host.startswith("127."), host
    assert join("::1", 5) == "[::1]:5" and join("h", 5) == "h:5"


def test_serve_refuses_an_unspecified_advertisement_before_loading(capsys):
    from jaxserve.server.cli import main

    assert main(["serve", "--role", "prefill", "--advertise-host", "0.0.0.0", "--metrics-port", "-1"]) == 2
    assert "not an address peers can connect to" in capsys.readouterr().err


def test_serve_defaults_keep_metrics_on_loopback():
    import argparse

    from jaxserve.server.cli import register_serve

    parser = argparse.ArgumentParser()
    register_serve(parser.add_subparsers())
    args = parser.parse_args(["serve", "--host", "0.0.0.0"])
    assert (args.metrics_host, args.max_id_length, args.api_key) == ("127.0.0.1", 256, None)


def test_tls_without_client_certificates(tmp_path):
    """Server-only TLS: the client verifies the server with the test CA; plaintext fails."""
    certs = make_certs(tmp_path)
    creds = server_credentials(str(certs.server_cert), str(certs.server_key))

    async def main():
        server = grpc.aio.server()
        servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        port = server.add_secure_port("127.0.0.1:0", creds)
        await server.start()
        try:
            return await asyncio.to_thread(_tls_probe, f"127.0.0.1:{port}", certs.ca.read_bytes())
        finally:
            await server.stop(None)

    assert asyncio.run(main()) == ("SERVING", grpc.StatusCode.UNAVAILABLE)


def _tls_probe(target, ca):
    with Client(target, root_certificates=ca) as c:
        status = c.health(timeout=10)
    with Client(target) as plain:
        with pytest.raises(grpc.RpcError) as e:
            plain.health(timeout=5)
    return status, e.value.code()


def _code(fn):
    try:
        fn()
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def test_serve_with_mtls_and_api_keys(tiny_text_model, cases, tmp_path, capsys, monkeypatch):
    """One `jaxserve serve` on 127.0.0.2 with TLS, required client certificates and two keys
    (one from --api-key, one from $JAXSERVE_API_KEY)."""
    certs = make_certs(tmp_path, ips=("127.0.0.2",))
    args = serve_args(tiny_text_model, "--host", "127.0.0.2", "--metrics-port", "0", "--api-key", "key-A",
                      "--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key),
                      "--tls-client-ca", str(certs.ca), "--http-port", "0")
    env = server_env(JAXSERVE_API_KEY="key-B")
    tls = dict(root_certificates=certs.ca.read_bytes(), private_key=certs.client_key.read_bytes(),
               certificate_chain=certs.client_cert.read_bytes())
    with ServeProcess(args, env) as server:
        listening = server.wait_for("listening on", timeout=120)
        assert "TLS, 2 API key(s)" in listening, listening
        assert "metrics on 127.0.0.1," in listening, listening
        metrics_port = int(listening.split("metrics port ")[1].split(")")[0])
        http_base = server.wait_for("OpenAI-compatible HTTP API on", timeout=30).split(" on ")[1].split()[0]
        target = server.wait_for("SERVING on", timeout=120).split("SERVING on ")[1].split()[0]
        assert target.startswith("127.0.0.2:")
        prompt, kw, want = cases["ids_greedy"]
        with Client(target, timeout=60, api_key="key-A", **tls) as a, Client(target, timeout=60, **tls) as anon, \
                Client(target, timeout=60, api_key="key-C", **tls) as wrong:
            assert list(a.generate(prompt, **kw).token_ids) == list(want)
            assert anon.health() == "SERVING"  # health stays open
            for c in (anon, wrong):
                assert _code(lambda: c.generate(prompt, **kw)) == UNAUTHENTICATED
                assert _code(c.model_info) == UNAUTHENTICATED
                assert _code(lambda: list(c.generate_stream(prompt, **kw))) == UNAUTHENTICATED
            b_header = (("x-api-key", "key-B"),)
            r = anon.stub.Generate(_req(prompt, kw), metadata=b_header)
            assert list(r.token_ids) == list(want)
            info = a.model_info()
            assert info.model == Path(tiny_text_model).name
            _check_abort_ownership(a, anon, target, tls)
            _check_http(http_base, certs, a.generate(CONVERSATION, max_tokens=4).text, Path(tiny_text_model).name)
        _check_client_cli(target, certs, capsys, monkeypatch)
        with Client(target, api_key="key-A") as plain:  # TLS is required
            assert _code(lambda: plain.health(timeout=5)) == grpc.StatusCode.UNAVAILABLE
        no_cert = dict(root_certificates=certs.ca.read_bytes())
        with Client(target, api_key="key-A", **no_cert) as c:  # so is a client certificate
            assert _code(lambda: c.health(timeout=5)) == grpc.StatusCode.UNAVAILABLE
        body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
        assert 'jaxserve_requests_total{outcome="unauthenticated",rpc="Generate"} 2.0' in body
        with pytest.raises(urllib.error.URLError):  # not on --host's address
            urllib.request.urlopen(f"http://127.0.0.2:{metrics_port}/metrics", timeout=5)
        server.proc.terminate()
        assert server.wait(timeout=30) == 0, server.output
    assert "key-A" not in server.output and "key-B" not in server.output


def _check_http(base: str, certs, want_text: str, model: str):
    """The HTTP API of the same server: TLS with a required client certificate, the same keys
    (either header), /health open."""
    assert base.startswith("https://127.0.0.2:") and base.endswith("/v1")
    ctx = ssl.create_default_context(cafile=str(certs.ca))
    ctx.load_cert_chain(str(certs.client_cert), str(certs.client_key))
    body = {"model": model, "messages": CONVERSATION, "max_tokens": 4, "temperature": 0}
    assert http_call(base.removesuffix("/v1") + "/health", context=ctx)[0] == 200
    for headers in ({}, {"authorization": "Bearer key-C"}):
        status, err, _ = http_call(base + "/chat/completions", body, headers, context=ctx)
        assert status == 401 and err["error"]["type"] == "authentication_error"
    assert http_call(base + "/models", context=ctx)[0] == 401
    for headers in ({"authorization": "Bearer key-A"}, {"x-api-key": "key-B"}):
        status, r, _ = http_call(base + "/chat/completions", body, headers, context=ctx)
        assert status == 200 and r["choices"][0]["message"]["content"] == want_text
    no_cert = ssl.create_default_context(cafile=str(certs.ca))
    with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
        http_call(base + "/models", headers={"x-api-key": "key-A"}, context=no_cert)


def _req(prompt, kw):
    from jaxserve.client import build_request

    return build_request(prompt, **kw)


def _check_client_cli(target, certs, capsys, monkeypatch):
    """`jaxserve client` with --tls-* options and the key from $JAXSERVE_API_KEY or --api-key."""
    import json

    from jaxserve.server.cli import main

    tls = ["--target", target, "--tls-ca", str(certs.ca), "--tls-cert", str(certs.client_cert),
           "--tls-key", str(certs.client_key)]
    monkeypatch.setenv("JAXSERVE_API_KEY", "key-B")
    assert main(["client", *tls, "info"]) == 0
    assert json.loads(capsys.readouterr().out)["architecture"] == "LlamaForCausalLM"
    assert main(["client", *tls, "--api-key", "key-Z", "info"]) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err


def _check_abort_ownership(a, anon, target, tls):
    """With keys, Abort reaches only the caller's own requests."""
    it = a.generate_stream([5, 6, 7], max_tokens=200, ignore_eos=True, request_id="owned-by-A")
    assert next(it).WhichOneof("event") == "start"
    with Client(target, timeout=60, api_key="key-B", **tls) as b:
        assert list(b.abort("owned-by-A").not_found) == ["owned-by-A"]
    assert _code(lambda: anon.abort("owned-by-A")) == UNAUTHENTICATED
    assert list(a.abort("owned-by-A").aborted) == ["owned-by-A"]
    events = list(it)
    assert finish_reason(events[-1].end) == "abort" and events[-1].end.usage.completion_tokens < 200
