"""Addresses, for IPv4 and IPv6 alike: gRPC and records write an IPv6 host in brackets ("[::1]:5000"), libp2p
multiaddrs name the family ("/ip6/::1/tcp/5000")."""

from __future__ import annotations

import errno
import ipaddress
import socket

DHT_WAIT_TIMEOUT_S = 3.0  # hivemind's default
DHT_WAIT_TIMEOUT_HELP = (
    "seconds this peer's DHT node waits for another node's answer before it counts as lost and is skipped for a "
    "while (hivemind's default is 3): a frozen peer's DHT node delays announces, lookups and all-reduce matchmaking "
    "by this much"
)
SWARM_KEY_HELP = (
    "file holding a private swarm's key (swarm-dht --new-swarm-key FILE writes one): only peers given it take part "
    "(swarm/protocol/access.py); without it the swarm is open"
)


def ip_version(host: str) -> int | None:
    """4 or 6 for an IP address (brackets allowed), None for a host name."""
    try:
        return ipaddress.ip_address(host.strip("[]")).version
    except ValueError:
        return None


def join_host_port(host: str, port: int) -> str:
    """ "host:port", with an IPv6 host in brackets."""
    host = host.strip("[]")
    return f"[{host}]:{port}" if ip_version(host) == 6 else f"{host}:{port}"


def is_unspecified(host: str) -> bool:
    """0.0.0.0, ::, or empty: an address to listen on, not one to dial."""
    try:
        return not host or ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return False  # a host name


def is_own_address(host: str) -> bool:
    """Whether `host` is an IP address of this machine: one a socket can bind to. The address the swarm sees us at
    is not, behind NAT (a home router, or a cloud's 1:1 NAT)."""
    if (version := ip_version(host)) is None:
        return False
    family = socket.AF_INET6 if version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((host.strip("[]"), 0))
    except OSError:
        return False
    return True


def tcp_multiaddr(host: str, port: int) -> str:
    """libp2p's address for an IP and port; a host name resolves through DNS."""
    proto = {4: "ip4", 6: "ip6", None: "dns"}[ip_version(host)]
    return f"/{proto}/{host.strip('[]')}/tcp/{port}"


def listen_multiaddrs(host: str, port: int) -> list[str]:
    """Where a libp2p node listens for `host`: "::" means both families (libp2p's IPv6 listener takes IPv6 only)."""
    if ip_version(host) == 6 and is_unspecified(host):
        return [tcp_multiaddr("0.0.0.0", port), tcp_multiaddr("::", port)]
    return [tcp_multiaddr(host, port)]


def port_in_use(host: str, port: int) -> bool:
    """Whether something listens on TCP `port` of `host` (an unspecified host: of any address). A gRPC listener (and
    libp2p's, by default) sets SO_REUSEPORT: a second one on the same port starts, and the kernel splits connections;
    this probe sets only SO_REUSEADDR (a port whose last server just ended, its connections in TIME_WAIT, is free), and
    so conflicts with any listener. Racy by nature: it says a port is taken before a server starts, nothing more."""
    try:
        infos = socket.getaddrinfo(host.strip("[]") or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror:
        return False  # a host we cannot resolve: the server's own bind says so
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(address)
                s.listen(1)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    return True
    return False


def check_ports_free(host: str, ports: dict[str, int]) -> None:
    """ValueError naming the flag if a port of `ports` (flag -> port; 0: any free port) is in use on `host`, out of
    range, or shared by two flags. Call it before starting the servers that bind them: a busy port is refused at
    start, in one line."""
    seen: dict[int, str] = {}
    for flag, port in ports.items():
        if not 0 <= port < 65536:
            raise ValueError(f"{flag} must be in [0, 65535], got {port}")
        if not port:
            continue
        if port in seen:
            raise ValueError(f"{seen[port]} and {flag} must differ, both are {port}")
        seen[port] = flag
        if port_in_use(host, port):
            raise ValueError(
                f"{flag} {port}: port {port} is in use on {host} (another swarm peer?): choose another, or 0 for any "
                "free port"
            )
