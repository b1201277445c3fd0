"""StrictAverager: the averager every round of ours runs on. Its rounds average everything or fail, its groups hold
only the peers the stage lists, fixed groups skip matchmaking, and in private swarms its state goes only to listed
peers."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import math
import threading
import typing
from collections.abc import Iterable

import torch
from hivemind.averaging.allreduce import AveragingMode
from hivemind.averaging.control import StepControl
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.averaging.partition import AllreduceException
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.asyncio import achain, as_aiter, enter_asynchronously

from dht.records import parse_p2p_id, signed_records
from server.collab.compat.download import SharesState
from server.collab.compat.runner import ClippedPartReducer, ExactAllReduceRunner, balance_parts

logger = logging.getLogger(__name__)
LISTED_READ_INTERVAL_S = 1.0  # private swarms: the most often a download by an unknown peer makes us read the DHT
FIXED_GROUP_POLL_S = 0.01  # how often a part for our fixed group, sent before we began the round, checks again
MAX_WAITING_PARTS = 32  # parts for a group we have not begun that wait for us at once; more are refused at once


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


class AveragerClosed(AllreduceException):
    """A round asked of an averager that is shutting down."""


class StrictAverager(SharesState):
    """A DecentralizedAverager whose rounds average everything or fail, whose peers end each round with identical
    values (ExactAllReduceRunner), whose groups hold only the peers it was told of, and that can download the state
    of one named peer (SharesState).

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
        member began it (server/collab/rounds.py: a parameter round's probe)."""
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
        async for message in super().rpc_download_state(request, context):  # ended by STATE_END (download.py)
            yield message

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
