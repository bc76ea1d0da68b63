"""Who may call: API keys (request metadata) and TLS (server certificate, optional client
certificates). Both are off unless configured; ``jaxserve serve`` warns when it listens
beyond loopback with neither.

A key is sent as ``authorization: Bearer <key>`` or ``x-api-key: <key>``. Each configured key
is one identity (named by a hash prefix, never the key itself); every presented value is
compared with every key by ``hmac.compare_digest``.
"""
from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path
from typing import Iterable, Mapping

import grpc

API_KEY_ENV = "JAXSERVE_API_KEY"
AUTH_HEADER = "authorization"
API_KEY_HEADER = "x-api-key"
_BEARER = "bearer "


def identity_of(key: str) -> str:
    """A stable, non-secret name for a key: for logs and request ownership."""
    return "key:" + hashlib.sha256(key.encode()).hexdigest()[:12]


class ApiKeys:
    """The accepted keys (empty: authentication off, everyone is the identity "")."""

    def __init__(self, keys: Iterable[str] = ()):
        keys = list(dict.fromkeys(keys))
        for k in keys:
            if not k or any(not 0x21 <= ord(c) <= 0x7E for c in k):
                raise ValueError("an API key must be non-empty visible ASCII (no spaces or control characters)")
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
