"""Every private hivemind API this project relies on, in one file, written against the pinned hivemind==1.1.12.

An upgrade of hivemind means re-reading exactly what this module touches:
- `DecentralizedAverager._run_allreduce_inplace_` (overridden), `._running_groups` (the round's `AllReduceRunner`),
  `AllReduceRunner.tensor_part_container.failed_size` and `.banned_senders`: to fail a round with parts not averaged;
- `DecentralizedAverager._outer_pipe` (calls into the averager's process), `.get_stub`, `._p2p`, `.prefix`,
  `.serializer` and the `rpc_download_state` RPC: to download the state of one named peer;
- `DecentralizedAverager.run_in_background`, which sets SIGINT to "ignore" in the calling process for good.
"""

from __future__ import annotations

import logging
import signal

import hivemind
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.partition import AllreduceException
from hivemind.compression import deserialize_tensor_stream
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture
from hivemind.utils.asyncio import aiter_with_timeout

logger = logging.getLogger(__name__)
PINNED_VERSION = "1.1.12"


def check_version() -> None:
    if hivemind.__version__ != PINNED_VERSION:
        logger.warning(
            "hivemind %s is installed; server/collab/hivemind_compat.py was written against %s",
            hivemind.__version__,
            PINNED_VERSION,
        )


def start_in_background(averager: DecentralizedAverager) -> None:
    """Fork the averager's process without losing our SIGINT handler (hivemind sets it to "ignore")."""
    handler = signal.getsignal(signal.SIGINT)
    try:
        averager.run_in_background(await_ready=False)
    finally:
        signal.signal(signal.SIGINT, handler)


class StrictAverager(DecentralizedAverager):
    """A DecentralizedAverager whose rounds either average everything or fail, and that can download the state of
    one named peer."""

    async def _run_allreduce_inplace_(self, tensors, group_info, group_id=None, **kwargs):
        """hivemind counts a round in which some reducers timed out as a success ("received 57% results"): the parts
        they held stay local, and peers silently disagree. So is a round in which we excluded a sender that timed out
        from the part we reduced. Make such a round fail, so that the caller retries it."""
        await super()._run_allreduce_inplace_(tensors, group_info, group_id, **kwargs)
        runner = self._running_groups[group_info.group_id if group_id is None else group_id].result()
        if runner.tensor_part_container.failed_size:
            raise AllreduceException(f"{runner.tensor_part_container.failed_size} values were not averaged")
        if runner.banned_senders:  # their values are missing from the parts we reduced: other peers got them
            raise AllreduceException(f"{len(runner.banned_senders)} peers' values were left out of our part")

    def download_state(self, peer_id: str, timeout: float) -> tuple[dict, list[torch.Tensor]] | None:
        """Any thread. The state of one named peer of the stage, or None if it did not send one (it is not sharing,
        or it is gone). Unlike `load_state_from_peers`, which downloads from whichever peer the DHT lists as sharing
        with the highest priority: after a failed round only the peer that stepped has the right state, and that DHT
        record can lag behind the peers' real state by tens of seconds."""
        future: MPFuture = MPFuture()
        self._outer_pipe.send(("_download_state_from", [], dict(peer_id=peer_id, timeout=timeout, future=future)))
        try:
            return future.result(timeout=2 * timeout)
        except TimeoutError:  # the peer, or our averager process, hung
            logger.warning("%s sent no state within %.0fs", peer_id[-6:], 2 * timeout)
            return None

    async def _download_state_from(self, peer_id: str, timeout: float, future: MPFuture) -> None:
        """The averager's process: hivemind's state download RPC, addressed to one peer."""
        metadata = None

        async def parts(stream):
            nonlocal metadata
            async for message in aiter_with_timeout(stream, timeout=timeout):
                if message.metadata:
                    metadata = self.serializer.loads(message.metadata)
                yield [message.tensor_part]

        try:
            stub = self.get_stub(self._p2p, PeerID.from_base58(peer_id), namespace=self.prefix)
            tensors = await deserialize_tensor_stream(
                parts(await stub.rpc_download_state(averaging_pb2.DownloadRequest()))
            )
            future.set_result((metadata, tensors) if metadata else None)
        except Exception as e:
            logger.warning("downloading the state of %s failed: %r", peer_id[-6:], e)
            if not future.done():
                future.set_result(None)
