"""The Stage service over libp2p: for servers the swarm cannot dial (a home GPU behind NAT, no forwarded port).

Every server also serves its four Stage methods as libp2p stream handlers on its DHT node's daemon
(`swarm.v1.Stage/Forward` ...): the same frames, the same handlers (server/service.py, so the same validation, limits
and refusals), and in a private swarm the same call proofs (swarm/protocol/access.py). A server that the swarm's
peers cannot dial (its reachability check said so, or `--transport p2p`) announces `p2p:<its libp2p id>` as its
address; every caller's `rpc.Channels` then reaches it through its own DHT node's daemon, which dials it directly,
or through a relay. Direct gRPC stays the fast path.

Relays: a server behind NAT holds a reservation on the swarm's public DHT nodes (its bootstrap peers; `swarm-dht
--public` relays). A caller's daemon finds a peer's addresses by libp2p routing, which does not find relayed ones from
a client-mode DHT node (a trainer's): when routing fails, the caller dials the server through each of its own
bootstrap peers (`RELAYS`, set by `SwarmDHT.start`) as a relay, then calls again. The daemon punches a hole through
the server's NAT (DCUtR) as the relayed connection opens, once the server knows its public address (peers at 4
addresses saw it there); otherwise the connection stays relayed, capped in time and bytes by the relay (30 min and
4 GiB a direction on a relay that dht/relay.py checked; libp2p's defaults, 2 min and 128 KiB, elsewhere). A caller
still relayed REDIAL_S after it dialled closes the connection when no call uses it, and its next call dials again
(another punch), up to MAX_REDIALS times (`_watch_path`).

One libp2p stream per call: the caller sends a first `P2PCall` with its deadline and proof, then one per request
frame; the server answers one per reply frame, and a failed call ends with one carrying a gRPC status code and its
details, which the caller raises as `grpc.aio.AioRpcError`: routing, bans and retries treat both transports alike.
Every reply ends with an `end` message, and the server keeps the stream open until the caller, having read it,
closes it: a handler that closed the stream as soon as it had written its reply lost, under uvloop, what was still in
the socket's buffer (measured with hivemind's handlers: 1 in 4 benchmark runs got a reply without its last frame, or
none). A reply without its `end` is UNAVAILABLE, like a connection gRPC lost. Both ends speak hivemind's stream
framing (`P2P.iterate_protobuf_handler` can call these handlers) but read it with a cap on each message's size.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable

import grpc
from google.protobuf.message import DecodeError, Message

from swarm.protocol import access
from swarm.protocol import wire_pb2 as pb

logger = logging.getLogger(__name__)
SERVICE = pb.DESCRIPTOR.services_by_name["Stage"].full_name  # "swarm.v1.Stage", as over gRPC
ADDRESS_PREFIX = "p2p:"  # a record's address for a server reached over libp2p: "p2p:<libp2p peer id>"
MAX_TIMEOUT_S = 600.0  # the longest deadline a caller may ask for
FIRST_MESSAGE_S = 30.0  # a stream that sends nothing for this long is dropped
MAX_DETAILS_CHARS = 500
MESSAGE, END = b"\x00", b"\x01"  # hivemind's stream framing: a message, or an error (which ends a request stream)
MAX_MESSAGE_BYTES = 5 << 20  # a frame (2 MiB of payload plus its header) or a unary request, with room
PREFETCH = 4  # request messages read ahead of the handler
LINGER_S = 10.0  # how long a server holds a stream whose reply it sent, for the caller to read it and close
_CODES = {code.value[0]: code for code in grpc.StatusCode}
P2P_CODE, CIRCUIT_CODE = 421, 290  # multiaddr protocol codes of /p2p/<id> and /p2p-circuit
# multiaddrs of the swarm's bootstrap nodes, "/ip4/.../tcp/.../p2p/<id>": the relays a server behind NAT is reached
# through (set by SwarmDHT.start from --initial-peers)
RELAYS: list[str] = []
REFUSALS = access.Refusals()  # calls refused for want of the private swarm's key
HOLE_PUNCH_S = 5.0  # when a relayed path is looked at again: a punched hole replaces it right after it opens
PATH_CHECK_S = 60.0  # how often a caller looks again at how it reaches a peer (directly or relayed), and logs changes
REDIAL_S = 30.0  # a peer we still reach through a relay this long after dialling it is dialled afresh (`_watch_path`)
# whether we do (SwarmDHT.start: trainers'): a server's daemon also carries its stage peers' Progress and all-reduce
# streams, which closing the connection would cut, and our count of calls does not see
REDIAL_RELAYED = False
MAX_REDIALS = 4  # ... this many times a peer at most: some NATs let no hole through, and the relay is the way
IDLE_WAIT_S = 10.0  # how long a redial waits for the calls under way to the peer to end (it closes their connection)
_paths: dict[str, tuple[float, str]] = {}  # peer -> (when we last looked, how we reached it)
_checks: dict[str, asyncio.Task] = {}  # running path checks, by peer (asyncio keeps only weak references to tasks)
_calls: dict[str, int] = {}  # peer -> our calls to it under way
_redials: dict[str, int] = {}  # peer -> how many times we dialled it afresh (`_watch_path`)
_redialling: dict[str, asyncio.Event] = {}  # peer -> set once its connection is closed: new calls wait for it


class _Maddr:
    """A binary multiaddr for hivemind's daemon client, which takes anything with `to_bytes`."""

    def __init__(self, raw: bytes):
        self.raw = raw

    def to_bytes(self) -> bytes:
        return self.raw


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def circuit_through(relay: str) -> _Maddr:
    """The address of "any peer, through `relay`": `relay` (a multiaddr ending in /p2p/<its id>) + /p2p-circuit. Built
    by hand: hivemind's multiaddr encodes a /p2p/ id as a CID, which the daemon cannot parse in a binary address."""
    from hivemind.p2p import PeerID
    from hivemind.utils.multiaddr import Multiaddr

    base, sep, relay_id = relay.rpartition("/p2p/")
    if not sep or not base:
        raise ValueError(f"a relay's multiaddr must end in /p2p/<its libp2p id>: {relay!r}")
    multihash = PeerID.from_base58(relay_id).to_bytes()
    return _Maddr(
        Multiaddr(base).to_bytes() + _varint(P2P_CODE) + _varint(len(multihash)) + multihash + _varint(CIRCUIT_CODE)
    )


async def _dial_through_relays(p2p, peer) -> str | None:
    """Connect our daemon to `peer` through the first of RELAYS that has it; returns that relay, or None."""
    for relay in RELAYS:
        try:
            await asyncio.wait_for(p2p._client.connect(peer, [circuit_through(relay)]), 10)
        except Exception as e:  # no reservation of the peer there, a relay down, a malformed address
            logger.debug("dialling %s through relay %s failed: %r", peer, relay, e)
            continue
        return relay
    return None


async def _open(p2p, peer, name: str):
    """A stream to `peer`'s handler `name`: directly, or (when routing finds no address) through a relay."""
    if (closing := _redialling.get(str(peer))) is not None:
        await closing.wait()  # not on the connection `_watch_path` is closing
    try:
        stream = await p2p.call_binary_stream_handler(peer, name)
    except Exception as e:
        if "routing: not found" not in str(e) or (relay := await _dial_through_relays(p2p, peer)) is None:
            raise
        logger.info("dialled %s through relay %s", peer, relay)
        stream = await p2p.call_binary_stream_handler(peer, name)
    looked, path = _paths.get(str(peer), (-math.inf, ""))
    if time.monotonic() - looked > PATH_CHECK_S and str(peer) not in _checks:
        if len(_paths) >= 4096:  # peers of a long run: forget them all (each path is logged again once)
            _paths.clear()
            _redials.clear()
        _paths[str(peer)] = (time.monotonic(), path)
        _checks[str(peer)] = task = asyncio.create_task(_watch_path(p2p, peer))
        task.add_done_callback(lambda _: _checks.pop(str(peer), None))
    return stream


def path_of(addresses: Iterable[object]) -> str:
    """How our daemon's connections to a peer (their remote multiaddrs) reach it, in words."""
    relayed = [str(a).partition("/p2p-circuit")[0] for a in addresses if "/p2p-circuit" in str(a)]
    direct = [str(a) for a in addresses if "/p2p-circuit" not in str(a)]
    if direct:
        return f"directly at {', '.join(sorted(direct))}"
    return f"through relay {', '.join(sorted(relayed))}" if relayed else "not connected"


async def _look(p2p, peer) -> str | None:
    """How our daemon reaches `peer` now (logged when that changed since we last looked); None if it cannot say."""
    try:
        conns = [info.addrs for info in await p2p.list_peers() if str(info.peer_id) == str(peer)]
    except Exception:  # a daemon that went away: the calls themselves say so
        return None
    path = path_of([a for addrs in conns for a in addrs])
    if path != _paths.get(str(peer), (0.0, ""))[1] and path != "not connected":
        logger.info("reaching %s over libp2p %s", peer, path)
    _paths[str(peer)] = (time.monotonic(), path)
    return path


async def _watch_path(p2p, peer) -> None:
    """Logs how we reach `peer` (the first time, and when it changes) while it is through a relay. A relayed path is
    looked at again HOLE_PUNCH_S later: libp2p's hole punching (DCUtR) replaces a relayed connection with a direct
    one right after it opens, when the peer behind NAT knows its public address. It tries once per connection: a
    peer that did not know its address yet (the peers that tell it were still meeting it) stays relayed for good,
    through a relay capped in time and bytes (CI saw a caller relayed for all of 150 s). So a path still relayed
    REDIAL_S later is closed once no call of ours is using it, and the next call dials the peer afresh, through the
    relay and then, if the hole opens, directly; MAX_REDIALS times a peer at most (a NAT no hole goes through)."""
    path, dialled = await _look(p2p, peer), time.monotonic()
    while path is not None and path.startswith(("through relay", "not connected")):
        await asyncio.sleep(HOLE_PUNCH_S)
        was, path = path, await _look(p2p, peer)
        if path == "not connected" and time.monotonic() - dialled < PATH_CHECK_S:
            continue  # closed by us (or by the relay's limits): the next call dials it
        if path is None or not path.startswith("through relay"):
            return
        if was == "not connected":
            dialled = time.monotonic()  # dialled again since we looked: its punch gets its own REDIAL_S
        if not REDIAL_RELAYED or _redials.get(str(peer), 0) >= MAX_REDIALS:
            return
        if time.monotonic() - dialled < REDIAL_S:
            continue
        idle_by = time.monotonic() + IDLE_WAIT_S
        while _calls.get(str(peer), 0) and time.monotonic() < idle_by:
            await asyncio.sleep(0.2)
        if _calls.get(str(peer), 0):
            continue  # busy all along: a call under way would break with the connection; look again later
        _redials[str(peer)] = redials = _redials.get(str(peer), 0) + 1
        dialled = time.monotonic()
        logger.info("still reaching %s through a relay: dialling it afresh for a direct path (%d of %d)",
                    peer, redials, MAX_REDIALS)  # fmt: skip
        _redialling[str(peer)] = closed = asyncio.Event()
        try:
            with contextlib.suppress(Exception):
                await p2p._client.disconnect(peer)
        finally:
            closed.set()
            del _redialling[str(peer)]


def handler_name(method: str) -> str:
    return f"{SERVICE}/{method}"


class StreamContext:
    """What server/service.py's handlers use of a `grpc.aio.ServicerContext`, for a call that came over libp2p."""

    def __init__(self, remote_id: object, timeout: float):
        self._peer = f"{ADDRESS_PREFIX}{remote_id}"
        self._deadline = time.monotonic() + timeout if timeout > 0 else None
        self.code: grpc.StatusCode | None = None
        self.details = ""

    def peer(self) -> str:
        return self._peer

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        self.code, self.details = code, details
        raise grpc.aio.AbortError(details)


def _status(code: grpc.StatusCode, details: str) -> pb.P2PCall:
    return pb.P2PCall(status=code.value[0], details=details[:MAX_DETAILS_CHARS])


async def serve(
    p2p,
    forward: Callable,
    backward: Callable,
    info: Callable[[pb.InfoRequest, StreamContext], Awaitable[pb.InfoReply]],
    progress: Callable[[pb.StageProgress, StreamContext], Awaitable[pb.ProgressAck]],
    key: access.SwarmKey | None = None,
) -> None:
    """Serve the Stage methods on `p2p` (a hivemind P2P handle) with the gRPC service's handlers. With a swarm `key`,
    only calls that prove it reach them."""
    for method, handler in (("Forward", forward), ("Backward", backward)):
        await p2p.add_binary_stream_handler(handler_name(method), _framed(method, handler, key))
    for method, handler, request_type in (("Info", info, pb.InfoRequest), ("Progress", progress, pb.StageProgress)):
        await p2p.add_binary_stream_handler(handler_name(method), _framed(method, _unary(handler, request_type), key))


async def _receive(reader: asyncio.StreamReader) -> pb.P2PCall | None:
    """One message of hivemind's stream framing (a marker byte, an 8-byte big-endian length, the bytes); None at the
    end of the stream. hivemind's own reader allocates whatever length a message declares: this one refuses a
    message over MAX_MESSAGE_BYTES before reading it (ValueError). Servers read requests and callers replies with
    it."""
    marker = await reader.readexactly(1)
    length = int.from_bytes(await reader.readexactly(8), "big")
    if marker not in (MESSAGE, END) or length > (MAX_MESSAGE_BYTES if marker == MESSAGE else 1024):
        raise ValueError(f"a message of {length} bytes (marker {marker!r})")
    data = await reader.readexactly(length)
    if marker == END:  # hivemind ends a request stream with an (empty) error message
        return None
    try:
        return pb.P2PCall.FromString(data)
    except DecodeError:
        raise ValueError("a message that is not a P2PCall") from None


def _framed(method: str, handler: Callable, key: access.SwarmKey | None) -> Callable:
    """A libp2p binary stream handler serving `handler` (frames in, frames out, as the gRPC service's). A caller that
    sends a malformed or oversized message, or closes the stream, ends the call."""
    handle = _streaming(method, handler, key)

    async def on_stream(stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        requests: asyncio.Queue[pb.P2PCall | None] = asyncio.Queue(PREFETCH)

        async def incoming() -> AsyncIterator[pb.P2PCall]:
            while (message := await requests.get()) is not None:
                yield message

        async def process() -> None:
            async for reply in handle(incoming(), stream_info.peer_id):
                await _send(writer, reply)

        processing = asyncio.create_task(process())
        try:
            while not processing.done():
                receiving = asyncio.ensure_future(_receive(reader))
                receiving.add_done_callback(_retrieved)  # one left behind when the handler is cancelled (shutdown)
                await asyncio.wait({processing, receiving}, return_when=asyncio.FIRST_COMPLETED)
                if not receiving.done():
                    receiving.cancel()
                    break
                putting = asyncio.ensure_future(requests.put(receiving.result()))
                await asyncio.wait({processing, putting}, return_when=asyncio.FIRST_COMPLETED)
                putting.cancel()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the caller closed the stream: it has its reply, or gave up
        except ValueError as e:
            logger.debug("a libp2p call from %s sent %s: closed", stream_info.peer_id, e)
        finally:
            processing.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await processing  # its error, if any, was answered as a status, or the caller is gone
            writer.close()

    return on_stream


def _unary(handler: Callable, request_type: type[Message]) -> Callable:
    """A unary method as a stream handler: its request is the one frame, its reply the one frame back."""

    async def handle(frames: AsyncIterator[bytes], context: StreamContext) -> AsyncIterator[bytes]:
        raw = b"".join([frame async for frame in _at_most(frames, 1 << 20)])
        try:
            request = request_type.FromString(raw)
        except DecodeError:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed {request_type.__name__}")
        reply = await handler(request, context)
        yield reply.SerializeToString()

    return handle


async def _at_most(frames: AsyncIterator[bytes], limit: int) -> AsyncIterator[bytes]:
    total = 0
    async for frame in frames:
        total += len(frame)
        if total > limit:
            raise ValueError(f"a unary request over {limit} bytes")
        yield frame


def _streaming(method: str, handler: Callable, key: access.SwarmKey | None) -> Callable:
    path = f"/{SERVICE}/{method}"

    async def handle(requests: AsyncIterator[pb.P2PCall], remote_id: object) -> AsyncIterator[pb.P2PCall]:
        async for message in reply(requests, remote_id):
            yield message
        yield pb.P2PCall(end=True)
        await asyncio.sleep(LINGER_S)  # cancelled as soon as the caller closes the stream

    async def reply(requests: AsyncIterator[pb.P2PCall], remote_id: object) -> AsyncIterator[pb.P2PCall]:
        try:
            first = await asyncio.wait_for(anext(requests), FIRST_MESSAGE_S)
        except (StopAsyncIteration, TimeoutError):
            return
        if key is not None and (reason := key.check_call(path, first.auth or None)) is not None:
            REFUSALS.add(logger, "refused %s over libp2p from %s: %s", method, remote_id, reason)
            yield _status(grpc.StatusCode.PERMISSION_DENIED, f"private swarm {key.swarm_id}: {reason}")
            return
        if not 0 <= first.timeout <= MAX_TIMEOUT_S:
            yield _status(grpc.StatusCode.INVALID_ARGUMENT, f"timeout {first.timeout} outside [0, {MAX_TIMEOUT_S}]")
            return
        context = StreamContext(remote_id, first.timeout)

        async def frames() -> AsyncIterator[bytes]:
            if first.frame:
                yield first.frame
            async for message in requests:
                yield message.frame

        try:
            async with asyncio.timeout(first.timeout or MAX_TIMEOUT_S):
                async for frame in handler(frames(), context):
                    yield pb.P2PCall(frame=frame)
        except grpc.aio.AbortError:
            yield _status(context.code or grpc.StatusCode.INTERNAL, context.details)
        except TimeoutError:
            yield _status(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")
        except ValueError as e:
            yield _status(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except Exception:
            logger.exception("%s over libp2p failed", method)
            yield _status(grpc.StatusCode.INTERNAL, f"{method}: internal error (see server log)")

    return handle


def _error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details[:MAX_DETAILS_CHARS])


class P2PStub:
    """`rpc.StageStub`'s methods, for a server reached over libp2p: `get_p2p()` gives this process's P2P handle
    (its DHT node's daemon), `peer_id` names the server. Errors are `grpc.aio.AioRpcError`s, as over gRPC."""

    def __init__(self, get_p2p: Callable[[], Awaitable], peer_id: str, key: access.SwarmKey | None = None):
        self.get_p2p, self.peer_id, self.key = get_p2p, peer_id, access.KEY if key is None else key
        self._peer: object = None  # the parsed peer id, once a call needed it
        self.forward = _StreamMethod(self, "Forward")
        self.backward = _StreamMethod(self, "Backward")
        self.info = _UnaryMethod(self, "Info", pb.InfoReply)
        self.progress = _UnaryMethod(self, "Progress", pb.ProgressAck)

    def method(self, name: str):
        return {"Forward": self.forward, "Backward": self.backward}[name]

    async def call(
        self, method: str, frames: Iterable[bytes] | AsyncIterator[bytes], timeout: float | None
    ) -> AsyncIterator[bytes]:
        """The reply frames of one call."""
        header = pb.P2PCall(timeout=min(timeout or 0.0, MAX_TIMEOUT_S))
        if self.key is not None:
            header.auth = self.key.call_token(f"/{SERVICE}/{method}")

        async def requests() -> AsyncIterator[pb.P2PCall]:
            yield header
            if isinstance(frames, AsyncIterator):
                async for frame in frames:
                    yield pb.P2PCall(frame=frame)
            else:
                for frame in frames:
                    yield pb.P2PCall(frame=frame)

        async def send(writer: asyncio.StreamWriter) -> None:
            async for message in requests():
                await _send(writer, message)
            writer.write(END + (0).to_bytes(8, "big"))  # hivemind's end of a request stream: an empty error
            await writer.drain()

        _calls[self.peer_id] = _calls.get(self.peer_id, 0) + 1  # a redial waits for it (`_watch_path`)
        try:
            try:
                if self._peer is None:
                    from hivemind.p2p import PeerID  # here: only processes calling over libp2p import hivemind for it

                    self._peer = PeerID.from_base58(self.peer_id)
                p2p = await self.get_p2p()
                _, reader, writer = await _open(p2p, self._peer, handler_name(method))
            except Exception as e:  # libp2p's: the daemon could not reach the peer; a malformed peer id
                raise _error(grpc.StatusCode.UNAVAILABLE, f"libp2p: {e!r}") from None
            sending = asyncio.ensure_future(send(writer))
            sending.add_done_callback(_retrieved)  # a send that failed shows as a reply that never ends
            try:
                while True:
                    try:  # replies are read with the same cap as requests: a server cannot make us reserve more
                        reply = await _receive(reader)
                    except (asyncio.IncompleteReadError, ConnectionError):
                        reply = None
                    except ValueError as e:
                        raise _error(grpc.StatusCode.UNAVAILABLE, f"libp2p: the server sent {e}") from None
                    if reply is None:  # the stream closed before the reply's end: as a connection gRPC lost
                        raise _error(grpc.StatusCode.UNAVAILABLE, "libp2p: the stream closed before the reply ended")
                    if reply.status:
                        raise _error(_CODES.get(reply.status, grpc.StatusCode.UNKNOWN), reply.details)
                    if reply.end:
                        return
                    yield reply.frame
            finally:
                sending.cancel()
                writer.close()  # the server stops holding the stream
        finally:
            if (calls := _calls.pop(self.peer_id, 1) - 1) > 0:
                _calls[self.peer_id] = calls


async def _send(writer: asyncio.StreamWriter, message: pb.P2PCall) -> None:
    data = message.SerializeToString()
    writer.write(MESSAGE + len(data).to_bytes(8, "big"))
    writer.write(data)
    await writer.drain()


def _retrieved(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()


class _StreamMethod:
    def __init__(self, stub: P2PStub, method: str):
        self.stub, self.method = stub, method

    def __call__(self, frames, timeout: float | None = None, metadata=None) -> AsyncIterator[bytes]:
        return self.stub.call(self.method, frames, timeout)


class _UnaryMethod:
    def __init__(self, stub: P2PStub, method: str, reply_type: type[Message]):
        self.stub, self.method, self.reply_type = stub, method, reply_type

    async def __call__(self, request: Message, timeout: float | None = None, metadata=None) -> Message:
        async def once() -> Message:
            raw = b"".join([f async for f in self.stub.call(self.method, [request.SerializeToString()], timeout)])
            try:
                return self.reply_type.FromString(raw)
            except DecodeError:
                raise _error(grpc.StatusCode.INTERNAL, f"malformed {self.reply_type.__name__} over libp2p") from None

        if timeout is None:
            return await once()
        try:
            return await asyncio.wait_for(once(), timeout)
        except TimeoutError:
            raise _error(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded") from None
