"""Hostile soak: a local swarm (2 stages x 2 servers, two honest trainers) trains while strangers with valid keys of
their own attack it in a loop: a Sybil per stage (a signed record at an address nobody serves claiming 10^6
samples/s; admissions signed 1000 epochs ahead; signed Progress telling its stage to end the epoch, from an epoch on,
with 10^6 samples) and a hostile trainer (Forwards it never completes, zero and tiny gradients, replayed Backwards,
a second microbatch under a spent admission, a burst of 50 unsigned 1 MiB Backwards now and then). Honest samples/s
is measured in windows with the attackers, each between two without them. Reports the ratio (target >=
0.9), honest microbatches lost (must be 0), each attack's statuses, the largest epoch step any server made in one
poll and the spread of epochs across servers (no jump), the samples behind each stage's steps (exact global batches),
and whether the peers of each stage end bitwise equal. Not part of CI: it runs for minutes.

    python -m tests.benchmarks.soak_hostile                 # 5 minutes of attacks, in 30 s windows between quiet ones
    python -m tests.benchmarks.soak_hostile --minutes 1 --period 20
"""

from __future__ import annotations

import asyncio
import collections
import os
import shlex
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import torch

from dht.node import SwarmDHT
from dht.records import ServerRecord
from server.collab.tickets import ticket_bytes
from swarm.compression import CompressionPolicy, get_codec
from swarm.config import model_config
from swarm.protocol import wire_pb2 as pb
from swarm.protocol.frames import iter_frames
from swarm.protocol.rpc import CHANNEL_OPTIONS, PROTOCOL_VERSION, SERVICE, StageStub
from swarm.protocol.tensors import WireStats, encode_tensor
from tests.benchmarks import common
from tests.benchmarks.soak import info
from tests.benchmarks.swarmrun import TrainerHandle, cpu_seconds, new_swarm, read_stats, small_corpus, wait_ready
from trainer.client import Admission, StageClient

STAGES, PER_STAGE = 2, 2
D_MODEL, SEQ, B = 64, 64, 4
MODEL = ["--preset", "local_debug", "--n-stages", str(STAGES), "--d-model", str(D_MODEL), "--max-seq-len", str(SEQ)]
CONFIG = model_config("local_debug", n_stages=STAGES, d_model=D_MODEL, max_seq_len=SEQ)
FLOOD_EVERY_S, FLOOD_CALLS, FLOOD_MB = 60.0, 50, 1


def scrape(port: int) -> dict[str, float]:
    """A server's Prometheus samples by name (labels dropped: the names read here have one sample each)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name.split("{")[0]] = float(value)
    return out


def attacker_cpu(swarm) -> float:
    """CPU seconds used so far by this process (the attackers, and the loop measuring) and the daemons it started
    that are not the swarm's (the Sybils' p2pd): on 2 cores they compete with the honest swarm for the same CPU."""
    groups = {c.proc.pid for c in swarm.children.values()}
    total = sum(os.times()[:2])
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
            rest = text.rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(rest[1]) == os.getpid() and int(rest[2]) not in groups:  # our child, in no swarm process group
            total += (int(rest[11]) + int(rest[12])) / os.sysconf("SC_CLK_TCK")
    return total


def tokens() -> torch.Tensor:
    return torch.randint(0, CONFIG.vocab_size, (B, SEQ))


def frames(meta: pb.CallMeta, tensors: dict[str, torch.Tensor]) -> list[bytes]:
    none = get_codec("none")
    return list(iter_frames(meta, [encode_tensor(name, t, none) for name, t in tensors.items()]))


def meta_of(microbatch_id: str, stage: int, admission: Admission | None = None, **more) -> pb.CallMeta:
    meta = pb.CallMeta(protocol_version=PROTOCOL_VERSION, microbatch_id=microbatch_id, stage=stage, **more)
    if admission is not None:
        meta.global_batch, meta.admitted_at = admission.global_batch, admission.admitted_at
        meta.admitted_by, meta.admission_signature = admission.signer, admission.signature
    return meta


def last_stage(meta: pb.CallMeta) -> list[bytes]:
    return frames(meta, {"inputs": torch.randn(B, SEQ, D_MODEL), "labels": tokens()})


class Attacker:
    """The strangers, on an event loop of their own in a thread. Every attack's outcome is tallied by gRPC status."""

    def __init__(self, swarm_name: str, initial_peers: list[str], stages: dict[int, list[str]]):
        self.swarm_name, self.initial_peers, self.stages = swarm_name, initial_peers, stages
        self.tally: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.stop = threading.Event()
        self.active = threading.Event()  # attacking now (cleared: the strangers wait, their DHT nodes up)
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="attacker", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def join(self) -> None:
        self.stop.set()
        self._thread.join(60)
        if self.error is not None:
            raise RuntimeError("the attacker failed") from self.error

    def _main(self) -> None:
        try:
            asyncio.run(self._run())
        except BaseException as e:  # reported by join
            self.error = e

    async def _outcome(self, kind: str, call) -> None:
        try:
            await call
            self.tally[kind]["OK"] += 1
        except grpc.aio.AioRpcError as e:
            self.tally[kind][e.code().name] += 1
        except TimeoutError:
            self.tally[kind]["timeout"] += 1
        except Exception as e:  # noqa: BLE001  # a reply the client refused (WireError): tallied, not fatal
            self.tally[kind][type(e).__name__] += 1

    async def _raw(self, channel: grpc.aio.Channel, method: str, request: list[bytes], timeout: float = 15.0) -> None:
        rpc = channel.stream_stream(f"/{SERVICE}/{method}")
        async for _ in rpc(iter(request), timeout=timeout):
            pass

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        sybils = [
            await loop.run_in_executor(None, SwarmDHT.start, self.swarm_name, self.initial_peers) for _ in range(STAGES)
        ]
        # the hostile trainer: a connection of its own (channels of one process to one address share one by default)
        options = [*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]
        channels = {a: grpc.aio.insecure_channel(a, options=options) for s in self.stages.values() for a in s}
        client = StageClient(CompressionPolicy(), WireStats(), max_tensor_bytes=1 << 26)
        nobody = common.free_port()
        announced, flooded, i = 0.0, time.monotonic() - FLOOD_EVERY_S / 2, 0  # the first burst after 30 s
        try:
            while not self.stop.is_set():
                if not self.active.is_set():
                    await asyncio.sleep(0.2)
                    continue
                i += 1
                if time.monotonic() - announced > 5:  # records live 12 s here
                    for stage, sybil in enumerate(sybils):
                        record = ServerRecord(host="127.0.0.1", port=nobody, stage=stage, throughput=1e6)
                        await self._outcome("sybil record", sybil.announce(record, 12))
                    announced = time.monotonic()
                first, last = (self.stages[0][i % PER_STAGE], self.stages[STAGES - 1][i % PER_STAGE])
                epoch = (await loop.run_in_executor(None, info, last) or pb.InfoReply()).epoch
                # a Sybil's admission 1000 epochs ahead, at the last stage
                lie = sybils[0].identity.sign(ticket_bytes(f"lie-{i}", B, epoch, epoch + 1000))
                ahead = Admission(epoch, epoch + 1000, sybils[0].peer_id, lie)
                await self._outcome(
                    "admission +1000",
                    self._raw(channels[last], "Backward", last_stage(meta_of(f"lie-{i}", STAGES - 1, ahead))),
                )
                # each Sybil tells its stage to end the epoch, from an epoch on, with 10^6 samples
                for stage, sybil in enumerate(sybils):
                    for address in self.stages[stage]:
                        msg = pb.StageProgress(
                            protocol_version=PROTOCOL_VERSION,
                            stage=stage,
                            public_key=sybil.identity.public_key,
                            peer_id=sybil.peer_id,
                            epoch=epoch + 1,
                            samples=10**6,
                            end_epoch=True,
                        )
                        msg.signature = sybil.identity.sign(msg.SerializeToString())
                        await self._outcome("progress end_epoch", StageStub(channels[address]).progress(msg, timeout=5))
                # walk away: a Forward at stage 0 whose Backward never comes
                walk = frames(meta_of(f"walk-{i}", 0), {"inputs": tokens()})
                await self._outcome("walk away", self._raw(channels[first], "Forward", walk))
                # zero and tiny gradients at stage 0, under admissions of its own
                for kind, scale in (("zero gradient", 0.0), ("tiny gradient", 1e-12)):
                    ids = f"{kind[:4]}-{i}"
                    x = tokens()
                    try:
                        reply = await client.call(first, "Forward", 0, ids, {"inputs": x}, (B, SEQ, D_MODEL), 15)
                    except Exception:  # noqa: BLE001  # refused (its share): tallied as such
                        self.tally[kind]["forward refused"] += 1
                        continue
                    grad = torch.randn(B, SEQ, D_MODEL) * scale
                    call = client.call(
                        first,
                        "Backward",
                        0,
                        ids,
                        {"inputs": x, "grad_outputs": grad},
                        None,
                        15,
                        forward_version=reply.param_version,
                        admission=reply.admission,
                    )
                    await self._outcome(kind, call)
                # at the last stage: a Backward under a real admission, replayed frame for frame, then the same
                # admission with other tensors
                x = tokens()
                try:
                    reply = await client.call(first, "Forward", 0, f"dup-{i}", {"inputs": x}, (B, SEQ, D_MODEL), 15)
                except Exception:  # noqa: BLE001
                    self.tally["replay"]["forward refused"] += 1
                else:
                    request = last_stage(meta_of(f"dup-{i}", STAGES - 1, reply.admission))
                    await self._outcome("first", self._raw(channels[last], "Backward", request))
                    await self._outcome("replay", self._raw(channels[last], "Backward", request))
                    other = last_stage(meta_of(f"dup-{i}", STAGES - 1, reply.admission))
                    await self._outcome("duplicate id", self._raw(channels[last], "Backward", other))
                if time.monotonic() - flooded > FLOOD_EVERY_S:
                    flooded = time.monotonic()
                    hidden = torch.randn((FLOOD_MB << 20) // (SEQ * D_MODEL * 4), SEQ, D_MODEL)
                    request = frames(meta_of(f"flood-{i}", STAGES - 1), {"inputs": hidden, "labels": tokens()[:1]})
                    burst = [
                        self._outcome("flood", self._raw(channels[last], "Backward", request, 30))
                        for _ in range(FLOOD_CALLS)
                    ]
                    await asyncio.gather(*burst)
                await asyncio.sleep(0.2)
        finally:
            await client.close()
            for channel in channels.values():
                await channel.close()
            for sybil in sybils:
                sybil.shutdown()


def main() -> None:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=5.0, help="how long the attackers run")
    p.add_argument("--period", type=float, default=30.0, help="seconds of each window, with and without them")
    p.add_argument("--samples-per-step", type=int, default=32)
    p.add_argument("--server-flags", default="", help="more swarm-server flags, e.g. '--lookahead-samples 32'")
    args = p.parse_args()
    common.exit_on_sigterm()
    names = [f"server-s{s}-r{r}" for s in range(STAGES) for r in range(PER_STAGE)]
    ports = {name: common.free_port() for name in names}
    metrics = {name: common.free_port() for name in names}
    addresses = {name: f"127.0.0.1:{port}" for name, port in ports.items()}
    with new_swarm(args.out, "hostile") as swarm:
        swarm.model_args = MODEL
        swarm.start_dht()
        for name in names:
            flags = ["--port", str(ports[name]), "--metrics-port", str(metrics[name])]
            flags += ["--samples-per-step", str(args.samples_per_step), "--no-check-reachability", "--no-rebalance"]
            swarm.start_server(name, int(name.split("-s")[1][0]), [*flags, *shlex.split(args.server_flags)])
        wait_ready(swarm, addresses, timeout=180)
        ready_at = time.monotonic()
        corpus = small_corpus(swarm.log_dir / "corpus.bin")
        trainer_flags = ["--batch-size", str(B), "--in-flight", "4", "--min-request-timeout", "5", "--data", corpus]
        trainers = [TrainerHandle(swarm, f"trainer-{t}", [*trainer_flags, "--data-seed", str(t)]) for t in range(2)]
        for trainer in trainers:
            trainer.snapshot(min_steps=20)
        common.log("both honest trainers trained 20 microbatches")

        epochs_seen: dict[str, tuple[int, float]] = {}  # server -> (its epoch, when read)
        largest_jump, jump_s, widest_spread = 0, 0.0, 0

        def poll() -> None:
            nonlocal largest_jump, jump_s, widest_spread
            now = {n: r.epoch for n in names if (r := info(addresses[n])) is not None}
            for n, e in now.items():
                seen, when = epochs_seen.get(n, (e, time.monotonic()))
                if e - seen > largest_jump:
                    largest_jump, jump_s = e - seen, time.monotonic() - when
                epochs_seen[n] = e, time.monotonic()
            if now:
                widest_spread = max(widest_spread, max(now.values()) - min(now.values()))

        def window(tag: str, seconds: float, during=None) -> dict:
            first = [read_stats(t.path) or {} for t in trainers]
            cpu, swarm_cpu, wall = attacker_cpu(swarm), cpu_seconds(swarm), time.monotonic()
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                poll()
                if during is not None:
                    during()
                time.sleep(1.0)
            last = [t.snapshot() for t in trainers]
            rate = sum(
                (b["samples"] - a["samples"]) / (b["elapsed_s"] - a["elapsed_s"])
                for a, b in zip(first, last, strict=True)
            )
            lost = sum(b["lost_microbatches"] - a["lost_microbatches"] for a, b in zip(first, last, strict=True))
            retries = sum(b["retries"] - a["retries"] for a, b in zip(first, last, strict=True))
            wall = time.monotonic() - wall
            cores = {
                "attacker": (attacker_cpu(swarm) - cpu) / wall,  # cores busy on average
                "swarm": (cpu_seconds(swarm) - swarm_cpu) / wall,
            }
            common.log(
                f"{tag}: honest {rate:.1f} samples/s, {lost} lost, {retries} retries; cores busy: swarm "
                f"{cores['swarm']:.2f}, attacker and measuring {cores['attacker']:.2f}"
            )
            return {
                "window": tag,
                "samples_per_second": rate,
                "lost": lost,
                "retries": retries,
                "seconds": seconds,
                **{f"{k}_cores": v for k, v in cores.items()},
            }

        stages = {s: [addresses[n] for n in names if n.startswith(f"server-s{s}-")] for s in range(STAGES)}
        attacker = Attacker(swarm.swarm_name, swarm.initial_peers, stages)
        attacker.start()
        last_log = [time.monotonic()]

        def progress() -> None:
            if time.monotonic() - last_log[0] > 30:
                last_log[0] = time.monotonic()
                common.log("attacks so far: " + "; ".join(f"{k} {dict(v)}" for k, v in attacker.tally.items()))
            if attacker.error is not None:
                raise RuntimeError("the attacker failed") from attacker.error

        # windows without and with the attackers, alternating (the machine's own drift cancels out), quiet first
        # and last; the quiet ones begin a few seconds after the attackers pause
        windows = [window("quiet", args.period)]
        for _ in range(max(1, round(args.minutes * 60 / args.period))):
            attacker.active.set()
            windows.append(window("attacked", args.period, progress))
            attacker.active.clear()
            time.sleep(5.0)
            windows.append(window("quiet", args.period))
        attacker.join()
        for trainer in trainers:
            trainer.stop()
        time.sleep(15)  # the last epoch ends everywhere (admission timeout, rounds) before the digests are read
        replies = {n: info(addresses[n], digest=True) for n in names}
        scraped = {n: scrape(metrics[n]) for n in names}
        total_s = time.monotonic() - ready_at
        rows, equal = [], all(r is not None for r in replies.values())
        for stage in range(STAGES):
            serving = [n for n in names if n.startswith(f"server-s{stage}-") and replies[n] is not None]
            equal &= len({replies[n].state_digest for n in serving}) == 1
            step_samples = sum(scraped[n].get("swarm_server_step_samples_total", 0) for n in serving)
            epoch = max(replies[n].epoch for n in serving)
            for n in serving:
                r = replies[n]
                rows.append(
                    [
                        stage,
                        n,
                        r.epoch,
                        r.rounds_ok,
                        r.rounds_failed,
                        r.state_downloads,
                        r.gradients_rejected,
                        int(scraped[n].get("swarm_server_largest_step_samples", 0)),
                        f"{step_samples / max(epoch, 1):.2f}",
                        r.state_digest[:12],
                    ]
                )
        quiet = [w["samples_per_second"] for w in windows if w["window"] == "quiet"]
        attacked = [w["samples_per_second"] for w in windows if w["window"] == "attacked"]
        baseline = sum(quiet) / len(quiet)
        ratio = sum(attacked) / len(attacked) / baseline
        # each attacked window against the mean of the quiet ones either side of it
        paired = [a / ((quiet[k] + quiet[k + 1]) / 2) for k, a in enumerate(attacked)]
        common.table(
            "honest trainers",
            ["window", "s", "samples/s", "vs without attackers", "lost", "retries", "swarm cores", "attacker cores"],
            [
                [
                    w["window"],
                    f"{w['seconds']:.0f}",
                    f"{w['samples_per_second']:.1f}",
                    f"{w['samples_per_second'] / baseline:.2f}",
                    w["lost"],
                    w["retries"],
                    f"{w['swarm_cores']:.2f}",
                    f"{w['attacker_cores']:.2f}",
                ]
                for w in windows
            ],
        )
        common.table(
            "attacks",
            ["attack", "statuses"],
            [[kind, " ".join(f"{s}:{n}" for s, n in sorted(v.items()))] for kind, v in attacker.tally.items()],
        )
        common.table(
            "servers at the end",
            [
                "stage",
                "server",
                "epoch",
                "rounds ok",
                "failed",
                "downloads",
                "grads refused",
                "largest share",
                "stage samples per epoch",
                "digest",
            ],
            rows,
        )
        lost = sum(w["lost"] for w in windows)
        print(
            f"honest samples/s under attack {ratio:.2f} x without (target >= 0.9; window by window against the quiet "
            f"ones beside it: worst {min(paired):.2f}, best {max(paired):.2f}); honest microbatches lost {lost}; "
            f"largest epoch step between two polls {largest_jump} in {jump_s:.1f} s "
            f"({sum(r[2] for r in rows) / len(rows) / total_s:.1f} epochs/s on average), widest spread of epochs {widest_spread}; "
            f"--samples-per-step {args.samples_per_step} {args.server_flags}; peers of each stage bitwise equal: {equal}"
        )
        common.write_json(
            args.out,
            "soak_hostile",
            {
                "hardware": common.hardware(),
                "windows": windows,
                "ratio": ratio,
                "paired": paired,
                "attacks": {k: dict(v) for k, v in attacker.tally.items()},
                "servers": rows,
                "largest_jump": largest_jump,
                "jump_s": jump_s,
                "widest_spread": widest_spread,
                "equal": equal,
            },
        )


if __name__ == "__main__":
    main()
