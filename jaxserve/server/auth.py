"""Who may call: API keys (request metadata) and TLS (server certificate, optional client
certificates). Both are off unless configured; ``jaxserve serve`` warns when it listens
beyond loopback with neither.

``PeerCredentials`` is the other side: how a router or worker calls other jaxserve processes
(router -> worker, decode worker -> prefill worker): a CA bundle to verify them (TLS on), an
optional client certificate and key (mTLS) and the API key to send.

A key is sent as ``authorization: Bearer <key>`` or ``x-api-key: <key>``. Each configured key
is one identity (named by a hash prefix, never the key itself); every presented value is
compared with every key by ``hmac.compare_digest``.
"""
from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping

import grpc

API_KEY_ENV = "JAXSERVE_API_KEY"
WORKER_API_KEY_ENV = "JAXSERVE_WORKER_API_KEY"
AUTH_HEADER = "authorization"
API_KEY_HEADER = "x-api-key"
_BEARER = "bearer "


def identity_of(key: str) -> str:
    """A stable, non-secret name for a key: for logs and request ownership."""
    return "key:" + hashlib.sha256(key.encode()).hexdigest()[:12]


def check_key(key: str) -> None:
    if not key or any(not 0x21 <= ord(c) <= 0x7E for c in key):
        raise ValueError("an API key must be non-empty visible ASCII (no spaces or control characters)")


class ApiKeys:
    """The accepted keys (empty: authentication off, everyone is the identity "")."""

    def __init__(self, keys: Iterable[str] = ()):
        keys = list(dict.fromkeys(keys))
        for k in keys:
            check_key(k)
        self._keys = [(k.encode(), identity_of(k)) for k in keys]

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def identity(self, metadata) -> str | None:
        """The caller's identity from request metadata [(key, value), ...]; None = rejected.
        With no keys configured everyone is accepted as ""."""
        if not self._keys:
            return ""
        found = None
        for name, value in metadata or ():
            if isinstance(value, bytes):
                continue
            if name == AUTH_HEADER and value[: len(_BEARER)].lower() == _BEARER:
                value = value[len(_BEARER):].strip()
            elif name != API_KEY_HEADER:
                continue
            presented = value.encode()
            for key, ident in self._keys:  # no early exit: the time does not depend on which key
                if hmac.compare_digest(presented, key):
                    found = ident
        return found


def keys_from(flag_values: Iterable[str] | None, environ: Mapping[str, str] = os.environ) -> ApiKeys:
    """--api-key values plus $JAXSERVE_API_KEY (one key, or several separated by commas)."""
    keys = list(flag_values or ())
    keys += [k.strip() for k in environ.get(API_KEY_ENV, "").split(",") if k.strip()]
    return ApiKeys(keys)


def server_credentials(cert: str | None, key: str | None, client_ca: str | None = None):
    """grpc.ServerCredentials for TLS from PEM files, or None (plaintext) when no cert is
    given. With client_ca the server requires a client certificate signed by it (mTLS)."""
    if cert is None and key is None:
        if client_ca is not None:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
        return None
    if cert is None or key is None:
        raise ValueError("TLS needs both --tls-cert and --tls-key")
    ca = Path(client_ca).read_bytes() if client_ca else None
    return grpc.ssl_server_credentials([(Path(key).read_bytes(), Path(cert).read_bytes())],
                                       root_certificates=ca, require_client_auth=ca is not None)


def forwarded(metadata) -> tuple:
    """The credentials among a call's metadata, to pass on to the next hop."""
    return tuple((k, v) for k, v in (metadata or ()) if k in (AUTH_HEADER, API_KEY_HEADER) and isinstance(v, str))


@dataclass(frozen=True)
class PeerCredentials:
    """How this process calls other jaxserve processes. ca: PEM roots that verify the peer's
    certificate (None: plaintext); cert + key: a client certificate for peers that require one
    (``--tls-client-ca``); api_key: sent on every call (None: the caller's own credentials are
    passed on where there is a caller). The peer's address must match its certificate (IP or
    DNS subject alternative name)."""

    ca: bytes | None = None
    cert: bytes | None = None
    key: bytes | None = None
    api_key: str | None = None

    def __post_init__(self):
        self._check_pairs(self.ca is not None, self.cert is not None, self.key is not None)
        if self.api_key is not None:
            check_key(self.api_key)

    @staticmethod
    def _check_pairs(ca: bool, cert: bool, key: bool) -> None:
        if cert != key:
            raise ValueError("a client certificate needs both --worker-cert and --worker-key")
        if cert and not ca:
            raise ValueError("--worker-cert needs --worker-ca (a client certificate is sent over TLS only)")

    @classmethod
    def from_files(cls, ca: str | None = None, cert: str | None = None, key: str | None = None,
                   api_key: str | None = None, environ: Mapping[str, str] = os.environ) -> "PeerCredentials":
        """From the --worker-* flags (PEM paths); the key also from $JAXSERVE_WORKER_API_KEY."""
        def read(path):
            if path is None:
                return None
            try:
                return Path(path).read_bytes()
            except OSError as e:
                raise ValueError(f"cannot read {path}: {e.strerror}") from None

        cls._check_pairs(ca is not None, cert is not None, key is not None)

        api_key = api_key if api_key is not None else environ.get(WORKER_API_KEY_ENV, "").strip() or None
        return cls(read(ca), read(cert), read(key), api_key)

    @property
    def tls(self) -> bool:
        return self.ca is not None

    @property
    def metadata(self) -> tuple:
        return ((AUTH_HEADER, f"Bearer {self.api_key}"),) if self.api_key else ()

    def describe(self) -> str:
        tls = ("mTLS" if self.cert is not None else "TLS") if self.tls else "plaintext"
        return f"{tls}, {'API key' if self.api_key else 'no API key of its own'}"

    def _grpc_credentials(self):
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)

    def aio_channel(self, address: str, options=()) -> grpc.aio.Channel:
        if not self.tls:
            return grpc.aio.insecure_channel(address, options=options)
        return grpc.aio.secure_channel(address, self._grpc_credentials(), options=options)

    def channel(self, address: str, options=()) -> grpc.Channel:
        """A synchronous channel (clients, tests)."""
        if not self.tls:
            return grpc.insecure_channel(address, options=options)
        return grpc.secure_channel(address, self._grpc_credentials(), options=options)


def add_peer_args(p, key_help: str) -> None:
    """The --worker-* flags: credentials for calls to workers (``PeerCredentials.from_files``)."""
    p.add_argument("--worker-ca", default=None,
                   help="PEM CA certificate(s): call workers over TLS, verifying their certificates with these "
                        "(the address used must be in the certificate); default plaintext")
    p.add_argument("--worker-cert", default=None,
                   help="PEM client certificate sent to workers that require one (their --tls-client-ca); "
                        "with --worker-key and --worker-ca")
    p.add_argument("--worker-key", default=None, help="PEM private key of --worker-cert")
    p.add_argument("--worker-api-key", default=None, help=key_help + f"; also ${WORKER_API_KEY_ENV}")


def peer_from_args(args) -> PeerCredentials:
    return PeerCredentials.from_files(args.worker_ca, args.worker_cert, args.worker_key, args.worker_api_key)
