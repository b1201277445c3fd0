"""The one place that opens gRPC channels and servers and names the stage service's methods.

Transport concerns that apply to every call (message sizes today; TLS, authentication and metrics interceptors later)
are added here once, not in each caller. Frames travel as raw bytes in both directions (swarm.protocol.frames encodes
and parses them); the unary methods use the protobuf messages of wire.proto.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from swarm.net import join_host_port
from swarm.protocol import access
from swarm.protocol import wire_pb2 as pb
from swarm.protocol.p2p import ADDRESS_PREFIX as P2P_ADDRESS
from swarm.protocol.p2p import P2PStub
from swarm.protocol.tls import PINS, ServerTls, pinned_channel_args

logger = logging.getLogger(__name__)
# peers of different versions refuse each other's calls and never meet in a round (docs/protocol.md lists what each
# version changed); 13: a stage of more than 3 peers passes its per-backward counts through two hubs an epoch
PROTOCOL_VERSION = 13
CHUNK_BYTES = 2 << 20
DROP_GRACE_S = 120.0  # a dropped channel's calls in flight end on their own deadlines, within this at most
GRPC_OPTIONS = [  # frames are at most CHUNK_BYTES plus a header; leave headroom
    ("grpc.max_send_message_length", 2 * CHUNK_BYTES),
    ("grpc.max_receive_message_length", 2 * CHUNK_BYTES),
]
# A frozen peer (SIGSTOP, a hung host) keeps its TCP connections open and answers nothing: calls to it would wait out
# their whole deadline, which must be long enough for a healthy peer busy in an all-reduce. gRPC's core answers HTTP/2
# pings on its own threads, whatever the peer's Python is doing, so a ping unanswered for KEEPALIVE_TIMEOUT_MS means
# the process (or its host or link) is gone: the connection closes and every call on it fails UNAVAILABLE at once.
KEEPALIVE_TIME_MS, KEEPALIVE_TIMEOUT_MS = 2_000, 6_000
CHANNEL_OPTIONS = [
    *GRPC_OPTIONS,
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),  # while calls are open; an idle channel sends nothing
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    # what bounds the wait for a ping's answer in gRPC's core since it reworked pings (1.85 here: keepalive_timeout_ms
    # alone left it at the default 60 s, and a call to a frozen peer waited out its whole deadline)
    ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.http2.max_pings_without_data", 0),  # keep pinging through a long wait for a reply
    # a restarted server is dialled again within a second or two, not after grpc's backoff of up to 2 minutes
    ("grpc.initial_reconnect_backoff_ms", 500),
    ("grpc.min_reconnect_backoff_ms", 500),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]
MAX_STREAMS = 64  # calls open at once on one connection to a server (SERVER_OPTIONS)
SERVER_OPTIONS = [
    *GRPC_OPTIONS,
    # accept those pings: by default a server answers a client that pings more than once per 5 minutes without data
    # with GOAWAY ("too_many_pings") after two strikes
    ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
    ("grpc.http2.max_ping_strikes", 0),
    # calls open at once on one connection: more wait in the caller's gRPC until one ends. Each open call holds what
    # gRPC buffered of it until it ends, and one refused while its caller still sends must be read on for the refusal
    # to reach the caller (swarm.protocol.drain): a connection's refusals never outnumber what the drains take
    ("grpc.max_concurrent_streams", MAX_STREAMS),
    # a second server given a port in use fails to bind it instead of sharing it (gRPC sets SO_REUSEPORT by default:
    # two servers on one port each got half the calls, of another stage's trainers too)
    ("grpc.so_reuseport", 0),
]
SERVICE = pb.DESCRIPTOR.services_by_name["Stage"].full_name  # "swarm.v1.Stage"


def aio_channel(address: str, cert_pem: str | None = None) -> grpc.aio.Channel:
    """Over TLS trusting `cert_pem` alone if given, else the certificate the DHT record of `address` pinned (plaintext
    if it pinned none: swarm/protocol/tls.py)."""
    cert = PINS.get(address, "") if cert_pem is None else cert_pem
    if not cert:
        return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
    credentials, options = pinned_channel_args(cert)
    return grpc.aio.secure_channel(address, credentials, options=CHANNEL_OPTIONS + options)


def sync_channel(address: str) -> grpc.Channel:
    """For tools and benchmarks that poll from a thread; trusts what `aio_channel` trusts."""
    if not (cert := PINS.get(address, "")):
        return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    credentials, options = pinned_channel_args(cert)
    return grpc.secure_channel(address, credentials, options=CHANNEL_OPTIONS + options)


class Channels:
    """One channel per address, opened again when the address's pinned certificate changed (a restarted server with a
    new self-signed certificate). An address "p2p:<libp2p id>" is a server reached over libp2p (swarm/protocol/p2p.py)
    through `p2p()`, this process's handle on its DHT node's daemon (`SwarmDHT.p2p`)."""

    def __init__(self, p2p: Callable[[], Awaitable] | None = None) -> None:
        self._open: dict[str, tuple[str, grpc.aio.Channel, StageStub]] = {}
        self._draining: dict[asyncio.Task, grpc.aio.Channel] = {}  # dropped channels, each closed by its task
        self._p2p = p2p
        self._p2p_stubs: dict[str, P2PStub] = {}

    def stub(self, address: str) -> StageStub | P2PStub:
        if address.startswith(P2P_ADDRESS):
            if self._p2p is None:
                raise ValueError(f"{address} is reached over libp2p, and this caller has no libp2p handle")
            if address not in self._p2p_stubs:
                if len(self._p2p_stubs) >= 4096:
                    self._p2p_stubs.clear()
                self._p2p_stubs[address] = P2PStub(self._p2p, address.removeprefix(P2P_ADDRESS))
            return self._p2p_stubs[address]
        cert = PINS.get(address, "")
        held = self._open.get(address)
        if held is None or held[0] != cert:
            if held is not None:  # the replacement trusts the new certificate
                self._retire(held[1])
            channel = aio_channel(address, cert)
            held = self._open[address] = (cert, channel, StageStub(channel))
        return held[2]

    def addresses(self) -> set[str]:
        return set(self._open) | set(self._p2p_stubs)

    def drop(self, address: str) -> None:
        """Forget `address`'s channel: the next call opens a new one. Calls still in flight on it end on their own
        deadlines. Closing it at once would cancel them, and a cancelled grpc.aio call raises CancelledError in its
        caller as if the caller itself were cancelled: a server's Backward waiting for its Progress to a frozen peer
        died that way when another Progress to that peer dropped it, and the trainer heard nothing until its own
        deadline (10 s of a soak's stall)."""
        self._p2p_stubs.pop(address, None)
        held = self._open.pop(address, None)
        if held is not None:
            self._retire(held[1])

    def _retire(self, channel: grpc.aio.Channel) -> None:
        """Close `channel` DROP_GRACE_S from now, or at `close`. (Not grpc's `close(grace)`: a second `close` while
        that waits does nothing, so `close` could not end the calls at once.)"""

        async def later() -> None:
            await asyncio.sleep(DROP_GRACE_S)
            await channel.close()

        task = asyncio.get_running_loop().create_task(later())
        self._draining[task] = channel  # referenced until done (the loop keeps only weak references)
        task.add_done_callback(lambda done: self._draining.pop(done, None))

    async def close(self) -> None:
        """Every channel, and the calls still in flight on them, at once."""
        self._p2p_stubs.clear()
        channels = [channel for _, channel, _ in self._open.values()] + list(self._draining.values())
        self._open.clear()
        for task in list(self._draining):
            task.cancel()
        for channel in channels:
            await channel.close()


class StageStub:
    """The stage service's methods on one channel (sync or asyncio: both have the same multi-callable factories).
    Forward and Backward take and yield serialized frames (bytes); Info and Progress take and return messages.
    In a private swarm every call carries a proof of the swarm key (`key`; default: this process's, access.KEY)."""

    def __init__(self, channel: grpc.Channel | grpc.aio.Channel, key: access.SwarmKey | None = None):
        key = access.KEY if key is None else key

        def method(name: str, factory, **serializers):
            path = f"/{SERVICE}/{name}"
            call = factory(path, **serializers)
            return call if key is None else access.ProvingCall(call, path, key)

        self.forward = method("Forward", channel.stream_stream)
        self.backward = method("Backward", channel.stream_stream)
        self.info = method(
            "Info",
            channel.unary_unary,
            request_serializer=pb.InfoRequest.SerializeToString,
            response_deserializer=pb.InfoReply.FromString,
        )
        self.progress = method(
            "Progress",
            channel.unary_unary,
            request_serializer=pb.StageProgress.SerializeToString,
            response_deserializer=pb.ProgressAck.FromString,
        )

    def method(self, name: str):
        """ "Forward" or "Backward"."""
        return {"Forward": self.forward, "Backward": self.backward}[name]


def _unary(handler, request_type, reply_type) -> grpc.RpcMethodHandler:
    """A unary method that answers INVALID_ARGUMENT to a request that does not parse, and INTERNAL (logged, with a
    short message) to any exception its handler lets escape: never UNKNOWN, never a traceback to the caller."""

    async def handle(raw: bytes, context: grpc.aio.ServicerContext):
        try:
            request = request_type.FromString(raw)
        except DecodeError:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed {request_type.__name__}")
        try:
            return await handler(request, context)
        except grpc.aio.AbortError:
            raise
        except Exception:
            logger.exception("%s failed", request_type.__name__)
            await context.abort(grpc.StatusCode.INTERNAL, f"{request_type.__name__}: internal error (see server log)")

    return grpc.unary_unary_rpc_method_handler(handle, response_serializer=reply_type.SerializeToString)


def stage_handler(forward, backward, info, progress) -> grpc.GenericRpcHandler:
    """The server side of `StageStub`: coroutine handlers for the four methods."""
    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Forward": grpc.stream_stream_rpc_method_handler(forward),
            "Backward": grpc.stream_stream_rpc_method_handler(backward),
            "Progress": _unary(progress, pb.StageProgress, pb.ProgressAck),
            "Info": _unary(info, pb.InfoRequest, pb.InfoReply),
        },
    )


def aio_server(key: access.SwarmKey | None = None) -> grpc.aio.Server:
    """A server that, given a swarm `key`, refuses calls without a proof of it (swarm/protocol/access.py)."""
    interceptors = [access.RequireSwarmKey(key)] if key is not None else []
    return grpc.aio.server(options=SERVER_OPTIONS, interceptors=interceptors)


def bind(server: grpc.aio.Server, host: str, port: int, tls: ServerTls | None = None) -> int:
    """Listen on host:port (0: any free port), over TLS if `tls`; returns the bound port."""
    if tls is not None:
        return server.add_secure_port(join_host_port(host, port), tls.credentials())
    return server.add_insecure_port(join_host_port(host, port))


async def start_stage_server(
    handler: grpc.GenericRpcHandler,
    host: str,
    port: int,
    tls: ServerTls | None = None,
    key: access.SwarmKey | None = None,
) -> tuple[grpc.aio.Server, health.aio.HealthServicer, int]:
    """Start the stage service and the standard grpc.health.v1 service; returns them and the bound port. With a swarm
    `key`, only calls that prove it reach the stage service."""
    server = aio_server(key)
    server.add_generic_rpc_handlers([handler])
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bound = bind(server, host, port, tls)
    await server.start()
    for name in ("", SERVICE):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, health_servicer, bound
