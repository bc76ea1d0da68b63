"""What a server says about itself at start: the log lines once it is bound (addresses,
security, matmul paths, memory, the KV handoff's advertised address and peer credentials) and
the labels of its ``jaxserve_model`` info metric."""
from __future__ import annotations

import logging

log = logging.getLogger("jaxserve.server")


def info_labels(info) -> dict[str, str]:
    """The ``jaxserve_model`` info metric's labels from a ModelInfo."""
    return {
        "architecture": info.architecture, "model": info.model, "fingerprint": info.fingerprint,
        "prefill_weights": info.prefill.weights, "decode_weights": info.decode.weights,
        "prefill_kv": info.prefill.kv_cache, "decode_kv": info.decode.kv_cache, "replica_id": info.replica_id,
    }


def log_listening(server) -> None:
    """Log a bound ``Server``: where it listens, its security, each phase's matmul path and memory."""
    keys, info = server.keys, server.info
    log.info("listening on %s:%d (%s, %s; metrics %s; HTTP %s); warming up", server.host, server.port,
             "TLS" if server.credentials is not None else "plaintext",
             f"{len(keys)} API key(s)" if keys.enabled else "no API key", server.metrics_target,
             server.http_target or "off")
    for phase in ("prefill", "decode"):
        log.info("%s matmuls: %s", phase, getattr(info, phase).matmul_path)
    for phase, rows in server.model.weight_path_rows().items():
        for row in rows:
            if row.refused:
                log.warning("%s matmuls: %s (%s) runs on %s, not the %s kernel: %s", phase, row.name, row.format,
                            row.path, row.format, row.refused)
    m = info.memory
    log.info("memory: weights %s B prefill, %s B decode, %s B resident; KV %s B = %d pages x %d tokens "
             "(%d B/token, %s tokens)", f"{m.weight_bytes_prefill:,}", f"{m.weight_bytes_decode:,}",
             f"{m.weight_bytes_resident:,}", f"{m.kv_bytes:,}", m.kv_pages, info.page_size,
             m.kv_bytes_per_token, f"{m.max_cached_tokens:,}")


def log_handoff(server, peer, kv_transport: str) -> None:
    """A prefill / decode worker: the address its offers name and how it calls other workers;
    a warning when TLS is on but the transfer transport's data sockets are not encrypted."""
    if server.handoff is None:
        return
    log.info("KV handoff: offers name %s; calls to workers %s", server.advertised, peer.describe())
    if kv_transport == "transfer" and (server.credentials is not None or peer.tls):
        log.warning("--kv-transport transfer: the KV bytes move over jax.experimental.transfer's own sockets, "
                    "unencrypted and unauthenticated, whatever the TLS settings (use grpc across untrusted networks)")
