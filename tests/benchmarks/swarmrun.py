"""Live-swarm helpers for the benchmarks: servers on known ports, readiness through the Info RPC, trainers measured over a
window of their own progress snapshots. Every process goes through `tools.processes.LocalSwarm`, whose exit stops every
process group it started; use it as a context manager."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import grpc

from swarm.protocol import wire_pb2 as pb
from swarm.protocol.rpc import StageStub, sync_channel
from tests.benchmarks import common
from tools.processes import LocalSwarm
from trainer.config import TrainerConfig


def info(address: str, timeout: float = 2.0) -> pb.InfoReply:
    with sync_channel(address) as channel:
        return StageStub(channel).info(pb.InfoRequest(), timeout=timeout)


class BusyPoller:
    """Samples each server's queue length (queued + running requests) through Info every `period` seconds in a thread:
    the fraction of samples with work in it tells a starved server (< 1) from a saturated one."""

    def __init__(self, addresses: dict[str, str], period: float = 0.2):
        self.addresses, self.period = addresses, period
        self.busy = {n: 0 for n in addresses}
        self.polls = {n: 0 for n in addresses}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="busy-poller", daemon=True)

    def _run(self) -> None:
        channels = {n: sync_channel(a) for n, a in self.addresses.items()}
        rpcs = {n: StageStub(c).info for n, c in channels.items()}
        try:
            while not self._stop.wait(self.period):
                for n, rpc in rpcs.items():
                    try:
                        self.busy[n] += rpc(pb.InfoRequest(), timeout=1.0).queue_length > 0
                        self.polls[n] += 1
                    except grpc.RpcError:
                        pass
        finally:
            for c in channels.values():
                c.close()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join(5)
        return {n: self.busy[n] / self.polls[n] if self.polls[n] else float("nan") for n in self.addresses}


def wait_ready(swarm: LocalSwarm, servers: dict[str, str], timeout: float = 120.0) -> None:
    """Wait until every server (name -> address) answers Info; raise with its log if one died."""
    pending = dict(servers)
    deadline = time.monotonic() + timeout
    while pending:
        for name, address in list(pending.items()):
            child = swarm.children[name]
            if not child.alive():
                raise RuntimeError(f"{name} exited with {child.proc.returncode}:\n{swarm.tail(child)}")
            try:
                info(address, timeout=1.0)
                del pending[name]
            except grpc.RpcError:
                pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"servers not ready after {timeout:.0f}s: {sorted(pending)}")
        time.sleep(0.3)
    time.sleep(1.0)  # their first DHT announcement follows the gRPC start


def cpu_breakdown(swarm: LocalSwarm) -> dict[str, float]:
    """User + system CPU seconds used so far by every live process in the swarm's process groups (servers, trainers,
    the DHT node, and their hivemind children and p2pd daemons), keyed "child name/command"."""
    groups = {c.proc.pid: name for name, c in swarm.children.items() if c.alive()}
    out: dict[str, float] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
            comm, rest = text[text.index("(") + 1 : text.rindex(")")], text.rsplit(")", 1)[1].split()
        except (OSError, ValueError, IndexError):
            continue
        group = groups.get(int(rest[2])) or groups.get(int(rest[3]))  # process group, or session
        if group is not None:
            key = f"{group}/{comm}"
            out[key] = out.get(key, 0.0) + (int(rest[11]) + int(rest[12])) / os.sysconf("SC_CLK_TCK")
    return out


def cpu_seconds(swarm: LocalSwarm) -> float:
    return sum(cpu_breakdown(swarm).values())


def small_corpus(path: Path, n_bytes: int = 4 << 20) -> str:
    """A few MB of the default corpus in one file: trainers start in a second instead of reading the stdlib."""
    if not path.exists():
        from trainer.data import load_corpus

        path.write_bytes(bytes(load_corpus(max_bytes=n_bytes).numpy()))
    return str(path)


def read_stats(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


class TrainerHandle:
    """A running trainer measured by its own progress snapshots (steps, samples, its clock), written every second."""

    def __init__(self, swarm: LocalSwarm, name: str, args: list[str], timeout: float = 180.0):
        self.swarm, self.name, self.timeout = swarm, name, timeout
        self.path = swarm.log_dir / f"{name}.json"
        self.child = swarm.start_trainer(name, args)

    def snapshot(self, min_steps: int = 0, min_elapsed: float = 0.0) -> dict:
        deadline = time.monotonic() + self.timeout
        while True:
            if not self.child.alive():
                raise RuntimeError(
                    f"{self.name} exited with {self.child.proc.returncode}:\n{self.swarm.tail(self.child)}"
                )
            s = read_stats(self.path)
            if s and s["steps"] >= min_steps and s["elapsed_s"] >= min_elapsed:
                return s
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name}: no progress in {self.timeout:.0f}s:\n{self.swarm.tail(self.child)}")
            time.sleep(0.1)

    def window(self, seconds: float, at_start=None, at_end=None) -> dict:
        """Samples/s over the next `seconds` of the trainer's clock (between two of its snapshots)."""
        first = self.snapshot(min_elapsed=(read_stats(self.path) or {}).get("elapsed_s", 0.0) + 0.5)
        if at_start:
            at_start()
        last = self.snapshot(min_elapsed=first["elapsed_s"] + seconds)
        if at_end:
            at_end()
        span, samples = last["elapsed_s"] - first["elapsed_s"], last["samples"] - first["samples"]
        wire = last["wire_bytes"] - first["wire_bytes"]
        return {
            "samples_per_second": samples / span,
            "samples": samples,
            "seconds": span,
            "wire_bytes_per_sample": wire / samples if samples else None,
            "lost_microbatches": last["lost_microbatches"] - first["lost_microbatches"],
            "retries": last["retries"] - first["retries"],
        }

    def stop(self) -> None:
        self.swarm.stop([self.name], grace=20)


def measure_trainer(
    swarm: LocalSwarm,
    name: str,
    args: list[str],
    window: float,
    warmup_steps: int,
    timeout: float = 180.0,
    between=None,
) -> dict:
    """Start trainer `name`, skip `warmup_steps` microbatches, measure samples/s over `window` seconds of its own clock,
    stop it. `between(tag)`, if given, is called with "start" and "end" around the window (e.g. to read counters)."""
    trainer = TrainerHandle(swarm, name, args, timeout)
    try:
        trainer.snapshot(min_steps=warmup_steps)
        return trainer.window(
            window, (lambda: between("start")) if between else None, (lambda: between("end")) if between else None
        )
    finally:
        trainer.stop()


def trainer_config(swarm_name: str, args, codec: str, corpus: str, **more) -> TrainerConfig:
    """A benchmark's trainer: the benchmark's --batch-size and --in-flight, a codec ("FORWARD/BACKWARD" for one of
    each direction, e.g. "blockwise8/lowrank8"), a corpus file."""
    forward, _, backward = codec.partition("/")
    return TrainerConfig(
        swarm_name=swarm_name,
        batch_size=args.batch_size,
        in_flight=args.in_flight,
        codec=forward,
        backward_codec=backward or None,
        data=corpus,
        **more,
    )


def server_args(port: int, swarm_name: str, extra: list[str] = ()) -> list[str]:
    return ["--port", str(port), "--swarm-name", swarm_name, "--no-rebalance", *extra]  # fixed allocations


def new_swarm(out_dir: str, tag: str) -> LocalSwarm:
    log_dir = Path(out_dir) / "logs" / f"{tag}-{time.strftime('%Y%m%d-%H%M%S')}"
    common.log(f"{tag}: logs in {log_dir}")
    return LocalSwarm(log_dir, swarm_name=tag)
