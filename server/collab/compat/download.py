"""A stage peer's state, between averagers: declared in the DHT (with each store's failure read), served with an end
marker after hivemind's messages, and downloaded from one named peer (SharesState, a base of StrictAverager)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import typing
from collections.abc import Callable

import torch
from hivemind.averaging.partition import AllreduceException
from hivemind.compression import deserialize_tensor_stream
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture, get_dht_time
from hivemind.utils.asyncio import aiter_with_timeout

from server.collab.compat.process import ClosesReplica
from server.collab.compat.runner import REPLY_LINGER_S

logger = logging.getLogger(__name__)
DOWNLOAD_POLL_S = 0.1  # how often a state download checks that its peer is still a live peer of the stage
# the last message of a state download (its metadata; hivemind's first message carries the state's, in msgpack)
STATE_END = b"\x00swarm: end of state"


def _declared(store: asyncio.Task) -> None:
    if not store.cancelled() and (e := store.exception()) is not None:
        logger.debug("declaring our state for download in the DHT failed: %r", e)


class SharesState(ClosesReplica):
    """A DecentralizedAverager that declares its state for download in the DHT, ends the state it serves with
    STATE_END, and can download the state of one named peer."""

    reply_linger_s = REPLY_LINGER_S  # how long we hold a stream whose last message we sent (set before the fork)

    async def _declare_for_download_periodically(self) -> None:
        """The averager's process: hivemind's loop that tells the DHT whether (and how eagerly) we share our state,
        once per `declare_state_period` or when that changes. Its stores ran as tasks nobody awaited, so one that
        timed out (a frozen peer's DHT node) was logged as asyncio's "Task exception was never retrieved"; here each
        one's failure is read and logged at debug level."""
        key = f"{self._matchmaking.group_key_manager.prefix}.all_averagers"
        stores: set[asyncio.Task] = set()  # referenced until done (the loop keeps only weak references)
        was_sharing = self.allow_state_sharing
        while True:
            expiration = get_dht_time() + self.declare_state_period
            if self.allow_state_sharing or was_sharing:  # say so once more when it was just switched off
                priority = self.state_sharing_priority if self.allow_state_sharing else None
                future = self.dht.store(key, priority, expiration, subkey=self.peer_id.to_bytes(), return_future=True)
                store = asyncio.create_task(asyncio.wait_for(future, timeout=expiration - get_dht_time()))
                stores.add(store)
                store.add_done_callback(_declared)
                store.add_done_callback(stores.discard)
                was_sharing = self.allow_state_sharing
            self._state_updated.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._state_updated.wait(), timeout=max(0.0, expiration - get_dht_time()))

    async def rpc_download_state(
        self, request: averaging_pb2.DownloadRequest, context: P2PContext
    ) -> typing.AsyncIterator[averaging_pb2.DownloadData]:  # typing's: hivemind reads the hint's `_name`
        """hivemind's, then STATE_END, after which we hold the stream until the peer downloading closes it."""
        sent = False
        async for message in super().rpc_download_state(request, context):
            sent = True
            yield message
        if sent:  # (hivemind sends nothing while we share no state)
            # the end: the peer downloading knows it has it all and closes the stream, which we hold until then
            # (closed by us right after the last part, the part could be lost in flight, as in rpc_aggregate_part)
            yield averaging_pb2.DownloadData(metadata=STATE_END)
            await asyncio.sleep(self.reply_linger_s)

    def download_state(
        self, peer_id: str, timeout: float, alive: Callable[[], bool] = lambda: True
    ) -> tuple[dict, list[torch.Tensor]] | None:
        """Any thread. The state of one named peer of the stage, or None if it did not send one (it is not sharing,
        or it is gone). Unlike `load_state_from_peers`, which downloads from whichever peer the DHT lists as sharing
        with the highest priority: after a failed round only the peer that stepped has the right state, and that DHT
        record can lag behind the peers' real state by tens of seconds. Given up within DOWNLOAD_POLL_S once
        `alive()` turns false (the stage dropped the peer: frozen or dead), so a silent peer holds us for the
        stage's peer timeout, not `timeout`."""
        future: MPFuture = MPFuture()
        self._outer_pipe.send(("_download_state_from", [], dict(peer_id=peer_id, timeout=timeout, future=future)))
        deadline = time.monotonic() + 2 * timeout
        while True:
            try:
                return future.result(timeout=DOWNLOAD_POLL_S)
            except TimeoutError:
                if not alive():
                    logger.warning("%s stopped answering: its state download is abandoned", peer_id[-6:])
                    return None
                if time.monotonic() > deadline:  # the peer, or our averager process, hung
                    logger.warning("%s sent no state within %.0fs", peer_id[-6:], 2 * timeout)
                    return None

    async def _download_state_from(self, peer_id: str, timeout: float, future: MPFuture) -> None:
        """The averager's process: hivemind's state download RPC, addressed to one peer, up to its end marker
        (STATE_END: a download without it is cut short, and refused); then we close the stream."""
        metadata, whole = None, False

        async def parts(stream):
            nonlocal metadata, whole
            async for message in aiter_with_timeout(stream, timeout=timeout):
                if message.metadata == STATE_END:
                    whole = True
                    return
                if message.metadata:
                    metadata = self.serializer.loads(message.metadata)
                yield [message.tensor_part]

        try:
            stub = self.get_stub(self._p2p, PeerID.from_base58(peer_id), namespace=self.prefix)
            async with contextlib.aclosing(await stub.rpc_download_state(averaging_pb2.DownloadRequest())) as stream:
                tensors = await deserialize_tensor_stream(parts(stream))
            if metadata and not whole:
                raise AllreduceException("the state ended before its end marker")
            future.set_result((metadata, tensors) if metadata else None)
        except Exception as e:
            logger.warning("downloading the state of %s failed: %r", peer_id[-6:], e)
            if not future.done():
                future.set_result(None)
