"""The address a server gives others to reach it: what a prefill worker writes into its KV
offers (the decode worker pulls from there) and its transfer server's address.

``--advertise-host`` sets it. Without it, a server bound to one address advertises that one;
bound to every interface (0.0.0.0, ::, empty) it advertises the first address of this machine
that is neither loopback nor unspecified: its hostname's, else the one the default route
leaves from. With none it refuses to start, naming the flag. An unspecified advertisement
(``--advertise-host 0.0.0.0``) is refused: no peer can connect to it.
"""
from __future__ import annotations

import ipaddress
import socket


def is_unspecified(host: str) -> bool:
    host = host.strip("[]")
    if not host:
        return True
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False  # a host name


def _routable(ip: str) -> bool:
    try:
        a = ipaddress.ip_address(ip.split("%")[0])
    except ValueError:
        return False
    return not (a.is_loopback or a.is_unspecified or a.is_link_local or a.is_multicast)


def _hostname_addresses(hostname: str, family: int) -> list[str]:
    try:
        infos = socket.getaddrinfo(hostname, None, family, socket.SOCK_STREAM)
    except OSError:
        return []
    return [info[4][0] for info in infos]


def _default_route_address(family: int) -> str | None:
    """The local address of a UDP socket 'connected' towards a public address: the interface
    the default route leaves from (connect on UDP sends nothing)."""
    probe = ("192.0.2.1", 9) if family == socket.AF_INET else ("2001:db8::1", 9)
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(probe)
            return s.getsockname()[0]
    except OSError:
        return None


def machine_address(family: int = socket.AF_INET, hostname: str | None = None) -> str | None:
    """A routable address of this machine in `family`, or None."""
    for ip in _hostname_addresses(hostname or socket.gethostname(), family):
        if _routable(ip):
            return ip
    ip = _default_route_address(family)
    return ip if ip is not None and _routable(ip) else None


def advertised_host(bind_host: str, advertise_host: str | None = None) -> str:
    """The host others reach a server bound to `bind_host` at; ValueError with the flag to set
    when there is none."""
    if advertise_host is not None:
        if is_unspecified(advertise_host):
            raise ValueError(f"--advertise-host {advertise_host!r} is not an address peers can connect to; give "
                             "this machine's routable IP or DNS name")
        return advertise_host
    if not is_unspecified(bind_host):
        return bind_host
    # :: is dual-stack on Linux: an IPv4 address of this machine reaches it too.
    families = (socket.AF_INET6, socket.AF_INET) if ":" in bind_host else (socket.AF_INET,)
    ip = next(filter(None, (machine_address(f) for f in families)), None)
    if ip is None:
        raise ValueError(f"bound to {bind_host or 'every interface'} and this machine has no routable address to "
                         "advertise to peers; pass --advertise-host (its IP or DNS name)")
    return ip


def join(host: str, port: int) -> str:
    """host:port, an IPv6 literal in brackets."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
