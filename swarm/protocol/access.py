"""Private swarms: only peers given the swarm's key (`--swarm-key FILE`) take part.

The key is a shared secret (32 random bytes, hex in a file: `swarm-dht --new-swarm-key FILE` writes one). Every peer
of a private swarm proves it holds the key, wherever it speaks:
- **DHT** (dht/authorizer.py): every DHT request and reply carries an access token (hivemind's `TokenAuthorizerBase`
  protocol): the node's public key and an expiry, MACed with the swarm key, and the message signed with that node's
  own key. A node
  without the key cannot read, store or route anything, so it is never listed: trainers never dial it, stage peers
  never count its Progress, and all-reduce groups and state donors (taken from the listed peers) never include it.
- **gRPC**: every call to a Stage service carries, in its metadata, a MAC of the method, the time and a nonce; a
  server checks it before the handler runs (no payload is parsed for a call without it), and refuses a stale one or
  a replayed one with PERMISSION_DENIED. The health service stays open.
- **libp2p**: a reachability request carries a MAC bound to the asker's libp2p id; averagers serve their state and
  groups only to the stage's listed peers (server/collab/compat/averager.py).

The key never appears in logs, reprs or error messages: `SwarmKey.swarm_id`, a hash of it, names the swarm instead.
Anyone who holds the key can act as any member (the MACs are symmetric): it admits peers, it does not tell them
apart (each peer's own RSA key does that: dht/identity.py). On links others can watch, add TLS (swarm/protocol/tls.py):
gRPC calls are not encrypted otherwise.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import time
from collections.abc import Sequence
from pathlib import Path

import grpc

from swarm.protocol.drain import Drains

logger = logging.getLogger(__name__)
KEY_BYTES = 32
METADATA_KEY = "swarm-auth"
CALL_WINDOW_S = 60.0  # a call's proof is accepted this long either side of the server's clock (hivemind's DHT: 60 s)
MAX_TOKEN_CHARS = 128
MAX_NONCES = 500_000  # proofs remembered to refuse replays (~100 bytes each); beyond, calls are refused as busy
OPEN_METHODS = ("/grpc.health.v1.Health/",)  # say only whether the server is up
REFUSAL_LOG_INTERVAL_S = 10.0
# A stream refused while its caller is still sending is read on (and dropped, unparsed) this long or this far, at most
# DRAINING such streams at a time (swarm.protocol.drain.Drains)
DRAIN_S, DRAIN_BYTES, DRAINING = 2.0, 16 << 20, 4


class SwarmKey:
    """The shared secret of a private swarm."""

    def __init__(self, secret: bytes):
        if len(secret) < KEY_BYTES:
            raise ValueError(f"a swarm key has at least {KEY_BYTES} bytes, got {len(secret)}")
        self._secret = bytes(secret)
        self._nonces: dict[str, float] = {}  # call proofs seen within the window -> when they stop mattering

    @classmethod
    def new(cls) -> SwarmKey:
        return cls(secrets.token_bytes(KEY_BYTES))

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> SwarmKey:
        """A key file holds the key in hex (whitespace ignored). Errors never quote the file's content."""
        try:
            text = Path(path).read_text().strip()
        except OSError as e:
            raise ValueError(f"cannot read the swarm key file {path}: {e.strerror}") from None
        try:
            return cls(bytes.fromhex(text))
        except ValueError:
            raise ValueError(f"{path} is not a swarm key: expected at least {2 * KEY_BYTES} hex digits") from None

    def write(self, path: str | os.PathLike) -> None:
        """Only the owner may read it (0600); refuses to overwrite a file."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self._secret.hex() + "\n")

    @property
    def swarm_id(self) -> str:
        """A name of the swarm that is safe to print: two peers with the same id have the same key."""
        return "s" + hashlib.sha256(b"swarm-id\0" + self._secret).hexdigest()[:12]

    def __repr__(self) -> str:
        return f"SwarmKey({self.swarm_id})"

    def mac(self, purpose: bytes, *parts: bytes) -> bytes:
        """HMAC-SHA256 of `parts` (length-prefixed: no two part lists collide) for one purpose."""
        message = b"".join(len(p).to_bytes(4, "big") + p for p in (purpose, *parts))
        return hmac.new(self._secret, message, hashlib.sha256).digest()

    def verify(self, tag: bytes, purpose: bytes, *parts: bytes) -> bool:
        return hmac.compare_digest(tag, self.mac(purpose, *parts))

    # --- gRPC calls ------------------------------------------------------------------------------------------------

    def call_token(self, method: str) -> str:
        """Proof for one call of `method` ("/swarm.v1.Stage/Forward"): "<ms>-<nonce>-<mac>"."""
        stamp, nonce = str(int(time.time() * 1000)), secrets.token_hex(8)
        return f"{stamp}-{nonce}-{self.mac(b'grpc', method.encode(), stamp.encode(), nonce.encode()).hex()}"

    def check_call(self, method: str, token: str | None) -> str | None:
        """Why a call's proof is refused, or None (it is remembered: the same proof is refused next time)."""
        if not token:
            return "the call carries no proof of the swarm key (start this peer with the swarm's --swarm-key)"
        parts = token.split("-")
        if len(token) > MAX_TOKEN_CHARS or len(parts) != 3 or not parts[0].isdigit():
            return "malformed swarm key proof"
        stamp, nonce, tag = parts
        try:
            tag_bytes = bytes.fromhex(tag)
        except ValueError:
            return "malformed swarm key proof"
        if not self.verify(tag_bytes, b"grpc", method.encode(), stamp.encode(), nonce.encode()):
            return "wrong swarm key (this peer was started with another --swarm-key)"
        now = time.time()
        skew = now - int(stamp) / 1000
        if abs(skew) > CALL_WINDOW_S:
            return f"the proof is {skew:+.0f}s old (a replay, or clocks more than {CALL_WINDOW_S:.0f}s apart)"
        self._forget_until(now)
        if tag in self._nonces:
            return "the proof was used before (a replayed call)"
        if len(self._nonces) >= MAX_NONCES:
            return "too many calls to remember: try again"
        self._nonces[tag] = now + 2 * CALL_WINDOW_S
        return None

    def _forget_until(self, now: float) -> None:
        while self._nonces:
            oldest = next(iter(self._nonces))  # insertion order is expiry order
            if self._nonces[oldest] > now:
                return
            del self._nonces[oldest]

    # --- libp2p requests -------------------------------------------------------------------------------------------

    def peer_proof(self, purpose: bytes, p2p_id: bytes) -> bytes:
        """Proof that the libp2p peer `p2p_id` holds the key: bound to that id, so another peer cannot reuse it."""
        return self.mac(purpose, p2p_id)


KEY: SwarmKey | None = None  # this process's swarm key: the calls it makes carry proofs of it (None: an open swarm)


def use(key: SwarmKey | None) -> None:
    """Set once at start by each command: every StageStub this process makes from then on proves `key`."""
    global KEY
    KEY = key
    if key is not None:
        logger.info("private swarm %s: only peers with its key take part", key.swarm_id)


def load(path: str | None) -> SwarmKey | None:
    """`--swarm-key`'s value: None (an open swarm) or the key in that file, made this process's key."""
    key = None if path is None else SwarmKey.from_file(path)
    use(key)
    return key


class ProvingCall:
    """A multi-callable whose calls carry a proof of `key` in their metadata."""

    def __init__(self, call, method: str, key: SwarmKey):
        self._call, self._method, self._key = call, method, key

    def __call__(self, *args, metadata: Sequence[tuple[str, str]] = (), **kwargs):
        proof = (METADATA_KEY, self._key.call_token(self._method))
        return self._call(*args, metadata=(*metadata, proof), **kwargs)


class Refusals:
    """Counts refused calls and logs at most one every REFUSAL_LOG_INTERVAL_S: a flood of uninvited calls must not
    flood the log."""

    def __init__(self) -> None:
        self.count = 0
        self._logged_at = -REFUSAL_LOG_INTERVAL_S

    def add(self, log: logging.Logger, message: str, *args: object) -> None:
        """One more refusal; `message` % `args` (with the count so far appended) if it is time to log one."""
        self.count += 1
        now = time.monotonic()
        if now - self._logged_at >= REFUSAL_LOG_INTERVAL_S:
            self._logged_at = now
            log.warning(f"{message} (%d refused so far)", *args, self.count)


class RequireSwarmKey(grpc.aio.ServerInterceptor):
    """A gRPC server's gate: calls without a valid, fresh, unused proof of `key` are refused (PERMISSION_DENIED)
    before their handler runs; their payload is never read."""

    def __init__(self, key: SwarmKey):
        self.key = key
        self.refusals = Refusals()
        self._drains = Drains(DRAINING)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(OPEN_METHODS):
            return handler
        token = next((v for k, v in handler_call_details.invocation_metadata or () if k == METADATA_KEY), None)
        reason = self.key.check_call(method, token if isinstance(token, str) else None)
        if reason is None:
            return handler
        return self._refusal(handler, method, reason)

    def _refusal(self, handler: grpc.RpcMethodHandler, method: str, reason: str) -> grpc.RpcMethodHandler:
        async def refuse(request, context: grpc.aio.ServicerContext):
            if handler.request_streaming:
                await self._drains.drain(request, DRAIN_BYTES, DRAIN_S)
            self.refusals.add(logger, "refused %s from %s: %s", method, context.peer()[:80], reason)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"private swarm {self.key.swarm_id}: {reason}")

        # bytes in and out: nothing the caller sent is parsed
        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(refuse)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(refuse)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(refuse)
        return grpc.unary_unary_rpc_method_handler(refuse)
