"""`swarm-monitor`: a live web page of a swarm. Joins the DHT as a client, reads every stage's records and asks each
listed server for its `Info` every few seconds; serves one page (the stage map, loss and samples/s over time, bytes
per traffic class against fp32, rebalancing moves and failures) and the same data as JSON at `/api/state`.

Everything shown comes from other peers and is checked first: records through the DHT's validators and
`ServerRecord.from_dict`, `Info` replies by `_checked_info` (numbers finite and in range, strings bounded). The page
puts peer-supplied strings into the document as text, never as markup. The charting library is plotly's, served from
the installed Python package: the page fetches nothing from elsewhere.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import math
import signal
import time
from collections import deque
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import grpc
import uvloop
from aiohttp import web

from dht.node import SwarmDHT
from dht.records import PeerEntry
from swarm.cli import add_config_args, add_config_file_arg, config_from_args, parse_args
from swarm.net import SWARM_KEY_HELP
from swarm.protocol import access
from swarm.protocol import wire_pb2 as pb
from swarm.protocol.rpc import PROTOCOL_VERSION, Channels

logger = logging.getLogger("swarm.monitor")

MAX_STAGES = 256  # a record claiming more is not believed
MAX_PEERS_PER_STAGE = 256  # more are left off the page (and said so)
MAX_TEXT = 200  # peer-supplied strings are cut to this
MAX_ROLES = 16  # traffic classes taken from one Info reply
MAX_KNOWN_PEERS = 4096  # peers whose byte counters are remembered after they leave


@dataclass(kw_only=True)
class MonitorConfig:
    swarm_name: str = field(default="swarm", metadata={"help": "DHT namespace shared by the swarm's peers"})
    initial_peers: list[str] = field(default_factory=list, metadata={"help": "multiaddrs of any DHT peer"})
    host: str = field(default="127.0.0.1", metadata={"help": "address of the web page (0.0.0.0: reachable by all)"})
    port: int = field(default=8808, metadata={"help": "port of the web page (0: any free port)"})
    refresh: float = field(default=2.0, metadata={"help": "seconds between polls of the swarm"})
    history: int = field(default=1800, metadata={"help": "points kept per chart (oldest dropped first)"})
    info_timeout: float = field(default=2.0, metadata={"help": "seconds a server has to answer Info"})
    url_file: str | None = field(default=None, metadata={"help": "write the page's URL here once it serves"})
    swarm_key: str | None = field(default=None, metadata={"help": SWARM_KEY_HELP})

    def __post_init__(self) -> None:
        if self.refresh <= 0 or self.info_timeout <= 0 or self.history < 2:
            raise ValueError("--refresh and --info-timeout must be > 0, --history >= 2")
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")


@dataclass
class PeerView:
    """One server as the page shows it."""

    peer_id: str
    stage: int
    address: str
    status: str  # serving | joining | no answer
    throughput: float
    demand: float
    queue: int
    version: int
    epoch: int | None = None
    loss: float | None = None
    samples: int | None = None
    transport: str = ""
    compression: str = ""
    rounds_ok: int = 0
    rounds_failed: int = 0
    moves: int = 0
    state_downloads: int = 0
    traffic: dict[str, tuple[int, int]] = field(default_factory=dict)  # role -> (wire, fp32) bytes


def _text(value: str) -> str:
    return value[:MAX_TEXT]


def _count(value: int) -> int:
    if not 0 <= value < 2**62:
        raise ValueError(f"count {value} out of range")
    return int(value)


def _rate(value: float) -> float:
    if not (math.isfinite(value) and 0 <= value < 1e12):
        raise ValueError(f"rate {value} out of range")
    return float(value)


def _checked_info(reply: pb.InfoReply, stage: int) -> dict[str, Any]:
    """The fields of a server's Info the page uses; ValueError if any is malformed, out of range or for another
    stage (the peer is then shown as not answering)."""
    if reply.protocol_version != PROTOCOL_VERSION:
        raise ValueError(f"protocol {reply.protocol_version}, ours {PROTOCOL_VERSION}")
    if reply.stage != stage:
        raise ValueError(f"serves stage {reply.stage}, listed under {stage}")
    loss = reply.recent_loss
    if not math.isnan(loss) and not (math.isfinite(loss) and 0 <= loss < 1e6):
        raise ValueError(f"loss {loss} out of range")
    if len(reply.traffic) > MAX_ROLES:
        raise ValueError(f"{len(reply.traffic)} traffic classes")
    return dict(
        epoch=_count(reply.epoch),
        version=_count(reply.param_version),
        queue=_count(reply.queue_length),
        throughput=_rate(reply.throughput),
        loss=None if math.isnan(loss) else float(loss),
        samples=_count(reply.samples_processed),
        transport=_text(reply.transport),
        compression=_text(reply.compression),
        rounds_ok=_count(reply.rounds_ok),
        rounds_failed=_count(reply.rounds_failed),
        moves=_count(reply.moves),
        state_downloads=_count(reply.state_downloads),
        traffic={
            **{
                t.role[:40]: (_count(t.wire_bytes), _count(t.fp32_bytes))
                for t in reply.traffic
                if t.role.isidentifier()
            },
            "allreduce_gradients": (_count(reply.allreduce_bytes), _count(reply.allreduce_fp32_bytes)),
        },
    )


def peer_view(entry: PeerEntry, info: pb.InfoReply | None) -> PeerView:
    """A DHT entry and its server's Info (None: no answer, or a pending record)."""
    r = entry.record
    view = PeerView(
        peer_id=entry.peer_id,
        stage=r.stage,
        address=_text(r.address),
        status="serving" if r.ready else "joining",
        throughput=r.throughput,
        demand=r.demand,
        queue=r.queue_length,
        version=r.param_version,
    )
    if not r.ready:
        return view
    try:
        checked = _checked_info(info, r.stage) if info is not None else None
    except ValueError as e:
        logger.debug("Info of %s refused: %s", entry.peer_id[-8:], e)
        checked = None
    if checked is None:
        view.status = "no answer"
        return view
    return dataclasses.replace(view, **checked)


class SwarmView:
    """What the page shows, from a series of polls. Pure: `update` takes a poll's peers and its time.

    History: the swarm's loss (mean over the last stage's serving peers) and samples/s (the samples the last stage's
    peers computed since the previous poll, over its duration; a peer counts from its second poll). Bytes per traffic
    class: summed over every peer ever seen, its last report (a peer that left keeps its share). Events: joins,
    departures, moves, peers that stop answering, failed all-reduce rounds."""

    def __init__(self, history: int):
        self.n_stages = 0
        self.peers: list[PeerView] = []
        self.updated = 0.0
        self.history: dict[str, deque] = {k: deque(maxlen=history) for k in ("t", "loss", "samples_per_s")}
        self.events: deque[dict] = deque(maxlen=200)
        self.traffic: dict[str, dict[str, tuple[int, int]]] = {}  # peer -> its last report
        self.started: float | None = None
        self._last: dict[str, PeerView] = {}
        self._last_time: float | None = None

    def update(self, now: float, n_stages: int, peers: list[PeerView]) -> None:
        if self.started is None:
            self.started = now
        self._events(now, peers)
        last_stage = [p for p in peers if p.stage == n_stages - 1 and p.status == "serving"]
        losses = [p.loss for p in last_stage if p.loss is not None]
        done = sum(
            max(0, p.samples - (self._last[p.peer_id].samples or 0))
            for p in last_stage
            if p.samples is not None and p.peer_id in self._last and self._last[p.peer_id].stage == p.stage
        )
        if self._last_time is not None:
            self.history["t"].append(round(now - self.started, 2))
            self.history["loss"].append(sum(losses) / len(losses) if losses else None)
            self.history["samples_per_s"].append(done / (now - self._last_time))
        for p in peers:
            if p.traffic and (p.peer_id in self.traffic or len(self.traffic) < MAX_KNOWN_PEERS):
                self.traffic[p.peer_id] = p.traffic
        self.n_stages, self.peers, self.updated = n_stages, peers, now
        self._last, self._last_time = {p.peer_id: p for p in peers}, now

    def _events(self, now: float, peers: list[PeerView]) -> None:
        def say(kind: str, text: str) -> None:
            self.events.append({"t": round(now - (self.started or now), 2), "kind": kind, "text": text})

        current = {p.peer_id: p for p in peers}
        for peer_id, p in current.items():
            before = self._last.get(peer_id)
            name = f"{peer_id[-8:]} ({p.address})"
            if before is None:
                say("joined", f"{name} joined stage {p.stage}" + (" (downloading its state)" * (p.status != "serving")))
            elif before.stage != p.stage:
                say("moved", f"{name} moved from stage {before.stage} to stage {p.stage}")
            elif p.status == "no answer" and before.status != "no answer":
                say("unreachable", f"{name} of stage {p.stage} does not answer")
            elif p.rounds_failed > before.rounds_failed:
                n = p.rounds_failed - before.rounds_failed
                say("failed", f"{name}: {n} all-reduce round(s) of stage {p.stage} failed")
        for peer_id, before in self._last.items():
            if peer_id not in current:
                say("left", f"{peer_id[-8:]} ({before.address}) left stage {before.stage}")

    def state(self) -> dict[str, Any]:
        """The JSON the page polls."""
        traffic: dict[str, dict[str, int]] = {}
        for by_role in self.traffic.values():
            for role, (wire, fp32) in by_role.items():
                total = traffic.setdefault(role, {"wire": 0, "fp32": 0})
                total["wire"] += wire
                total["fp32"] += fp32
        stages = []
        for i in range(self.n_stages):
            peers = sorted((p for p in self.peers if p.stage == i), key=lambda p: p.peer_id)
            rows = [{k: v for k, v in dataclasses.asdict(p).items() if k != "traffic"} for p in peers]
            stages.append({"stage": i, "throughput": sum(p.throughput for p in peers), "peers": rows})
        return {
            "updated": self.updated,
            "n_stages": self.n_stages,
            "stages": stages,
            "history": {k: list(v) for k, v in self.history.items()},
            "traffic": traffic,
            "events": list(self.events)[::-1],
        }


class Monitor:
    """Polls the swarm (event loop); `view` holds what it saw."""

    def __init__(self, cfg: MonitorConfig, sdht: SwarmDHT):
        self.cfg, self.sdht = cfg, sdht
        self.view = SwarmView(cfg.history)
        self._channels = Channels(sdht.p2p)

    async def poll_forever(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            started = time.monotonic()
            try:
                await self.poll()
            except Exception as e:  # the DHT may be briefly unreachable: show the last state, try again
                logger.warning("poll failed: %r", e)
            remaining = self.cfg.refresh - (time.monotonic() - started)
            try:
                await asyncio.wait_for(stop.wait(), max(remaining, 0.05))
            except TimeoutError:
                pass

    async def poll(self) -> None:
        n_stages = await self._n_stages()
        entries: list[PeerEntry] = []
        for stage in range(n_stages):
            found = await self.sdht.discover(stage, include_pending=True)
            if len(found) > MAX_PEERS_PER_STAGE:
                logger.warning("stage %d lists %d peers; showing %d", stage, len(found), MAX_PEERS_PER_STAGE)
            entries += sorted(found, key=lambda e: e.peer_id)[:MAX_PEERS_PER_STAGE]
        infos = await asyncio.gather(*(self._info(e) for e in entries))
        peers = [peer_view(e, info) for e, info in zip(entries, infos, strict=True)]
        self.view.update(time.monotonic(), n_stages, peers)
        for address in self._channels.addresses() - {e.record.address for e in entries}:
            self._channels.drop(address)

    async def _n_stages(self) -> int:
        """From the model settings in stage 0's records (what the servers announce), else as last seen."""
        for entry in await self.sdht.discover(0, include_pending=True):
            n = entry.record.config.get("model.n_stages")
            if isinstance(n, int) and 1 <= n <= MAX_STAGES:
                return n
        return max(self.view.n_stages, 1)

    async def _info(self, entry: PeerEntry) -> pb.InfoReply | None:
        if not entry.record.ready:
            return None
        address = entry.record.address
        try:
            return await self._channels.stub(address).info(pb.InfoRequest(), timeout=self.cfg.info_timeout)
        except grpc.aio.AioRpcError as e:
            logger.debug("Info of %s failed: %s", address, e.code())
            return None

    async def close(self) -> None:
        await self._channels.close()


def build_app(monitor: Monitor) -> web.Application:
    page = resources.files("tools").joinpath("monitor.html").read_text()
    script = resources.files("tools").joinpath("monitor.js").read_text()
    plotly_js = resources.files("plotly").joinpath("package_data", "plotly.min.js").read_bytes()
    headers = {"Content-Security-Policy": "default-src 'self'; img-src 'self' data:; style-src 'self' 'unsafe-inline'"}

    async def index(request: web.Request) -> web.Response:
        return web.Response(text=page, content_type="text/html", headers=headers)

    async def monitor_js(request: web.Request) -> web.Response:
        return web.Response(text=script, content_type="application/javascript")

    async def plotly(request: web.Request) -> web.Response:
        return web.Response(body=plotly_js, content_type="application/javascript")

    async def state(request: web.Request) -> web.Response:
        return web.json_response(monitor.view.state())

    app = web.Application()
    app.router.add_get("/", index)
    app.router.add_get("/monitor.js", monitor_js)
    app.router.add_get("/plotly.min.js", plotly)
    app.router.add_get("/api/state", state)
    return app


async def serve(cfg: MonitorConfig, sdht: SwarmDHT, stop: asyncio.Event) -> None:
    monitor = Monitor(cfg, sdht)
    runner = web.AppRunner(build_app(monitor), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, cfg.host, cfg.port)
    await site.start()
    port = runner.addresses[0][1]
    url = f"http://{cfg.host}:{port}/"
    logger.info("dashboard at %s (JSON at %sapi/state)", url, url)
    if cfg.url_file:  # whole or not at all: a reader polls for it
        tmp = Path(cfg.url_file + ".tmp")
        tmp.write_text(url)
        tmp.replace(cfg.url_file)
    try:
        await monitor.poll_forever(stop)
    finally:
        await runner.cleanup()
        await monitor.close()


async def _main(cfg: MonitorConfig, sdht: SwarmDHT) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await serve(cfg, sdht, stop)
    finally:
        await sdht.close_p2p()  # opened if a server was reached over libp2p: its unix socket goes with it


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="swarm-monitor", description=__doc__.split("\n\n")[0])
    add_config_args(parser, MonitorConfig)
    add_config_file_arg(parser)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parse_args(parser, argv)
    try:
        cfg = config_from_args(MonitorConfig, args)
        swarm_key = access.load(cfg.swarm_key)
    except ValueError as e:
        parser.error(str(e))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sdht = SwarmDHT.start(cfg.swarm_name, cfg.initial_peers, client_mode=True, swarm_key=swarm_key)
    try:
        uvloop.run(_main(cfg, sdht))
    finally:
        sdht.shutdown()


if __name__ == "__main__":
    main()
