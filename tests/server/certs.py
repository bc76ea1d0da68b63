"""Throw-away TLS material for tests, made with the `openssl` binary: a CA, a server
certificate for given IP addresses, and a client certificate (EC P-256: fast to make)."""
from __future__ import annotations

import dataclasses
import shutil
import subprocess
from pathlib import Path

import pytest


@dataclasses.dataclass
class Certs:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _openssl(*args, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


def _signed(d: Path, name: str, subject: str, extensions: str) -> None:
    (d / f"{name}.ext").write_text(extensions + "\n")
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", f"{name}.key",
             "-out", f"{name}.csr", "-subj", subject, cwd=d)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext", cwd=d)


def make_certs(d: Path, ips=("127.0.0.1",)) -> Certs:
    if shutil.which("openssl") is None:
        pytest.skip("the openssl binary is needed to make test certificates")
    d.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", "ca.key",
             "-out", "ca.pem", "-days", "2", "-subj", "/CN=jaxserve test CA", cwd=d)
    sans = ",".join([f"IP:{ip}" for ip in ips] + ["DNS:localhost"])
    _signed(d, "server", "/CN=localhost", f"subjectAltName={sans}\nextendedKeyUsage=serverAuth")
    _signed(d, "client", "/CN=jaxserve test client", "extendedKeyUsage=clientAuth")
    return Certs(d / "ca.pem", d / "server.pem", d / "server.key", d / "client.pem", d / "client.key")
