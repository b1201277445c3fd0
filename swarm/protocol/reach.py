"""Can the swarm reach this server? Asked over libp2p, so it works before anyone can dial us, and with no central
service: every DHT node of the swarm (`swarm-dht` and every server) answers `ReachRequest`s, and a starting server
asks a few of them to dial its Stage service back.

A node dials what it is asked only once per asker per `MIN_INTERVAL_S`, at most `MAX_CONCURRENT` at a time, with one
Info call of `DIAL_TIMEOUT_S`, and says "reachable" only if the reply names the asker's own libp2p id: it cannot be
made to vouch for a third party, and answers only "yes", "no" or a short reason, never what it found there. It dials
an IP address or a DNS name only (no gRPC target schemes such as "unix:"), and its own machine's loopback only for an
asker on that machine.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import grpc
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.utils.multiaddr import Multiaddr

from swarm.net import ip_version, is_unspecified, join_host_port
from swarm.protocol import access
from swarm.protocol import wire_pb2 as pb
from swarm.protocol.rpc import StageStub, aio_channel
from swarm.protocol.tls import valid_cert

logger = logging.getLogger(__name__)
HANDLER = "swarm.v1.Reach"
DIAL_TIMEOUT_S = 3.0
MIN_INTERVAL_S = 10.0
MAX_CONCURRENT = 4
MAX_HOST_CHARS = 253
_LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")  # one dot-separated part of a DNS name
ASK_TIMEOUT_S = 2 * DIAL_TIMEOUT_S + 2.0  # the node's dial plus libp2p's round trips
PROOF_PURPOSE = b"reach"
TRANSIENT = ("busy", "no direct connection", "did not answer in time")  # declines that may pass


def host_of(maddr: Multiaddr) -> str | None:
    """The IP address of a libp2p multiaddr, or None if it has none (a relayed or DNS address)."""
    for proto in ("ip4", "ip6"):
        try:
            return maddr.value_for_protocol(proto)
        except Exception:  # multiaddr raises its own ProtocolLookupError, or ValueError, depending on the version
            continue
    return None


async def dial_back(host: str, port: int, expected_p2p_id: str, tls_cert: str = "") -> tuple[bool, str]:
    """One Info call to host:port (over TLS trusting `tls_cert` alone, if given): (True, "") if it answered naming
    `expected_p2p_id`, else (False, why)."""
    channel = aio_channel(join_host_port(host, port), tls_cert)
    try:
        reply = await StageStub(channel).info(pb.InfoRequest(), timeout=DIAL_TIMEOUT_S)
    except grpc.aio.AioRpcError as e:
        return False, f"{e.code().name.lower()} within {DIAL_TIMEOUT_S:.0f}s"
    finally:
        await channel.close()
    if reply.p2p_id != expected_p2p_id:
        return False, "a server answered there, but not the one asking"
    return True, ""


class ReachResponder:
    """Answers ReachRequests on a P2P instance (a DHT node's replica: `await dht.replicate_p2p()`); with a swarm
    `key`, only those of askers that prove it."""

    def __init__(
        self,
        p2p: P2P,
        key: access.SwarmKey | None = None,
        dial: Callable[[str, int, str, str], Awaitable[tuple[bool, str]]] = dial_back,
    ):
        self.p2p, self.key, self.dial = p2p, key, dial
        self._last: dict[PeerID, float] = {}
        self._slots = asyncio.Semaphore(MAX_CONCURRENT)

    async def start(self) -> None:
        await self.p2p.add_protobuf_handler(HANDLER, self.handle, pb.ReachRequest)

    async def handle(self, request: pb.ReachRequest, context: P2PContext) -> pb.ReachReply:
        asker = context.remote_id
        if self.key is not None and not self.key.verify(request.proof, PROOF_PURPOSE, asker.to_bytes()):
            return pb.ReachReply(detail="refused: this swarm is private and the request did not prove its key")
        now = time.monotonic()
        if now - self._last.get(asker, -MIN_INTERVAL_S) < MIN_INTERVAL_S or self._slots.locked():
            return pb.ReachReply(detail=f"busy: ask again in {MIN_INTERVAL_S:.0f}s")
        if len(self._last) >= 4096:
            self._last = {p: t for p, t in self._last.items() if now - t < MIN_INTERVAL_S}
        self._last[asker] = now
        if (
            not 0 < request.port < 65536
            or not (is_unspecified(request.host) or valid_host(request.host))
            or (request.tls_cert and not valid_cert(request.tls_cert))
        ):
            return pb.ReachReply(detail="malformed request")
        observed = await self._observed_host(asker)
        host = observed if is_unspecified(request.host) else request.host
        if host is None:
            return pb.ReachReply(detail="no direct connection to the asker (relayed?)")
        if is_local(host) and not (observed is not None and is_local(observed)):
            return pb.ReachReply(detail="a remote asker's address cannot be on this machine")
        async with self._slots:
            reachable, detail = await self.dial(host, request.port, asker.to_base58(), request.tls_cert)
        dialled = join_host_port(host, request.port)
        logger.debug("reach check for %s: %s %s", asker, dialled, "reachable" if reachable else detail)
        return pb.ReachReply(reachable=reachable, dialled=dialled, detail=detail)

    async def _observed_host(self, peer: PeerID) -> str | None:
        for info in await self.p2p.list_peers():
            if info.peer_id == peer:
                for maddr in info.addrs:
                    if (host := host_of(maddr)) is not None:
                        return host
        return None


def valid_host(host: str) -> bool:
    """An IP address or a DNS name: never a gRPC target scheme ("unix:...", "ipv4:...") or anything else."""
    if ip_version(host) is not None:
        return True
    labels = host.removesuffix(".").split(".")
    return 0 < len(host) <= MAX_HOST_CHARS and all(_LABEL.fullmatch(label) for label in labels)


def printable(text: str) -> str:
    """A helper's words, for our log: no control characters or terminal escapes."""
    return "".join(c if c.isprintable() else "\ufffd" for c in text)


def is_local(host: str) -> bool:
    """This machine's own addresses: loopback (and link-local, which only neighbours could mean)."""
    if host.lower().rstrip(".") == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return ip.is_loopback or ip.is_link_local


@dataclass(frozen=True)
class Reachability:
    """What the nodes asked said. `dialled`: the host:port each reachable answer dialled (when we asked for our
    unspecified host, where they see us)."""

    asked: int
    reachable: list[str]
    unreachable: list[tuple[str, str]]  # (host:port dialled, why it failed)
    declined: list[str] = field(default_factory=list)  # why the others could not check (busy, no answer, ...)

    @property
    def ok(self) -> bool:
        return bool(self.reachable)

    @property
    def worth_asking_again(self) -> bool:
        """No helper could check, and at least one for a reason that passes: it was busy, slow, or had no direct
        connection to us yet (not: a helper without the handler, or one that refused us)."""
        return not self.answered and any(reason in d for d in self.declined for reason in TRANSIENT)

    @property
    def answered(self) -> bool:
        return bool(self.reachable or self.unreachable)


async def check_reachability(
    p2p: P2P, helpers: Sequence[PeerID], host: str, port: int, tls_cert: str = ""
) -> Reachability:
    """Ask each of `helpers` (not us) to dial our Stage service at host:port (`host` unspecified: at the address it
    sees us at). Never raises: a helper that does not answer, or could not check (busy, no direct connection to us),
    counts in neither list. In a private swarm the request proves this process's swarm key (access.KEY)."""
    request = pb.ReachRequest(host="" if is_unspecified(host) else host, port=port, tls_cert=tls_cert)
    if access.KEY is not None:
        request.proof = access.KEY.peer_proof(PROOF_PURPOSE, p2p.peer_id.to_bytes())

    async def ask(peer: PeerID) -> pb.ReachReply:
        try:
            reply = await asyncio.wait_for(
                p2p.call_protobuf_handler(peer, HANDLER, request, pb.ReachReply), ASK_TIMEOUT_S
            )
        except Exception as e:  # libp2p's errors, a helper without the handler, a timeout
            logger.debug("reach check: %s did not answer: %r", peer, e)
            why = (
                "did not answer in time" if isinstance(e, TimeoutError) else f"could not be asked ({type(e).__name__})"
            )
            return pb.ReachReply(detail=f"{peer.to_base58()[-6:]} {why}")
        if len(reply.dialled) > MAX_HOST_CHARS + 8 or len(reply.detail) > 200:
            return pb.ReachReply(detail=f"{peer.to_base58()[-6:]} answered out of bounds")
        return reply

    replies = await asyncio.gather(*(ask(p) for p in helpers))
    return Reachability(
        asked=len(helpers),
        reachable=[r.dialled for r in replies if r.reachable],
        unreachable=[(printable(r.dialled), printable(r.detail)) for r in replies if r.dialled and not r.reachable],
        declined=[printable(r.detail) for r in replies if not r.dialled and not r.reachable],
    )
