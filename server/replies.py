"""What a stage sends back: the frames of a reply, and the Backward replies kept for a caller that asks again."""

from __future__ import annotations

import asyncio
import collections

from server.collab.tickets import Ticket, TicketRefused
from swarm.protocol import wire_pb2 as pb
from swarm.protocol.frames import iter_frames
from swarm.protocol.rpc import PROTOCOL_VERSION
from swarm.protocol.tensors import EncodedTensor


def reply_frames(
    request: pb.CallMeta,
    stage: int,
    tensors: list[EncodedTensor],
    *,
    param_version: int,
    queue_length: int,
    loss: float | None = None,
    ticket: Ticket | None = None,
) -> list[bytes]:
    """The frames of the reply to `request`: its microbatch id, this stage, the parameter version and queue length it
    was computed at, the last stage's loss, then `tensors`. A microbatch stage 0 admitted (`ticket`) learns where it
    belongs: its later calls carry that admission."""
    meta = pb.CallMeta(protocol_version=PROTOCOL_VERSION, microbatch_id=request.microbatch_id, stage=stage)
    if loss is not None:
        meta.loss, meta.has_loss = loss, True
    meta.param_version, meta.queue_length = param_version, queue_length
    if ticket is not None:
        meta.global_batch, meta.admitted_at = ticket.global_batch, ticket.admitted_at
        meta.admitted_by, meta.admission_signature = ticket.signer, ticket.signature
    return list(iter_frames(meta, tensors))


class ReplyCache:
    """The last Backward replies, by the admission they used (event loop). A Backward counts once per server
    (tickets.py); a trainer whose reply was lost (its deadline passed while the server still computed) asks the same
    server again, and gets the same reply instead of a refusal, or waits for it while the first attempt computes. A
    reply is handed only to the microbatch it was computed for: each is kept with the fingerprint of its request
    (swarm.protocol.tensors `fingerprint`), and a call under the same admission with other tensors (an id collision,
    or an admission copied by someone who saw it) is refused (Duplicate). Bounded in replies and bytes; the replies
    being computed are bounded by the calls a server holds."""

    def __init__(self, max_bytes: int, max_replies: int = 256):
        self.max_bytes, self.max_replies, self.bytes = max_bytes, max_replies, 0
        self._replies: collections.OrderedDict[tuple, tuple[bytes, list[bytes]]] = collections.OrderedDict()
        self._computing: dict[tuple, tuple[bytes, asyncio.Future[list[bytes] | None]]] = {}

    async def recall(self, key: tuple, fingerprint: bytes) -> list[bytes] | None:
        """The reply of the Backward that spent `key` here: kept, or awaited while it computes. None if none is kept
        (forgotten, or computed by an earlier run of this server); raises Uncounted if that Backward failed before
        it counted (its admission is free again), Duplicate if it sent other tensors than `fingerprint` says."""
        if (computing := self._computing.get(key)) is not None:
            _same(computing[0], fingerprint)
            if (frames := await asyncio.shield(computing[1])) is None:
                raise Uncounted
            return frames
        if (kept := self._replies.get(key)) is None:
            return None
        _same(kept[0], fingerprint)
        return kept[1]

    def computing(self, key: tuple, fingerprint: bytes) -> None:
        """A Backward of these tensors spent `key` here (it may still wait for its epoch, or for the compute thread);
        `done` must follow, whatever happens."""
        self._computing[key] = fingerprint, asyncio.get_running_loop().create_future()

    def is_computing(self, key: tuple) -> bool:
        return key in self._computing

    def done(self, key: tuple, frames: list[bytes] | None) -> None:
        """The Backward that spent `key` replied `frames`, or failed before it counted (None)."""
        if (computing := self._computing.pop(key, None)) is None:
            return
        fingerprint, future = computing
        if frames is not None:
            self.put(key, fingerprint, frames)
        if not future.done():
            future.set_result(frames)

    def put(self, key: tuple, fingerprint: bytes, frames: list[bytes]) -> None:
        size = sum(map(len, frames))
        if size > self.max_bytes:
            return
        self._replies[key] = fingerprint, frames
        self.bytes += size
        while self.bytes > self.max_bytes or len(self._replies) > self.max_replies:
            _, (_, dropped) = self._replies.popitem(last=False)
            self.bytes -= sum(map(len, dropped))


class Duplicate(TicketRefused):
    """A Backward under an admission spent here by a call that sent other tensors: two microbatches under one id, or
    one whose admission someone else used first. PERMISSION_DENIED, nothing computed; the trainer retries elsewhere."""


def _same(kept: bytes, fingerprint: bytes) -> None:
    if kept != fingerprint:
        raise Duplicate(
            "admission: spent here by another microbatch with this id and admission (its tensors differ); nothing "
            "computed, ask another peer"
        )


class Uncounted(Exception):
    """The Backward a retry waited for failed before its gradient counted: the retry is judged afresh."""
