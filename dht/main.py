"""`swarm-dht`: a bootstrap node. Prints the multiaddrs that servers and trainers pass as --initial-peers, and answers
starting servers' reachability checks (swarm/protocol/reach.py)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import threading
from pathlib import Path

import hivemind

from dht.node import start_dht
from swarm.cli import add_config_file_arg, parse_args
from swarm.net import SWARM_KEY_HELP, check_ports_free
from swarm.protocol import access
from swarm.protocol.reach import ReachResponder


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="swarm-dht", description=__doc__)
    add_config_file_arg(parser)
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (127.0.0.1 for a local swarm)")
    parser.add_argument("--port", type=int, default=31337, help="TCP port (0: any free port)")
    parser.add_argument("--initial-peers", nargs="*", default=[], help="join an existing DHT instead of starting one")
    parser.add_argument("--identity-path", default=None, help="private key file: keeps the peer id across restarts")
    parser.add_argument("--maddr-file", default=None, help="also write the multiaddrs here, one per line")
    parser.add_argument(
        "--public",
        action="store_true",
        help="this machine is publicly reachable: relay libp2p traffic for servers behind NAT at once (libp2p relays "
        "only for a node it knows to be public; without this flag it finds out from other peers, which takes a while)",
    )
    parser.add_argument(
        "--swarm-name", default="swarm", help="refuse malformed or unsigned server records under this swarm's keys"
    )
    key = parser.add_mutually_exclusive_group()
    key.add_argument("--swarm-key", default=None, help=SWARM_KEY_HELP)
    key.add_argument(
        "--new-swarm-key",
        default=None,
        metavar="FILE",
        help="start a private swarm: write a new key to FILE (never over an existing file) and use it; give FILE to "
        "every server, trainer and monitor of the swarm (--swarm-key FILE)",
    )
    return parser


async def answer_reach_checks(dht: hivemind.DHT, stop: threading.Event, key: access.SwarmKey | None) -> None:
    """On a thread of its own: the node's main thread only waits for a signal."""
    p2p = await dht.replicate_p2p()
    try:
        await ReachResponder(p2p, key).start()
        while not stop.is_set():
            await asyncio.sleep(0.5)
    finally:
        await p2p.shutdown()


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parse_args(parser, argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        check_ports_free(args.host, {"--port": args.port})
        if args.new_swarm_key:
            access.SwarmKey.new().write(args.new_swarm_key)
        swarm_key = access.load(args.new_swarm_key or args.swarm_key)
    except FileExistsError:
        parser.error(f"{args.new_swarm_key} exists: start with --swarm-key {args.new_swarm_key} to use that key")
    except (OSError, ValueError) as e:
        parser.error(str(e))

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    dht = start_dht(
        args.initial_peers,
        host=args.host,
        port=args.port,
        identity_path=args.identity_path,
        swarm_name=args.swarm_name,
        swarm_key=swarm_key,
        relay="serve" if args.public else "use",
    )
    responder = threading.Thread(
        target=asyncio.run, args=(answer_reach_checks(dht, stop, swarm_key),), name="reach", daemon=True
    )
    responder.start()
    try:
        maddrs = [str(m) for m in dht.get_visible_maddrs()]
        if args.maddr_file:
            tmp = Path(args.maddr_file).with_suffix(".tmp")
            tmp.write_text("\n".join(maddrs) + "\n")
            tmp.replace(args.maddr_file)  # readers never see half a file
        print("DHT is running. Start servers and trainers with:", flush=True)
        print("  --initial-peers " + " ".join(maddrs), flush=True)
        if swarm_key is not None:
            print(f"  --swarm-key {args.new_swarm_key or args.swarm_key}   (copy that file to them)", flush=True)
        stop.wait()
    finally:
        stop.set()
        responder.join(timeout=3)  # removes its handle's unix socket
        dht.shutdown()


if __name__ == "__main__":
    main()
