"""Every private hivemind API this project relies on, in one file, written against the pinned hivemind==1.1.12.

An upgrade of hivemind means re-reading exactly what this module touches:
- `DecentralizedAverager._run_allreduce_inplace_` (replaced: it builds our runner and copies its results in),
  `._aggregate_with_group` (replaced: it checks the group's gathered round data and picks the tensors to average),
  `.serializer`, `.peer_id`, `GroupInfo.gathered` (each peer's [bandwidth, mode, gathered bytes]), `load_balance_peers`
  and `hagenbach_bishoff`;
  `._running_groups`, `._averaging_alpha`, `.last_updated`, `._state_updated`;
- `AllReduceRunner` (subclassed): its constructor's arguments, `_communicate_with_peer` (replaced: with
  `_generate_input_for_peer`, `_get_peer_stub`, `should_delay_results`, `reducer_timeout`),
  `_accumulate_parts_streaming`, `_ban_sender` (replaced, with `banlock`), `tensor_part_reducer.accumulate_part` /
  `.num_parts`, `tensor_part_container` (`return_deltas`, `compression`, `failed_size`, `num_parts_by_peer`, `prefetch`,
  `register_processed_part`, `register_failed_reducer`, `_input_parts_by_peer`: the tensor of each of our parts, for
  its codec),
  `parts_for_local_averaging`, `sender_peer_ids`, `ordered_peer_ids`, `modes`,
  `banned_senders`, `_future`: to hand every peer the same averaged values, and to fail a round with parts not
  averaged (at once, when a reducer fails);
- `DecentralizedAverager._outer_pipe` (calls into the averager's process), `.get_stub`, `._p2p`, `.prefix`,
  `.serializer` and the `rpc_download_state` RPC (its messages, ended by our STATE_END): to download the state of
  one named peer;
- `DecentralizedAverager.run_in_background`, which sets SIGINT to "ignore" in the calling process for good;
- `DecentralizedAverager.rpc_join_group` (extended), `._matchmaking.group_key_manager.get_averagers` (wrapped): to
  keep peers the stage does not list out of its groups;
- `Matchmaking.look_for_group` (wrapped), `StepControl.data_for_gather`, `GroupInfo`, `._running_groups` and
  `DecentralizedAverager.rpc_aggregate_part` (extended): fixed groups, which skip matchmaking; with
  `AllReduceRunner.finalize` and `._register_allreduce_group` (extended), rounds that give way to a member's other
  round;
- `DecentralizedAverager.rpc_download_state` (extended), `.dht`, and the DHT node's
  `protocol.routing_table.peer_id_to_uid`: in private swarms, to serve our state only to peers that proved the swarm
  key to our DHT node, or that the stage's records list;
- `DecentralizedAverager._declare_for_download_periodically` (replaced), `.declare_state_period`,
  `.allow_state_sharing`, `.state_sharing_priority`, `._state_updated`, `._matchmaking.group_key_manager.prefix`:
  the same declarations, with each DHT store's failure read instead of left to asyncio's "never retrieved";
- `hivemind.compression.serialization._BASE_COMPRESSION_TYPES` (its BLOCKWISE_8BIT entry replaced) and
  `BlockwiseQuantization`'s byte layout: 8-bit blockwise parts encoded and decoded by torch on the CPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import math
import signal
import threading
import time
import typing
from collections.abc import Callable, Iterable

import hivemind
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode
from hivemind.averaging.control import StepControl
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.load_balancing import hagenbach_bishoff, load_balance_peers
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.averaging.partition import AllreduceException, BannedException, TensorPartReducer
from hivemind.compression import (
    BlockwiseQuantization,
    CompressionInfo,
    deserialize_tensor_stream,
    deserialize_torch_tensor,
    serialize_torch_tensor,
)
from hivemind.compression import serialization as hivemind_serialization
from hivemind.compression.adaptive import AdaptiveCompressionBase
from hivemind.compression.quantization import _BLOCKWISE_QUANTIZATION_BLOCKSIZE
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils import MPFuture, get_dht_time
from hivemind.utils.asyncio import (
    achain,
    aiter_with_timeout,
    amap_in_executor,
    as_aiter,
    attach_event_on_finished,
    enter_asynchronously,
)

from dht.forking import forking
from dht.records import parse_p2p_id, signed_records
from swarm.compression.blockwise import decode_cpu, dynamic_map, encode_cpu

logger = logging.getLogger(__name__)
PINNED_VERSION = "1.1.12"
LISTED_READ_INTERVAL_S = 1.0  # private swarms: the most often a download by an unknown peer makes us read the DHT
CLIP_ITERATIONS = 3  # CenteredClip's iterations (robust aggregation; its paper finds 1-3 enough from a good start)
DOWNLOAD_POLL_S = 0.1  # how often a state download checks that its peer is still a live peer of the stage
FIXED_GROUP_POLL_S = 0.01  # how often a part for our fixed group, sent before we began the round, checks again
MAX_WAITING_PARTS = 32  # parts for a group we have not begun that wait for us at once; more are refused at once
# how long a reducer holds a sender's stream after its last averaged part (and a peer its state download after the
# end marker) for the other side to read it and close the stream, as ours does at once: closed by the sending side
# right after its last message, that message was lost in flight now and then (StrictAverager.reply_linger_s)
REPLY_LINGER_S = 5.0
# the last message of a state download (its metadata; hivemind's first message carries the state's, in msgpack)
STATE_END = b"\x00swarm: end of state"


class TorchBlockwiseQuantization(BlockwiseQuantization):
    """hivemind's 8-bit blockwise format (int64 scale count, int64 map size, float32 scales, float32 map, uint8
    codes), encoded and decoded on the CPU by torch (swarm/compression/blockwise.py) instead of bitsandbytes, whose
    import alone costs each process ~3.5 s of CPU. The same bytes: peers running either read each other. Sizes are
    checked before anything is decoded (hivemind's reader does not check them)."""

    def quantize(self, tensor: torch.Tensor, allow_inplace: bool = False):
        x = tensor.reshape(-1).contiguous()
        if x.device.type != "cpu":
            return super().quantize(tensor, allow_inplace)
        blocksize = _BLOCKWISE_QUANTIZATION_BLOCKSIZE
        codes = torch.empty(x.numel(), dtype=torch.uint8)
        absmax = torch.empty(-(-x.numel() // blocksize), dtype=torch.float32)
        if not encode_cpu(x, blocksize, codes, absmax):  # a non-finite value: copies of the part, off the usual path
            _encode_non_finite(x, blocksize, codes, absmax)
        return codes.numpy(), (absmax.numpy(), dynamic_map(torch.device("cpu")).numpy())

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        buffer, shape = serialized_tensor.buffer, tuple(serialized_tensor.size)
        numel, blocksize = math.prod(shape), _BLOCKWISE_QUANTIZATION_BLOCKSIZE
        if len(buffer) < 16:  # (its shape is unsigned in hivemind's protobuf)
            raise ValueError(f"an 8-bit blockwise tensor of {len(buffer)} bytes")
        n_scales, n_codes = (int.from_bytes(buffer[i : i + 8], "little", signed=True) for i in (0, 8))
        if (
            n_scales != -(-numel // blocksize)
            or not 0 < n_codes <= 256
            or len(buffer) != 16 + 4 * (n_scales + n_codes) + numel
        ):
            raise ValueError(
                f"an 8-bit blockwise tensor of shape {list(shape)} with {n_scales} scales, a map of {n_codes} and "
                f"{len(buffer)} bytes"
            )
        view = memoryview(buffer)
        absmax = torch.frombuffer(bytearray(view[16 : 16 + 4 * n_scales]), dtype=torch.float32) if n_scales else None
        code = torch.frombuffer(bytearray(view[16 + 4 * n_scales : 16 + 4 * (n_scales + n_codes)]), dtype=torch.float32)
        if absmax is None:
            values = torch.empty(0)
        else:
            codes = torch.frombuffer(bytearray(view[16 + 4 * (n_scales + n_codes) :]), dtype=torch.uint8)
            if n_codes < 256 and bool((codes >= n_codes).any()):
                raise ValueError(f"an 8-bit blockwise tensor with codes beyond its map of {n_codes}")
            values = decode_cpu(codes, absmax, blocksize, code)
        values = values.reshape(shape).to(getattr(torch, serialized_tensor.dtype))
        return values.requires_grad_(serialized_tensor.requires_grad)


def _encode_non_finite(x: torch.Tensor, blocksize: int, codes: torch.Tensor, absmax: torch.Tensor) -> None:
    """`encode_cpu` of a part holding NaN or infinite values, as bitsandbytes encodes it: its scales ignore NaN, so an
    all-NaN block (the 0/0 of a reducer whose senders all weigh nothing: routine) encodes as zeros, and peers step on
    them as they always did (tests/integration/test_tickets.py); a block holding an infinite value keeps its infinite scale.
    Falling back to bitsandbytes instead imported it inside the averager's round (a round took 2.5-3.1 s, not 1.1)."""
    y = torch.nan_to_num(x, nan=0.0, posinf=math.inf, neginf=-math.inf)
    if encode_cpu(y, blocksize, codes, absmax):
        return
    scales = absmax.clone()
    encode_cpu(torch.nan_to_num(y, posinf=0.0, neginf=0.0), blocksize, codes, absmax)
    infinite = torch.isinf(scales)
    absmax[infinite] = scales[infinite]


def warm_up_8bit() -> None:
    """Build the 8-bit codec's tables (encoding grid, map, pairs of codes) here, before the averagers fork, so that
    none is built inside a round."""
    x = torch.zeros(2 * _BLOCKWISE_QUANTIZATION_BLOCKSIZE)
    deserialize_torch_tensor(serialize_torch_tensor(x, runtime_pb2.CompressionType.BLOCKWISE_8BIT))


# every 8-bit blockwise tensor a hivemind averager of ours sends or receives, in this process and the averager
# processes it forks: hivemind serializes through this table
hivemind_serialization._BASE_COMPRESSION_TYPES["BLOCKWISE_8BIT"] = TorchBlockwiseQuantization()


def check_version() -> None:
    if hivemind.__version__ != PINNED_VERSION:
        logger.warning(
            "hivemind %s is installed; server/collab/hivemind_compat.py was written against %s",
            hivemind.__version__,
            PINNED_VERSION,
        )


def start_in_background(averager: DecentralizedAverager) -> None:
    """Fork the averager's process (frozen: dht/forking.py) without losing our SIGINT handler (hivemind sets it to
    "ignore")."""
    handler = signal.getsignal(signal.SIGINT)
    try:
        with forking():  # the child must not finalize our gRPC objects (dht/forking.py)
            averager.run_in_background(await_ready=False)
    finally:
        signal.signal(signal.SIGINT, handler)


def balance_parts(vector_size: int, bandwidths: typing.Sequence[float | None], min_size: int) -> tuple[int, ...]:
    """hivemind's `load_balance_peers` (each peer's share of a round's values), without its linear program where every
    peer declares the same bandwidth (the fixed groups' 1.0): the program then gives equal parts, and costs 2 ms or
    more of the averager's CPU per round. Every peer of the round computes the same split from the same group."""
    first = bandwidths[0] if bandwidths else None  # hivemind's None: a peer that declared none
    if first is not None and first > 0 and all(bw == first for bw in bandwidths):
        return tuple(hagenbach_bishoff(vector_size, [1.0] * len(bandwidths)))
    return load_balance_peers(vector_size, bandwidths, min_size)


def _declared(store: asyncio.Task) -> None:
    if not store.cancelled() and (e := store.exception()) is not None:
        logger.debug("declaring our state for download in the DHT failed: %r", e)


async def _known(peer_id: str, _dht, node) -> bool:
    """In the DHT's process: whether the node's routing table holds `peer_id` (in a private swarm, only nodes whose
    requests proved the swarm key get there)."""
    return PeerID.from_base58(peer_id) in node.protocol.routing_table.peer_id_to_uid


class _MembersOnly:
    """`GroupKeyManager.get_averagers` of an averager, without the peers its groups may not hold: the leaders it asks
    to join come from there."""

    def __init__(self, get_averagers, averager: StrictAverager):
        self.get_averagers, self.averager = get_averagers, averager

    async def __call__(self, group_key: str, only_active: bool) -> list[tuple[PeerID, float]]:
        found = await self.get_averagers(group_key, only_active)
        return [(peer, expiration) for peer, expiration in found if not self.averager._stranger(peer)]


class _FixedOrMatchmaking:
    """`Matchmaking.look_for_group` of an averager: its fixed group when it has one, else hivemind's matchmaking."""

    def __init__(self, look_for_group, averager: StrictAverager):
        self.look_for_group, self.averager = look_for_group, averager

    async def __call__(self, step: StepControl) -> GroupInfo | None:
        fixed = self.averager.fixed_group_info(step)
        return fixed if fixed is not None else await self.look_for_group(step)


class ClippedPartReducer(TensorPartReducer):
    """A reducer whose part is robust to a minority of senders sending garbage: CenteredClip (Karimireddy, He and
    Jaggi, "Learning from History for Byzantine Robust Optimization", ICML 2021), per part as in BTARD (Gorbunov et
    al., 2022), weighted by the senders' weights. From the medoid v (the sent part with the least total distance to
    the others: robust while fewer than half the senders attack, and, unlike the coordinate-wise median, cheap: a
    tenth of the time on CPU), `iterations` times: v += sum_i w_i (x_i - v) min(1, tau / |x_i - v|), with tau =
    `clip` times the median distance of the parts to the medoid. Honest parts, about as far from each other as from
    the medoid, pass nearly unchanged; one far away moves the result by at most its weight times tau per
    iteration, however large it is. With fewer than 3 senders nobody is an
    outlier: the plain weighted mean. The reducer computes its part once and sends it to every peer, so peers still end
    bitwise equal. `clipped`: per sender index, the parts it sent that were clipped to under half their distance."""

    def __init__(self, part_shapes, num_senders: int, clip: float, iterations: int = CLIP_ITERATIONS):
        self.clip, self.iterations = clip, iterations
        self.received: dict[int, dict[int, tuple[torch.Tensor, float]]] = {}  # part -> sender -> (part, weight)
        self.clipped = [0] * num_senders
        super().__init__(part_shapes, num_senders)

    async def accumulate_part(
        self, sender_index: int, part_index: int, tensor_part: torch.Tensor, weight: float = 1.0
    ) -> torch.Tensor:
        if not self.finished.is_set():
            self.received.setdefault(part_index, {})[sender_index] = (tensor_part, weight)
        return await super().accumulate_part(sender_index, part_index, tensor_part, weight)

    def check_current_part_finished(self) -> None:
        assert self.current_part_accumulated_from <= self.num_current_senders
        if self.current_part_accumulated_from == self.num_current_senders:
            index = self.current_part_index
            counted = [  # as the accumulator counted them: a sender banned later keeps the parts it had sent
                (sender, *sent)
                for sender, sent in self.received.pop(index, {}).items()
                if index < self.sender_failed_after[sender]
            ]
            self.current_part_future.set_result(self._robust_mean(counted))
            self.reset_accumulators()

    def _robust_mean(self, parts: list[tuple[int, torch.Tensor, float]]) -> torch.Tensor:
        parts = [part for part in parts if part[2] > 0]  # a peer without samples is in no median
        if len(parts) < 3 or self.denominator <= 0:
            return self.accumulator.div_(self.denominator)
        x = torch.stack([part.flatten().float() for _, part, _ in parts])
        w = torch.tensor([weight for _, _, weight in parts], dtype=torch.float32) / self.denominator
        apart = torch.cdist(x[None], x[None], compute_mode="donot_use_mm_for_euclid_dist")[0]
        start = int(apart.sum(dim=1).argmin())  # the medoid: a sent part, the closest to all others
        v, tau = x[start], self.clip * apart[start].median()
        for _ in range(self.iterations):
            shift = x - v
            distance = shift.norm(dim=1)
            scale = (tau / distance.clamp_min(torch.finfo(torch.float32).tiny)).clamp(max=1.0)
            v = v + (w * scale) @ shift
        for (sender, _, _), s in zip(parts, scale.tolist(), strict=True):
            self.clipped[sender] += s < 0.5
        return v.view(self.accumulator.shape)

    def finalize(self) -> None:
        self.received.clear()
        super().finalize()


class ExactAllReduceRunner(AllReduceRunner):
    """An all-reduce after which every peer holds the same averaged values, bit for bit.

    hivemind's reducer of a part sends each sender the difference between the part's average and that sender's own
    (compressed) part, and each sender adds it to its exact local values: with a lossy codec every peer ends with a
    different average (its own compression error stays in it), and peers of a stage drift apart step after step. Here
    the reducer sends the average itself, encoded by the same deterministic codec for every sender, and keeps for its
    own part exactly what it sends: the decoded average. The codec's error remains, but it is the same on every
    peer. Peers running hivemind's own runner would send differences: the averagers' DHT prefix carries the protocol
    version, so they never meet."""

    tensor_part_reducer: TensorPartReducer

    def __init__(
        self,
        robust_clip: float = 0.0,
        max_weight: float = math.inf,
        max_total_weight: float = math.inf,
        weight_caps: dict[PeerID, float] | None = None,
        reply_linger_s: float = REPLY_LINGER_S,
        **kwargs,
    ):
        """`robust_clip` > 0: the parts we reduce are a robust mean (ClippedPartReducer), not the weighted mean.
        `max_weight`: the most a sender weighs in the parts we reduce, whatever it declares (its samples: no more
        than one epoch can hold); a weight that is negative, not finite, or changes between parts fails the round.
        `max_total_weight`: the most the whole group can weigh (the samples of one epoch, which its peers share): a
        group whose senders declare more together fails the round, so a peer that overstates its samples can take
        only what its peers left, not the cap each. `weight_caps`: the most each other sender weighs there (the
        samples its admissions prove: server/collab/served.py); a sender it does not name weighs nothing (None: no
        such caps)."""
        self.max_weight, self.max_total_weight, self.weight_caps = max_weight, max_total_weight, weight_caps
        self.reply_linger_s = reply_linger_s
        self.complete_senders: set[PeerID] = set()  # senders all of whose parts we reduced: never banned after
        self.weights: dict[int, float] = {}  # sender index -> its weight as we count it, from its first part
        super().__init__(**kwargs)
        self.tensor_part_container.return_deltas = False  # outputs are averages, not differences
        if robust_clip > 0:  # nothing has been reduced yet: the runner starts when awaited
            reducer = self.tensor_part_reducer
            self.tensor_part_reducer = ClippedPartReducer(reducer.part_shapes, reducer.num_senders, robust_clip)
            reducer.finished.set()  # unused: dropped without hivemind's "received 0% of input tensors" warning
        self.reducer_failed = asyncio.Event()

    async def outputs(self, gather_timeout: float | None = None) -> list[torch.Tensor]:
        """The averaged tensors; raises AllreduceException as soon as a reducer fails. Its part will not be averaged,
        so the round has failed: ending it now (our peers' parts to us are refused from then on) spares us and them
        the wait for every timeout to run out. `gather_timeout`: the round also fails unless every peer of the group
        has begun sending us its part by then (a fixed group: a member that is frozen, or never comes)."""
        outputs: list[torch.Tensor] = []

        async def collect() -> None:
            async for averaged in self:
                outputs.append(averaged)

        task = asyncio.create_task(collect())
        failed = asyncio.create_task(self.reducer_failed.wait())
        try:
            done, _ = await asyncio.wait({task, failed}, timeout=gather_timeout, return_when=asyncio.FIRST_COMPLETED)
            if done or self.all_senders_started.is_set():
                await asyncio.wait({task, failed}, return_when=asyncio.FIRST_COMPLETED)
            else:
                missing = [str(p) for p in self.sender_peer_ids if p not in self.active_senders]
                logger.info("members %s did not reach the round within %.1fs", missing, gather_timeout)
        finally:
            failed.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            if self._future.done() and not self._future.cancelled():
                self._future.exception()  # the cancellation hivemind's `run` stored: retrieved, so not logged
            raise AllreduceException(f"{self.tensor_part_container.failed_size} values were not averaged")
        task.result()
        return outputs

    def _as_sent(self, averaged: torch.Tensor, info: CompressionInfo) -> torch.Tensor:
        """`averaged` as the senders of its part receive it: encoded with the codec of that part's tensor (one codec
        per averager, or one per tensor with hivemind's PerTensorCompression)."""
        compression = self.tensor_part_container.compression
        if isinstance(compression, AdaptiveCompressionBase):
            compression = compression.choose_compression(info)
        return deserialize_torch_tensor(serialize_torch_tensor(averaged, compression.compression_type))

    async def _communicate_with_peer(self, peer_id: PeerID):
        if peer_id != self.peer_id:  # a remote reducer: what it sends back is registered as it comes
            try:
                return await self._from_reducer(peer_id)
            except Exception as e:
                self.reducer_failed.set()  # its part will not be averaged: the round has failed (see `outputs`)
                logger.info("the part %s reduces for us did not come back: %r", str(peer_id)[-6:], e)
                raise
        peer_index, sender_index = self.ordered_peer_ids.index(peer_id), self.sender_peer_ids.index(peer_id)
        if not self._weigh(sender_index, self.weight):
            raise AllreduceException("the group weighs more than one epoch holds")
        loop = asyncio.get_running_loop()
        infos = [info for _, info in self.tensor_part_container._input_parts_by_peer[peer_index]]  # our parts' tensors
        for part_index, part in enumerate(self.parts_for_local_averaging):
            averaged = await self.tensor_part_reducer.accumulate_part(  # capped as a remote sender's would be
                sender_index, part_index, part, weight=self.weights[sender_index]
            )
            info = infos[part_index]
            as_sent = await loop.run_in_executor(None, self._as_sent, averaged, info)  # codec work off the event loop
            self.tensor_part_container.register_processed_part(peer_index, part_index, as_sent)

    async def _from_reducer(self, peer_id: PeerID) -> None:
        """Streams our part to the remote peer that reduces it and registers each averaged part it sends back (as
        hivemind's `_communicate_with_peer` does), but closes the stream as soon as the last part has come, instead
        of reading on until the reducer closes it: a reducer that closed right after its last part lost that part in
        flight now and then (the round failed, "sent 2 parts, but we expected 3"), so ours holds the stream until
        the sender closes it (`_accumulate_parts_streaming`, `reply_linger_s`)."""
        peer_index = self.ordered_peer_ids.index(peer_id)
        try:
            await self._exchange_with(peer_id, peer_index)
        except BaseException:
            if not self.tensor_part_container.finished.is_set():  # (a finished round has let its parts go)
                self.tensor_part_container.register_failed_reducer(peer_index)  # as hivemind's: the outputs end
            raise

    async def _exchange_with(self, peer_id: PeerID, peer_index: int) -> None:
        expected = self.tensor_part_container.num_parts_by_peer[peer_index]
        done_sending = asyncio.Event()
        inputs = attach_event_on_finished(self._generate_input_for_peer(peer_index), done_sending)

        def decoded(message: averaging_pb2.AveragingData) -> torch.Tensor:
            if message.code != averaging_pb2.AVERAGED_PART:
                raise AllreduceException(f"{peer_id} sent {averaging_pb2.MessageCode.Name(message.code)}")
            return deserialize_torch_tensor(message.tensor_part)

        received = 0
        async with contextlib.aclosing(await self._get_peer_stub(peer_id).rpc_aggregate_part(inputs)) as stream:
            if self.should_delay_results(self.peer_id):
                await done_sending.wait()
            parts = amap_in_executor(
                decoded,
                aiter_with_timeout(stream, self.reducer_timeout),
                max_prefetch=self.tensor_part_container.prefetch,
            )
            async with contextlib.aclosing(parts):  # before the stream: it reads the stream
                async for averaged in parts:
                    self.tensor_part_container.register_processed_part(peer_index, received, averaged)
                    received += 1
                    if received == expected:
                        break
        if received != expected:
            raise AllreduceException(f"peer {peer_id} sent {received} parts, but we expected {expected}")

    def _weigh(self, sender_index: int, weight: float) -> bool:
        """Count a sender's weight (capped); False, and the round failed, if the senders counted so far weigh more
        than `max_total_weight` together. Weights are >= 0, so a total over the bound stays over it, and it is found
        before the first part is reduced (that part waits for every sender, and each is weighed first). The reducer
        is then finalized (`_fail_round`)."""
        self.weights[sender_index] = counted = min(weight, self._cap_of(sender_index))
        if counted < weight and self.weight_caps is not None:
            logger.info(
                "%s's part declares %g samples, its admissions prove %g: it weighs %g in our parts",
                str(self.sender_peer_ids[sender_index])[-6:],
                weight,
                self.weight_caps.get(self.sender_peer_ids[sender_index], 0.0),
                counted,
            )
        total = sum(self.weights.values())
        if total <= self.max_total_weight:
            return True
        logger.warning(
            "the group's parts weigh %g samples together, more than one epoch holds (%g): a peer overstates its "
            "samples (declared so far, by sender: %s); the round fails",
            total,
            self.max_total_weight,
            {str(self.sender_peer_ids[i])[-6:]: w for i, w in sorted(self.weights.items())},
        )
        self._fail_round()
        return False

    async def _ban_sender(self, peer_id: PeerID) -> None:
        """A sender that failed (it never came within the sender timeout, broke off, or broke a rule): hivemind's
        reducer would average our part without it and send that part to the others, who would end the round as a
        success while we fail it (CI: a tied round whose third listed peer never came, one peer stepped on the other
        two's average). The round fails for every peer instead. A sender whose parts we all reduced is in every
        part: its stream ending (as it does once it has read our replies) is no failure."""
        if peer_id in self.complete_senders:
            return
        async with self.banlock:
            if peer_id not in self.banned_senders:
                self.banned_senders.add(peer_id)
                self._fail_round()

    def _cap_of(self, sender_index: int) -> float:
        """The most a sender's part weighs in the parts we reduce; ours weighs what we declare, up to `max_weight`."""
        peer = self.sender_peer_ids[sender_index]
        if self.weight_caps is None or peer == self.peer_id:
            return self.max_weight
        return min(self.max_weight, self.weight_caps.get(peer, 0.0))

    def _fail_round(self) -> None:
        """A sender broke the round's rules: no part of ours reaches anyone (hivemind's reducer would go on without
        the sender and hand the others a part it left out), so every peer's round fails, and ours at once."""
        self.tensor_part_reducer.finalize()
        self.reducer_failed.set()

    async def _accumulate_parts_streaming(self, stream, sender_index: int):
        """Reducer side: add each part a sender streams to the accumulator; answer with the part's average."""
        part_index, declared = 0, 0.0
        loop = asyncio.get_event_loop()
        try:
            async for part, weight, compression in amap_in_executor(
                lambda msg: (deserialize_torch_tensor(msg.tensor_part), msg.weight, msg.tensor_part.compression),
                stream,
                max_prefetch=self.tensor_part_container.prefetch,
            ):
                if not 0 <= weight < math.inf or (part_index and weight != declared):  # NaN too
                    logger.warning(
                        "%s sent a part weighing %r (a finite weight >= 0, the same for every part): its values are "
                        "refused",
                        str(self.sender_peer_ids[sender_index])[-6:],
                        weight,
                    )
                    break  # banned (below), which fails the round: no average with a sign flipped or NaN
                if not part_index and not self._weigh(sender_index, weight):
                    break  # banned (below): the round fails
                declared = weight
                try:
                    averaged = await self.tensor_part_reducer.accumulate_part(
                        sender_index, part_index, part, weight=self.weights[sender_index]
                    )
                    part_index += 1
                    if part_index == self.tensor_part_reducer.num_parts:  # in every part now: `_ban_sender`
                        self.complete_senders.add(self.sender_peer_ids[sender_index])
                except BannedException:
                    break  # the sender was banned meanwhile: its parts are no longer needed
                reply = await loop.run_in_executor(None, serialize_torch_tensor, averaged, compression)
                yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=reply)
            if part_index == self.tensor_part_reducer.num_parts:
                # every part came back averaged: hold the stream until the sender, having read them all, closes it
                # (hivemind's stream handler then cancels this call, and the runner's handler bans whoever it was
                # serving: `_ban_sender` spares a complete sender). Closed by us right after the last part, that part
                # was lost in flight now and then. A reply cut short ends at once: its sender learns the round failed.
                del part, averaged, reply  # a part each: not held while we wait
                await asyncio.sleep(self.reply_linger_s)
        finally:
            if part_index != self.tensor_part_reducer.num_parts:
                await self._ban_sender(self.sender_peer_ids[sender_index])


class AveragerClosed(AllreduceException):
    """A round asked of an averager that is shutting down."""


class ClosesReplica(DecentralizedAverager):
    """A DecentralizedAverager whose process, as it ends, closes its handle on the DHT's daemon (a `P2P.replicate`
    that hivemind never closes: each averager that ended left its unix socket in /tmp)."""

    async def _shutdown(self, timeout: float | None) -> None:
        """The averager's process: hivemind's shutdown, then the replica's (which closes our client and removes its
        socket, not the daemon: that is the DHT's)."""
        try:
            await super()._shutdown(timeout)
        finally:
            p2p = getattr(self, "_p2p", None)
            if p2p is not None:
                await p2p.shutdown()


class StrictAverager(ClosesReplica):
    """A DecentralizedAverager whose rounds average everything or fail, whose peers end each round with identical
    values (ExactAllReduceRunner), whose groups hold only the peers it was told of, and that can download the state
    of one named peer.

    hivemind lets any averager that finds the prefix in the DHT lead or join a group. Once told its members
    (`expect_group`), this one neither accepts a join request from another peer (`rpc_join_group`) nor asks one to
    lead it (its leader queue, read from the DHT, is filtered), and a group that still names another peer fails
    before anything is sent (`_aggregate_with_group`)."""

    _members: frozenset[PeerID] | None = None  # libp2p ids allowed in our groups (None: anyone); averager's process
    _fixed: tuple[PeerID, ...] | None = None  # the next rounds' group, us included (None: matchmaking); its process
    _gather_timeout: float | None = None  # how long a fixed round waits for its members to begin (averager's process)
    _waiting_parts = 0  # parts for a group we have not begun, waiting for us now (averager's process)
    # whether our rounds run in fixed groups (`fix_group`; set before the process forks): then a part that a peer the
    # stage lists sends for a group we have not begun waits for us, also before our first round
    fixed_groups = False
    # private swarms (set before the process forks): the DHT key of the stage's signed records. Nobody may join our
    # groups before we are told the members, and only the peers those records list (joining peers included) may
    # download our state: an uninvited libp2p peer that dials us directly gets nothing.
    listed_under: str | None = None
    robust_clip = 0.0  # > 0: the parts this peer reduces are CenteredClip's robust mean (set before the process forks)
    max_weight = math.inf  # the most a peer's part weighs in the parts we reduce (set before the process forks)
    max_total_weight = math.inf  # the most the group's parts weigh together (set before the process forks)
    reply_linger_s = REPLY_LINGER_S  # how long we hold a stream whose last message we sent (set before the fork)
    _weight_caps: dict[PeerID, float] | None = None  # the next rounds' caps of each member's weight (its process)
    _listed_read_at = float("-inf")
    runner_type: type[ExactAllReduceRunner] = ExactAllReduceRunner  # a test's runner may break a round's rules

    def __init__(self, *args, **kwargs):
        # `step` and `shutdown` send down one pipe: a step sent after the shutdown waits forever for the process to
        # take it (seen: a server's compute thread entering a round as the server stopped, and the server's
        # shutdown waiting on that thread). No step is sent once `shutdown` began.
        self._sending, self._closing, self._shut = threading.Lock(), False, False
        self._giving_way: set[bytes] = set()  # groups of our fixed rounds that `gives_way` (averager's process)
        super().__init__(*args, **kwargs)

    @property
    def closing(self) -> bool:
        """Whether `shutdown` has begun: no round will be averaged any more."""
        return self._closing

    def step(self, *args, **kwargs):
        """hivemind's; raises AveragerClosed once `shutdown` has begun. Call it with wait=False: `shutdown` waits
        while a step is being handed to the process."""
        with self._sending:
            if self._closing:
                raise AveragerClosed("the averager is shutting down")
            return super().step(*args, **kwargs)

    def shutdown(self) -> None:
        """hivemind's, once, and also for a process that is gone (no step is sent to it afterwards)."""
        self._closing = True  # a step not yet handed over will not be
        if self._sending.acquire(timeout=self.shutdown_timeout):  # one being handed over goes first
            self._sending.release()
        else:  # its process does not take it (a frozen event loop): hivemind's shutdown terminates the process
            logger.warning("a round handed to the averager's process held its shutdown %.0fs", self.shutdown_timeout)
        if not self._shut and self.is_alive():
            self._shut = True
            super().shutdown()

    def expect_group(self, size: int | None, members: Iterable[str] | None = None) -> None:
        """Rounds from the next `step` on begin as soon as `size` peers (us included) have gathered, instead of
        waiting for their scheduled time (hivemind's `target_group_size`, set per round: the stage knows who is in
        it). None: at the scheduled time. `members`: the libp2p ids of the peers a group may hold besides us (those
        the stage's signed records list); malformed ones are left out; None: anyone. Travels down the pipe `step`
        uses, so it reaches the process first."""
        valid = None if members is None else sorted(m for m in members if parse_p2p_id(m) is not None)
        self._outer_pipe.send(("_expect_group", [size, valid], {}))

    def cap_weights(self, caps: dict[str, float] | None) -> None:
        """Rounds from the next `step` on count each other member's part at no more than `caps` gives for its libp2p
        id, and a member it does not name at 0 (None: no such caps). Travels down the pipe `step` uses."""
        valid = None if caps is None else {m: float(c) for m, c in caps.items() if parse_p2p_id(m) is not None}
        self._outer_pipe.send(("_cap_weights", [valid], {}))

    async def _cap_weights(self, caps: dict[str, float] | None) -> None:
        self._weight_caps = None if caps is None else {PeerID.from_base58(m): c for m, c in caps.items()}

    async def _expect_group(self, size: int | None, members: list[str] | None) -> None:
        self._matchmaking.target_group_size = size
        self._members = None if members is None else frozenset(map(PeerID.from_base58, members)) | {self.peer_id}
        manager = self._matchmaking.group_key_manager
        if not isinstance(manager.get_averagers, _MembersOnly):  # once per process: the matchmaking object lives on
            manager.get_averagers = _MembersOnly(manager.get_averagers, self)

    def fix_group(self, members: Iterable[str] | None, gather_timeout: float | None = None) -> None:
        """Rounds from the next `step` on hold us and exactly `members` (libp2p ids), with no matchmaking: the
        group's id is a hash of the members and of what the round gathers, so peers that see the group or the round
        differently meet nobody and fail at once (a peer that asks a member not yet in the round waits for it, up to
        the all-reduce timeout). The round fails unless every member has begun sending its part within
        `gather_timeout` seconds (None: no bound). None (or a malformed id): matchmaking again."""
        valid = None if members is None else sorted(set(members))
        if valid is not None and any(parse_p2p_id(m) is None for m in valid):
            valid = None
        self._outer_pipe.send(("_fix_group", [valid, gather_timeout], {}))

    async def _fix_group(self, members: list[str] | None, gather_timeout: float | None = None) -> None:
        self._gather_timeout = gather_timeout
        if members is None:
            self._fixed = None
        else:  # sorted: every member hashes them in the same order
            self._fixed = tuple(sorted({*map(PeerID.from_base58, members), self.peer_id}, key=PeerID.to_bytes))
        matchmaking = self._matchmaking
        if not isinstance(matchmaking.look_for_group, _FixedOrMatchmaking):  # once per process
            matchmaking.look_for_group = _FixedOrMatchmaking(matchmaking.look_for_group, self)

    def fixed_group_info(self, step: StepControl) -> GroupInfo | None:
        """The averager's process: the group of a fixed round, the same on every member that gathers the same data."""
        if self._fixed is None:
            return None
        _, _, user_data = self.serializer.loads(step.data_for_gather)
        digest = hashlib.sha256(self.prefix.encode() + user_data + b"".join(p.to_bytes() for p in self._fixed))
        group_id = digest.digest()[:20]
        # every member computes the same order (who reduces which part), rotating with the round
        order = tuple(sorted(self._fixed, key=lambda p: hashlib.sha256(group_id + p.to_bytes()).digest()))
        same = self.serializer.dumps([1.0, AveragingMode.NODE.value, user_data])  # bandwidths alike: even parts
        if self.gives_way(self.serializer.loads(user_data)):  # known before the group is registered as running
            self._giving_way &= set(self._running_groups)  # (one of a step cancelled before it ran never ends)
            self._giving_way.add(group_id)
        return GroupInfo(group_id, order, (same,) * len(order))

    async def rpc_aggregate_part(
        self, stream: typing.AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> typing.AsyncIterator[averaging_pb2.AveragingData]:  # typing's: hivemind reads the hint's `_name`
        """A member of our fixed group that reached the round before us waits for us (up to the all-reduce timeout)
        instead of being told at once that we know no such group; a request for another group while we run ours is
        refused at once (hivemind's reply), unless ours `gives_way`: then ours fails at once, and the request waits
        for our next round. At most MAX_WAITING_PARTS parts wait at once: before our first round any listed peer's
        part may wait, and in a public swarm that is anyone's."""
        request = await anext(stream)
        if (
            request.group_id not in self._running_groups
            and self._waits_for(context.remote_id)
            and self._waiting_parts < MAX_WAITING_PARTS
        ):
            self._waiting_parts += 1
            try:
                loop = asyncio.get_running_loop()
                deadline = loop.time() + (self._allreduce_timeout or 10.0)
                while request.group_id not in self._running_groups and loop.time() < deadline:
                    if not set(self._running_groups) <= self._giving_way:
                        break  # a round of ours runs: refused
                    for group_id in self._running_groups:  # that member is in none of them: they cannot end
                        self._give_way(group_id, context.remote_id)
                    await asyncio.sleep(FIXED_GROUP_POLL_S)
            finally:
                self._waiting_parts -= 1
        async for message in super().rpc_aggregate_part(achain(as_aiter(request), stream), context):
            yield message

    def gives_way(self, gathered: object) -> bool:
        """The averager's process: whether our round that gathered this (in a fixed group) fails as soon as a member
        asks us for another round, instead of waiting for that member's part: a round whose answer is whether every
        member began it (server/collab/averaging.py: a parameter round's probe)."""
        return False

    def _give_way(self, group_id: bytes, member: PeerID) -> None:
        running = self._running_groups.get(group_id)
        if running is None or not running.done() or running.cancelled():
            return  # its runner is not built yet: asked again at the next poll
        runner = running.result()
        if runner._future.done():
            return  # it has ended (given way at an earlier poll, or finished)
        runner.finalize(exception=AllreduceException(f"member {member} began another round"))
        runner._future.exception()  # retrieved: our round's own failure says it (asyncio would log it)

    def _waits_for(self, peer_id: PeerID) -> bool:
        """Whether a part `peer_id` sends for a group we have not begun waits for us: a member of the fixed group we
        were last told of; before we were told one (our first round), any peer the stage lists. Refused at once
        there, a peer that began the first round before us failed its attempt, its partners' attempts failed with it
        (its part left their reducers), and so on until all had begun (at epoch 0 of a tied swarm: "Reducer: received
        16.7% of input tensors", attempts retried for 0.5 s)."""
        if self._fixed is not None:
            return peer_id in self._fixed
        return self.fixed_groups and not self._stranger(peer_id)

    def _stranger(self, peer_id: PeerID) -> bool:
        if self._members is None:
            return self.listed_under is not None
        return peer_id not in self._members

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

    async def _listed(self, peer_id: PeerID) -> bool:
        """The averager's process: whether `peer_id` proved the swarm key to our DHT node (it is in its routing table:
        a joiner pings our node first, dht/node.py `introduce`), or a signed record under `listed_under` names it
        (read at most once per LISTED_READ_INTERVAL_S: an unknown peer cannot make us flood the DHT)."""
        try:
            if await self.dht.run_coroutine(functools.partial(_known, peer_id.to_base58()), return_future=True):
                return True
        except Exception as e:  # the DHT process's errors
            logger.debug("asking our DHT node about %s failed: %r", peer_id, e)
        now = asyncio.get_running_loop().time()
        if self.listed_under is None or now - self._listed_read_at < LISTED_READ_INTERVAL_S:
            return False
        self._listed_read_at = now
        try:
            found = await self.dht.get(self.listed_under, latest=True, return_future=True)
        except Exception as e:  # the DHT's errors: a download refused now is asked again later
            logger.debug("reading the stage's records failed: %r", e)
            return False
        named = peer_id.to_base58()
        return found is not None and any(record.p2p_id == named for _, record, _ in signed_records(found.value))

    async def rpc_download_state(
        self, request: averaging_pb2.DownloadRequest, context: P2PContext
    ) -> typing.AsyncIterator[averaging_pb2.DownloadData]:  # typing's: hivemind reads the hint's `_name`
        """In a private swarm, a peer the stage's records do not list gets nothing (its download fails at once)."""
        if (
            self.listed_under is not None
            and self._stranger(context.remote_id)
            and not await self._listed(context.remote_id)
        ):
            logger.warning("refused our state to %s: the stage's records do not list it", context.remote_id)
            return
        sent = False
        async for message in super().rpc_download_state(request, context):
            sent = True
            yield message
        if sent:  # (hivemind sends nothing while we share no state)
            # the end: the peer downloading knows it has it all and closes the stream, which we hold until then
            # (closed by us right after the last part, the part could be lost in flight, as in rpc_aggregate_part)
            yield averaging_pb2.DownloadData(metadata=STATE_END)
            await asyncio.sleep(self.reply_linger_s)

    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> typing.AsyncIterator[averaging_pb2.MessageFromLeader]:  # typing's: hivemind reads the hint's `_name`
        """Leader side: a peer the stage does not list is told we are not looking for a group."""
        if self._stranger(context.remote_id):
            logger.debug("refused a join request from %s: not a listed peer of the stage", context.remote_id)
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.NOT_LOOKING_FOR_GROUP)
            return
        async for message in super().rpc_join_group(request, context):
            yield message

    def round_tensors(self, gathered: object, local: list[torch.Tensor]) -> list[torch.Tensor]:
        """The averager's process: the tensors a round averages, given what this peer gathered for it (all of the
        averaged tensors here; a subclass may pick others, allocated in shared memory before the process forked)."""
        return local

    def round_settings(self, gathered: object) -> dict:
        """The averager's process: what a round that gathered this runs with instead of the averager's own
        (`compression`, `robust_clip`, `max_weight`, `max_total_weight`, `weight_caps`); none here."""
        return {}

    async def _aggregate_with_group(self, group_info, min_vector_size: int, **kwargs):
        """hivemind's, but a group whose peers gathered different round data (another epoch's round, or another
        phase of it) fails before anything is sent, and the round averages the tensors `round_tensors` picks."""
        try:
            bandwidths, mode_ids, user_bytes = zip(*map(self.serializer.loads, group_info.gathered), strict=True)
            gathered = dict(zip(group_info.peer_ids, map(self.serializer.loads, user_bytes), strict=True))
            rounds = sorted({repr(g) for g in gathered.values()})
        except Exception as e:
            raise MatchmakingException(f"malformed round data in the group: {e!r}") from e
        if len(rounds) != 1:
            raise MatchmakingException(f"the group gathered different rounds {rounds}: not averaged together")
        if strangers := [str(p) for p in group_info.peer_ids if self._stranger(p)]:
            raise MatchmakingException(f"the group holds peers the stage does not list: {strangers[:4]}")
        download_bandwidths = [
            bw if AveragingMode(mode) != AveragingMode.CLIENT else 0.0
            for bw, mode in zip(bandwidths, mode_ids, strict=False)
        ]
        try:
            async with enter_asynchronously(self.get_tensors()) as averaged:
                local = list(averaged)
                tensors = self.round_tensors(gathered[self.peer_id], local)
                if tensors is not local:
                    kwargs.pop("tensor_infos", None)  # those describe the averaged tensors
                kwargs |= self.round_settings(gathered[self.peer_id])
                fractions = await asyncio.get_event_loop().run_in_executor(
                    None, balance_parts, sum(t.numel() for t in tensors), download_bandwidths, min_vector_size
                )
                await self._run_allreduce_inplace_(tensors, group_info, peer_fractions=fractions, **kwargs)
            return gathered
        except BaseException as e:
            raise MatchmakingException(f"Unable to run All-Reduce: {e!r}") from e

    @contextlib.contextmanager
    def _register_allreduce_group(self, group_info: GroupInfo):
        """hivemind's; a round that gave way stops giving way only once it is no longer running (dropped before, a
        member's part that waited for it would find it running, and not giving way: refused)."""
        try:
            with super()._register_allreduce_group(group_info):
                yield
        finally:
            self._giving_way.discard(group_info.group_id)

    async def _run_allreduce_inplace_(self, tensors, group_info, group_id=None, **kwargs):
        """Averages `tensors` in place with the group. hivemind counts a round in which some reducers timed out as a
        success ("received 57% results"): the parts they held stay local, and peers silently disagree. So is a round
        in which we excluded a sender that timed out from the part we reduced. Such a round fails here, so that the
        caller retries it."""
        group_id = group_info.group_id if group_id is None else group_id
        rules = dict(  # a round's own settings (`round_settings`) override these
            robust_clip=self.robust_clip,
            max_weight=self.max_weight,
            max_total_weight=self.max_total_weight,
            weight_caps=self._weight_caps,
        )
        runner = self.runner_type(
            reply_linger_s=self.reply_linger_s,
            p2p=self._p2p,
            servicer_type=type(self),
            prefix=self.prefix,
            tensors=tensors,
            group_id=group_id,
            ordered_peer_ids=group_info.peer_ids,
            **(rules | kwargs),
        )
        self._running_groups[group_id].set_result(runner)
        if self._averaging_alpha != 1.0:
            raise ValueError("an exact all-reduce replaces tensors by the average: averaging_alpha must be 1")
        outputs = await runner.outputs(self._gather_timeout if self._fixed is not None else None)
        if runner.tensor_part_container.failed_size:
            raise AllreduceException(f"{runner.tensor_part_container.failed_size} values were not averaged")
        if runner.banned_senders:  # their values are missing from the parts we reduced: other peers got them
            raise AllreduceException(f"{len(runner.banned_senders)} peers' values were left out of our part")
        for tensor, averaged in zip(tensors, outputs, strict=True):  # all or nothing: a failed round changes nothing
            tensor.copy_(averaged)
        reducer = runner.tensor_part_reducer
        if isinstance(reducer, ClippedPartReducer) and any(reducer.clipped):
            logger.warning(
                "robust aggregation clipped parts far from the others' (parts clipped by sender: %s)",
                {str(p)[-6:]: n for p, n in zip(runner.sender_peer_ids, reducer.clipped, strict=True) if n},
            )
        self.last_updated = get_dht_time()
        self._state_updated.set()

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
