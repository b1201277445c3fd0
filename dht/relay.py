"""Relays that carry what a stage call sends: the p2p daemon's two relay services, and a check of which one serves.

hivemind's p2pd builds two circuit-relay (v2) services on a relaying node (its `p2pd/main.go` and `daemon.go`):
- the one its flags configure (`-relayDataLimit` 4 GiB and `-relayTimeLimit` 30 min per relayed connection), which
  libp2p starts once the node is known to be public: on `force_reachability="public"`, from a goroutine;
- `EnableRelayV2()`, called from `main` right after the host is built, with libp2p's default resources: **128 KiB
  a direction and 2 minutes per relayed connection**, after which the relay resets the connection and every stream
  on it.
Both register the same protocol, so the one registered last serves. Which one that is was a race: 6 of 8 fresh relay
nodes on this machine capped their connections at 128 KiB (a call through them failed as soon as a connection had
carried 114,744 bytes of 16 KiB echoes, 5 connections in a row), so a server behind NAT could carry small
activations only. With the daemon on one OS thread (`GOMAXPROCS=1`) `main` registers the default service before the
goroutine runs, and the configured one wins: 8 of 8. Measured on the same machine, a relay on one thread carried a
64 MiB echo at 182 MiB/s each way against 156-170 on two.

A relaying node therefore starts its daemon on one thread (dht/node.py), then `check` proves that it carries a
connection past 128 KiB, and starts it again if not (a daemon built otherwise, or a scheduler that breaks the
ordering). A server that callers reach through a relay only checks its relays too (`report`): any other peer's
daemon relays with the default caps.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
from collections.abc import Sequence

from swarm.protocol import p2p as p2p_transport

logger = logging.getLogger(__name__)
DEFAULT_CAP_BYTES = 1 << 17  # libp2p's default relay limit per connection and direction (with 2 minutes)
CHECK_BYTES = 8 * DEFAULT_CAP_BYTES  # what the check sends through a relayed connection each way
CHECK_TIMEOUT_S = 30.0
PROTOCOL = "swarm.v1.RelayCheck"
ONE_THREAD = ("env", "GOMAXPROCS=1")  # the prefix of a relaying node's p2pd command line


COULD_NOT_RUN = "the check could not run"  # how `check` says that it proved nothing either way


def echo_for(caller: object, n_bytes: int):
    """The hidden daemon's stream handler: echoes `n_bytes` to the check's own caller (libp2p id `caller`). Anyone
    can open a stream to it through the relay while the check runs: a stream from another peer, or one that
    declares another length, is closed before anything is read beyond its 8-byte header."""

    async def echo(info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            if str(info.peer_id) == str(caller) and int.from_bytes(await reader.readexactly(8), "big") == n_bytes:
                writer.write(await reader.readexactly(n_bytes))
                await writer.drain()
                await reader.read(1)  # until the caller, having read the echo, closes the stream
        writer.close()

    return echo


async def check(relay_maddrs: Sequence[str], n_bytes: int = CHECK_BYTES) -> str | None:
    """None if a relayed connection through the relay at `relay_maddrs` (its multiaddrs, ending in /p2p/<id>) carries
    `n_bytes` each way; else what went wrong. Starts two throwaway daemons here: one that accepts no connection and
    reserves a slot on the relay, and one that calls it through the relay. About a second on loopback."""
    from hivemind.p2p import P2P

    relays = list(relay_maddrs)
    hidden = caller = None
    try:
        # neither listens anywhere (the hidden one is reached through the relay, the caller only dials), nor asks
        # the router for port mappings
        hidden = await P2P.create(
            initial_peers=relays,
            host_maddrs=[],
            no_listen=True,
            nat_port_map=False,
            use_auto_relay=True,
            trusted_relays=relays,
            force_reachability="private",
        )
        caller = await P2P.create(initial_peers=relays, host_maddrs=[], no_listen=True, nat_port_map=False)
        await hidden.add_binary_stream_handler(PROTOCOL, echo_for(caller.peer_id, n_bytes))
        async with asyncio.timeout(CHECK_TIMEOUT_S):
            while True:  # until the hidden daemon holds its reservation
                try:
                    await caller._client.connect(hidden.peer_id, [p2p_transport.circuit_through(relays[0])])
                    break
                except Exception as e:  # no reservation yet ("NO_RESERVATION"), the relay still starting
                    logger.debug("relay check: not through yet: %r", e)
                    await asyncio.sleep(0.2)
            _, reader, writer = await caller.call_binary_stream_handler(hidden.peer_id, PROTOCOL)
            payload = os.urandom(n_bytes)
            writer.write(n_bytes.to_bytes(8, "big") + payload)
            await writer.drain()
            echoed = await reader.readexactly(n_bytes)
            writer.close()
        return None if echoed == payload else "the echo came back changed"
    except TimeoutError:
        return f"no echo of {n_bytes} bytes through the relay within {CHECK_TIMEOUT_S:.0f}s"
    except (asyncio.IncompleteReadError, ConnectionError) as e:
        return f"the relay reset the connection before {n_bytes} bytes went through each way ({e!r})"
    except Exception as e:  # a daemon that did not start, a relay that refused us: the relay is not proven
        return f"{COULD_NOT_RUN}: {e!r}"
    finally:
        for daemon in (caller, hidden):
            if daemon is not None:
                with contextlib.suppress(Exception):
                    await daemon.shutdown()


async def report(relay_maddrs: Sequence[str]) -> None:
    """A server that callers reach through a relay only: check each of its relays (the bootstrap peers it reserves
    on; the first address of each) and log what a caller going through it can expect."""
    firsts: dict[str, str] = {}
    for maddr in relay_maddrs:
        firsts.setdefault(maddr.rpartition("/p2p/")[2], maddr)
    for maddr in firsts.values():
        reason = await check([maddr])
        if reason is not None and reason.startswith(COULD_NOT_RUN):
            # a throwaway daemon that did not reach the relay in time (seen once in CI, on a loaded 2-core machine:
            # "failed to connect to bootstrap peers") says nothing of the relay: check once more
            await asyncio.sleep(1.0)
            reason = await check([maddr])
        if reason is None:
            logger.info(
                "relay %s carries %g MiB each way on one connection: callers that reach us through it can",
                maddr,
                CHECK_BYTES / (1 << 20),
            )
        else:
            logger.warning(
                "relay %s failed its check (%s): it may cap a relayed connection at 128 KiB and 2 minutes (libp2p's "
                "default relay), and then calls of more than about 100 KiB through it fail. A `swarm-dht --public` "
                "node relays up to 4 GiB and 30 minutes: give one as --initial-peers",
                maddr,
                reason,
            )


def check_blocking(relay_maddrs: Sequence[str]) -> str | None:
    """`check`, from code that may or may not be inside an event loop (start_dht): on a thread of its own."""
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="relay-check") as pool:
        return pool.submit(asyncio.run, check(relay_maddrs)).result()
