"""An asyncio face for `hivemind.DHT`: start, announce a server, discover a stage's servers, shut down.

hivemind runs the DHT in a child process (plus its p2pd daemon); every call here returns an awaitable and never
blocks the event loop. Shut it down in a `finally`: a killed parent orphans those children.

Every node runs hivemind's `RSASignatureValidator`: a server's record lives under its key's `[owner:...]` subkey and
only that key can change it (dht/identity.py); discovery ignores records under any other subkey, and names each
server by its key's fingerprint.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import dataclasses
import functools
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import hivemind
import torch
from hivemind.dht.node import DHTNode
from hivemind.p2p import P2P, PeerID
from hivemind.utils import get_dht_time

from dht.authorizer import SwarmKeyAuthorizer
from dht.forking import forking
from dht.identity import Identity, fingerprint
from dht.reaper import ensure_reaper
from dht.records import PeerEntry, ServerRecord, StageRecordValidator, differences, signed_records, stage_key
from dht.relay import ONE_THREAD
from dht.relay import check_blocking as check_relay
from swarm.net import DHT_WAIT_TIMEOUT_S, listen_multiaddrs
from swarm.protocol import p2p as p2p_transport
from swarm.protocol.access import SwarmKey
from swarm.protocol.tls import pin

logger = logging.getLogger(__name__)
RELAY_MODES = ("use", "reserve", "no-listen", "serve")
START_TIMEOUT_S = 60.0  # a DHT node starts in about a second; its bootstrap pings wait DHT_WAIT_TIMEOUT_S each
BOOTSTRAP_PAUSES_S = (2.0, 4.0)  # between starts whose bootstrap peers did not answer: 3 starts in all
START_ATTEMPTS = 2
RELAY_ATTEMPTS = 3  # starts of a relaying node whose relay fails its check (dht/relay.py) before we serve anyway


def _static_relays_only(make_args):
    """hivemind's p2pd command line, with `-relayDiscovery=false` wherever it passes `-trustedRelays`, and a
    relaying node's daemon (`-forceReachabilityPublic`) on one OS thread.

    With relay discovery on (the daemon's default; hivemind has no parameter for it), libp2p's autorelay takes its
    candidates from a feed and waits for four of them, or for its three-minute boot delay, before it reserves a
    slot: a server behind NAT was unreachable for 208-230 s after it started (measured on loopback and behind a
    masquerading router). With static relays only (our bootstrap peers), it reserves as soon as libp2p finds the node
    private. One thread: so that the relay service its flags configure is the one that serves (dht/relay.py). Also
    notes the daemon's listen address for the P2P.create that runs it (`_removing_failed_sockets`)."""

    def with_static_relays(*args, **kwargs):
        if (launched := _LAUNCHED.get()) is not None and "listen" in kwargs:
            launched.append(str(kwargs["listen"]))
        if "trustedRelays" in kwargs:
            kwargs.setdefault("relayDiscovery", False)
        command = make_args(*args, **kwargs)
        return [*ONE_THREAD, *command] if kwargs.get("forceReachabilityPublic") else command

    with_static_relays.static_relays_only = True  # type: ignore[attr-defined]
    return with_static_relays


# the daemons' listen addresses of the P2P.create running in this task, and the P2P instances that the DHTNode.create
# running in it started (`_removing_failed_sockets`, `_ending_failed_daemons`)
_LAUNCHED: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("launched_p2pd", default=None)
_STARTED: contextvars.ContextVar[list[P2P] | None] = contextvars.ContextVar("started_p2p", default=None)


def _removing_failed_sockets(create: Any) -> Any:
    """hivemind's P2P.create, which also removes its daemon's unix socket when the start fails: a daemon that exits
    at start (none of its bootstrap peers answered: a private swarm's peers refuse a node without the key) has bound
    it, and hivemind leaves it in /tmp, one per attempt."""

    @functools.wraps(create.__func__)
    async def create_or_clean_up(cls: type[P2P], *args: Any, **kwargs: Any) -> P2P:
        launched: list[str] = []
        token = _LAUNCHED.set(launched)
        try:
            p2p = await create.__func__(cls, *args, **kwargs)
        except BaseException:
            for maddr in launched:  # "/unix/tmp/hivemind-p2pd-....sock"
                with contextlib.suppress(OSError):
                    os.remove(maddr.removeprefix("/unix"))
            raise
        finally:
            _LAUNCHED.reset(token)
        if (started := _STARTED.get()) is not None:
            started.append(p2p)
        return p2p

    create_or_clean_up.removes_failed_sockets = True  # type: ignore[attr-defined]
    return classmethod(create_or_clean_up)


def _ending_failed_daemons(create: Any) -> Any:
    """hivemind's DHTNode.create, which also shuts down the daemon it started when the node fails to start (its
    bootstrap peers did not answer its pings: a private swarm's refuse a node without the key). hivemind leaves that
    daemon running until something kills it, and its sockets in /tmp."""

    @functools.wraps(create.__func__)
    async def create_or_end(cls: type[DHTNode], *args: Any, **kwargs: Any) -> DHTNode:
        started: list[P2P] = []
        token = _STARTED.set(started)
        try:
            return await create.__func__(cls, *args, **kwargs)
        except BaseException:
            for p2p in started:
                with contextlib.suppress(Exception):
                    await p2p.shutdown()
            raise
        finally:
            _STARTED.reset(token)

    create_or_end.ends_failed_daemons = True  # type: ignore[attr-defined]
    return classmethod(create_or_end)


if not getattr(P2P._make_process_args, "static_relays_only", False):
    P2P._make_process_args = staticmethod(_static_relays_only(P2P._make_process_args))
if not getattr(P2P.create, "removes_failed_sockets", False):
    P2P.create = _removing_failed_sockets(P2P.create)
if not getattr(DHTNode.create, "ends_failed_daemons", False):
    DHTNode.create = _ending_failed_daemons(DHTNode.create)


def start_dht(
    initial_peers: Sequence[str] = (),
    host: str = "127.0.0.1",
    port: int = 0,
    client_mode: bool = False,
    identity_path: str | None = None,
    identity: Identity | None = None,
    swarm_name: str | None = None,
    wait_timeout: float = DHT_WAIT_TIMEOUT_S,
    swarm_key: SwarmKey | None = None,
    relay: str = "use",
) -> hivemind.DHT:
    """Blocking (about a second): call it before the event loop starts, or in an executor. `identity` signs this
    node's records (a fresh one if None: the node still validates everyone else's). `swarm_name`: also refuse
    malformed records under that swarm's stage keys (dht/records.py). `identity_path`: libp2p's key. `wait_timeout`:
    how long the node waits for another node's answer (hivemind's). `swarm_key`: a private swarm's; the node then
    talks only to nodes that hold it (swarm/protocol/access.py). `relay` (libp2p circuit relays, RELAY_MODES): "use"
    dials peers behind NAT through relays; "reserve" also finds a relay to be reached through when we are behind NAT
    (servers); "no-listen" accepts no inbound connection at all, reachable through relays only (how tests emulate a
    home router); "serve" says this node is publicly reachable, so that it relays for others at once (a bootstrap
    node on a public machine: libp2p relays only for a node it finds public). A node behind NAT reserves a slot on
    its bootstrap peers (the daemon's static relays) once libp2p's AutoNAT finds it private: about 40 s behind a
    masquerading router (tests/netns.py), at once with "no-listen"."""
    if relay not in RELAY_MODES:
        raise ValueError(f"relay mode {relay!r} is not one of {RELAY_MODES}")
    # hivemind selects torch's "file_system" sharing at import, which starts a torch_shm_manager daemon per process
    # that escapes our process groups and outlives us by tens of seconds; we share no tensors between processes.
    torch.multiprocessing.set_sharing_strategy("file_descriptor")
    ensure_reaper()  # hivemind's child and its p2pd die with us, even if we are killed (dht/reaper.py)
    identity = identity or Identity()

    def node() -> hivemind.DHT:
        return hivemind.DHT(
            initial_peers=list(initial_peers),
            host_maddrs=[] if relay == "no-listen" else listen_multiaddrs(host, port),
            no_listen=relay == "no-listen",
            use_auto_relay=relay != "use",
            # reserve on our bootstrap peers at once (see _static_relays_only); a node with no peer relays for nobody
            trusted_relays=list(initial_peers) if relay in ("reserve", "no-listen") and initial_peers else None,
            # libp2p reserves a relay slot only once it knows the node private; with no address, AutoNAT never finds out
            force_reachability={"serve": "public", "no-listen": "private"}.get(relay),
            client_mode=client_mode,
            identity_path=identity_path,
            record_validators=[identity.validator, *([StageRecordValidator(swarm_name)] if swarm_name else [])],
            authorizer=None if swarm_key is None else SwarmKeyAuthorizer(swarm_key, identity.private_key),
            start=False,
            wait_timeout=wait_timeout,
        )

    hung = unanswered = relay_checks = 0
    while True:
        dht = node()
        with forking():  # the child must not finalize our gRPC objects (dht/forking.py)
            dht.run_in_background(await_ready=False)
        try:
            dht.wait_until_ready(START_TIMEOUT_S)
            if relay != "serve":
                return dht
            relay_checks += 1
            if (reason := check_relay([str(m) for m in dht.get_visible_maddrs()])) is None:
                return dht
            if relay_checks == RELAY_ATTEMPTS:
                logger.warning(
                    "our relay fails its check %d times (%s): calls of more than about 100 KiB to servers behind "
                    "NAT that reserve here may fail. Serving anyway; see dht/relay.py",
                    relay_checks,
                    reason,
                )
                return dht
            logger.warning("our relay failed its check (%s): starting the DHT node again", reason)
            _end(dht)
            time.sleep(1.0)  # the daemon's port free again, for a node started on a fixed one
        # a child forked from a process with threads can hang before it is ready (the likeliest cause of a CI hang)
        except concurrent.futures.TimeoutError:
            _end(dht)
            hung += 1
            logger.warning("the DHT node did not start within %.0fs (attempt %d)", START_TIMEOUT_S, hung)
            if hung == START_ATTEMPTS:
                raise RuntimeError(
                    f"the DHT node did not start within {START_TIMEOUT_S:.0f}s, {START_ATTEMPTS} times"
                ) from None
        except Exception as e:  # hivemind's "bootstrap failed: none of the initial_peers responded"
            _end(dht)
            if "bootstrap" not in str(e):
                raise
            unanswered += 1
            if unanswered == len(BOOTSTRAP_PAUSES_S) + 1:
                ours = f"this peer's key is swarm {swarm_key.swarm_id}" if swarm_key else "this peer has no --swarm-key"
                raise RuntimeError(
                    f"no DHT peer of --initial-peers answered, {unanswered} times. Check the addresses; a private "
                    f"swarm answers only peers with its key ({ours})"
                ) from None
            # a bootstrap node that is starting, loaded, or slow to accept a node that cannot be dialled back (one
            # behind NAT: --dht-no-listen): seen to fail one start of two in a row, and answer the next
            pause = BOOTSTRAP_PAUSES_S[unanswered - 1]
            logger.warning(
                "no DHT peer of --initial-peers answered (attempt %d); asking again in %.0fs", unanswered, pause
            )
            time.sleep(pause)


def _end(dht: hivemind.DHT) -> None:
    """A DHT child that failed to start: ask it to stop, then kill it (and let the reaper take its p2pd)."""
    dht.shutdown()
    if dht.is_alive():
        dht.kill()
        dht.join(5)


async def _ping(p2p_id: str, _dht, node) -> None:
    """In the DHT's process (`introduce`): hivemind's ping, which adds us to the other node's routing table."""
    await node.protocol.call_ping(PeerID.from_base58(p2p_id))


class SwarmDHT:
    def __init__(
        self,
        dht: hivemind.DHT,
        swarm_name: str,
        identity: Identity,
        config: dict[str, Any] | None = None,
        timeout: float = 10.0,
        swarm_key: SwarmKey | None = None,
    ):
        """`identity` must be the one `dht` was started with (its validator signs our records). `config`: the
        settings peers must share (dht/records.py `settings`); we announce them, and discovery skips servers whose
        records disagree on any of them, saying which. `swarm_key`: the one `dht` was started with (private swarms)."""
        self.dht, self.swarm_name, self.identity, self.timeout = dht, swarm_name, identity, timeout
        self.swarm_key = swarm_key
        self.config = config or {}
        self._reported: set[tuple[str, str]] = set()  # (peer, differences) already logged
        self._p2p: P2P | None = None

    @classmethod
    def start(
        cls, swarm_name: str, initial_peers: Sequence[str] = (), config: dict[str, Any] | None = None, **kwargs
    ) -> SwarmDHT:
        """Blocking: a new identity and a DHT node signing with it (`kwargs`: those of `start_dht`)."""
        identity = Identity()
        dht = start_dht(initial_peers, identity=identity, swarm_name=swarm_name, **kwargs)
        p2p_transport.RELAYS[:] = map(str, initial_peers)  # servers behind NAT hold relay reservations there
        # a trainer's node: nothing but its own calls (and DHT requests, retried) uses its connections to a server
        p2p_transport.REDIAL_RELAYED = bool(kwargs.get("client_mode"))
        return cls(dht, swarm_name, identity, config, swarm_key=kwargs.get("swarm_key"))

    @property
    def peer_id(self) -> str:
        """Our id in the swarm: the fingerprint of our key."""
        return self.identity.peer_id

    @property
    def p2p_id(self) -> str:
        """Our libp2p peer id (hivemind's averagers address peers by it)."""
        return str(self.dht.peer_id)

    async def p2p(self) -> P2P:
        """A handle on our DHT node's libp2p daemon in this process (for handlers and calls of our own); the same one
        on every call."""
        if self._p2p is None:
            future = self.dht.run_coroutine(hivemind.DHT._get_p2p_daemon_listen_maddr, return_future=True)
            self._p2p = await P2P.replicate(await asyncio.wait_for(future, self.timeout))
        return self._p2p

    async def introduce(self, p2p_id: str) -> None:
        """Ping the DHT node of `p2p_id` (a libp2p id) so that it knows us: in a private swarm our ping proves the swarm
        key, which lets its averager serve us its state before our record is listed (a joiner)."""
        future = self.dht.run_coroutine(functools.partial(_ping, p2p_id), return_future=True)
        await asyncio.wait_for(future, self.timeout)

    async def close_p2p(self) -> None:
        """Stop our handlers and remove the handle's unix socket (the daemon is the DHT's: `shutdown` ends it)."""
        if self._p2p is not None:
            await self._p2p.shutdown()
            self._p2p = None

    async def announce(self, record: ServerRecord, ttl: float) -> bool:
        record = dataclasses.replace(record, p2p_id=self.p2p_id, config=self.config)
        future = self.dht.store(
            stage_key(self.swarm_name, record.stage),
            record.to_dict(),
            get_dht_time() + ttl,
            subkey=self.identity.owner_subkey,
            return_future=True,
            # done once one replica has it (the rest go on in the background): a replica that stopped answering (a
            # frozen peer's DHT node) would otherwise hold every announce for hivemind's wait_timeout or more,
            # until healthy servers' records lapsed in trainers' views
            await_all_replicas=False,
        )
        return bool(await asyncio.wait_for(future, self.timeout))

    async def withdraw(self, record: ServerRecord, ttl: float) -> bool:
        """Replace our record with a tombstone that outlives it, so readers drop us at once rather than at expiry."""
        tombstone = ServerRecord(host=record.host, port=record.port, stage=record.stage, online=False)
        return await self.announce(tombstone, ttl)

    async def discover(self, stage: int, include_pending: bool = False) -> list[PeerEntry]:
        """Live, valid, online servers of `stage`; malformed or foreign records are skipped. Servers still downloading
        the stage's state (`ready=False`) only with `include_pending`: the rebalancer counts them, nobody calls them."""
        return await self.lookup(stage, include_pending) or []

    async def lookup(self, stage: int, include_pending: bool = False) -> list[PeerEntry] | None:
        """`discover`, or None if the DHT returned nothing for the stage: no server ever announced it, or no node
        holding its records answered in time (seen while a peer's DHT node was frozen). A reader that knows the
        stage's servers should keep them, until their records' own expirations, rather than take this for empty."""
        future = self.dht.get(stage_key(self.swarm_name, stage), latest=True, return_future=True)
        found = await asyncio.wait_for(future, self.timeout)
        if found is None or not isinstance(found.value, dict):
            return None
        now, entries = get_dht_time(), []
        for owner, record, expiration in signed_records(found.value):
            if record.stage != stage:
                logger.debug(
                    "skipping a record of %s for stage %d under stage %d", fingerprint(owner), record.stage, stage
                )
                continue
            if differ := differences(self.config, record.config):
                self._report(fingerprint(owner), stage, "; ".join(differ))
                continue
            if record.online and expiration > now and (record.ready or include_pending):
                entries.append(PeerEntry(fingerprint(owner), record, expiration, owner))
                pin(record.address, record.tls_cert)  # our channels to it trust what its signed record says
        return entries

    def _report(self, peer_id: str, stage: int, differ: str) -> None:
        if (peer_id, differ) not in self._reported:
            if len(self._reported) >= 1024:  # many keys that differ: say it again rather than remember them all
                self._reported.clear()
            self._reported.add((peer_id, differ))
            logger.warning("ignoring server %s of stage %d: its settings differ from ours: %s", peer_id, stage, differ)

    def shutdown(self) -> None:
        if self.dht.is_alive():
            self.dht.shutdown()
