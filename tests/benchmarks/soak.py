"""Kill/freeze soak: a local swarm (3 stages x 2 servers pinned to their stages, one trainer) trains while servers are
SIGKILLed (and restarted on the same port after a while) or SIGSTOPped (and continued) on a seeded schedule, never two
faults on one stage at once. Reports the microbatches lost (must be 0), the longest stall (no microbatch finished) overall and after each
fault, the stage all-reduce rounds that failed, and whether the peers of each stage end bitwise equal (their state
digests, read through Info once training has stopped). Not part of CI: it runs for minutes.

    python -m tests.benchmarks.soak                     # 6 minutes, a fault every 30 s
    python -m tests.benchmarks.soak --minutes 2 --period 20
    python -m tests.benchmarks.soak --faults kill:s1-r0,freeze:s1-r1   # these faults, in this order, then stop
"""

from __future__ import annotations

import random
import shlex
import signal
import time

import grpc

from swarm.protocol import wire_pb2 as pb
from swarm.protocol.rpc import StageStub, sync_channel
from tests.benchmarks import common
from tests.benchmarks.swarmrun import TrainerHandle, new_swarm, read_stats, small_corpus, wait_ready

MODEL = ["--preset", "local_debug", "--n-stages", "3", "--d-model", "64", "--max-seq-len", "64"]
STAGES, PER_STAGE = 3, 2


def info(address: str, digest: bool = False) -> pb.InfoReply | None:
    try:
        with sync_channel(address) as channel:
            return StageStub(channel).info(pb.InfoRequest(with_digest=digest), timeout=5)
    except grpc.RpcError:
        return None


def main() -> None:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=6.0, help="length of the fault schedule")
    p.add_argument("--period", type=float, default=30.0, help="seconds between faults")
    p.add_argument("--freeze-s", type=float, default=20.0, help="how long a frozen server stays stopped")
    p.add_argument("--restart-s", type=float, default=10.0, help="how long a killed server stays dead")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--samples-per-step", type=int, default=16)
    p.add_argument(
        "--faults",
        default="",
        help="a fixed schedule instead of the seeded one: comma-separated kill:sS-rR or freeze:sS-rR, one per period",
    )
    p.add_argument("--server-flags", default="", help="more swarm-server flags, e.g. '--no-fixed-groups'")
    args = p.parse_args()
    common.exit_on_sigterm()
    rng = random.Random(args.seed)
    names = [f"server-s{s}-r{r}" for s in range(STAGES) for r in range(PER_STAGE)]
    schedule = [fault.split(":") for fault in args.faults.split(",") if fault]
    for fault in schedule:
        if len(fault) != 2 or fault[0] not in ("kill", "freeze") or f"server-{fault[1]}" not in names:
            p.error(f"--faults: {':'.join(fault)!r} is not kill:sS-rR or freeze:sS-rR (S < {STAGES}, R < {PER_STAGE})")
    if schedule:
        args.minutes = (len(schedule) + 1) * args.period / 60  # a whole period after the last fault
    ports = {name: common.free_port() for name in names}
    addresses = {name: f"127.0.0.1:{port}" for name, port in ports.items()}
    with new_swarm(args.out, "soak") as swarm:
        swarm.model_args = MODEL
        swarm.start_dht()

        def start(name: str) -> None:
            stage = int(name.split("-s")[1][0])
            flags = ["--port", str(ports[name]), "--samples-per-step", str(args.samples_per_step)]
            more = shlex.split(args.server_flags)
            swarm.start_server(name, stage, [*flags, "--no-check-reachability", "--no-rebalance", *more])

        for name in names:
            start(name)
        wait_ready(swarm, addresses, timeout=180)
        corpus = small_corpus(swarm.log_dir / "corpus.bin")
        trainer = TrainerHandle(
            swarm,
            "trainer-0",
            ["--batch-size", "4", "--in-flight", "4", "--min-request-timeout", "5", "--data", corpus],
        )
        trainer.snapshot(min_steps=20)
        common.log(f"trained 20 microbatches; faults every {args.period:.0f}s for {args.minutes:.1f} min")

        events: list[dict] = []  # what happened, when, and the stall that followed
        pending: list[tuple[float, str, str]] = []  # (when, action, server) still to do: restart or thaw
        down: dict[int, str] = {}  # stage -> its server that is dead or frozen
        started = last_step_at = time.monotonic()
        steps = trainer.snapshot()["steps"]
        longest = 0.0
        next_fault = started + args.period
        while (now := time.monotonic()) - started < args.minutes * 60 or pending:
            stats = read_stats(trainer.path) or {}
            if stats.get("steps", steps) != steps:
                steps, last_step_at = stats["steps"], now
            stall = now - last_step_at
            longest = max(longest, stall)
            if events:
                events[-1]["stall"] = max(events[-1]["stall"], stall)
            for item in [x for x in pending if x[0] <= now]:
                pending.remove(item)
                _, action, name = item
                child = swarm.children[name]
                if action == "thaw":
                    child.signal_group(signal.SIGCONT)
                else:
                    start(name)
                down.pop(int(name.split("-s")[1][0]), None)
                common.log(f"{action} {name}")
            if now >= next_fault and now - started < args.minutes * 60:
                next_fault = now + args.period
                candidates = [n for n in names if int(n.split("-s")[1][0]) not in down]
                if schedule:
                    action, server = schedule.pop(0)
                    candidates = [n for n in candidates if n == f"server-{server}"]
                if candidates:
                    name = rng.choice(candidates)
                    kill = action == "kill" if args.faults else rng.random() < 0.5
                    child = swarm.children[name]
                    if kill:
                        child.signal_group(signal.SIGKILL)
                        child.proc.wait(10)
                        pending.append((now + args.restart_s, "restart", name))
                    else:
                        child.signal_group(signal.SIGSTOP)
                        pending.append((now + args.freeze_s, "thaw", name))
                    down[int(name.split("-s")[1][0])] = name
                    events.append({"t": round(now - started), "fault": "kill" if kill else "freeze", "server": name})
                    events[-1]["stall"] = 0.0
                    common.log(f"{events[-1]['fault']} {name}")
            time.sleep(0.2)

        trainer.snapshot(min_steps=steps + 20)  # it trains on after the last fault
        trainer.stop()
        final = read_stats(trainer.path) or {}
        time.sleep(15)  # the last epoch ends everywhere (admission timeout, rounds) before the digests are read
        replies = {n: info(addresses[n], digest=True) for n in names}
        rows, equal = [], all(r is not None for r in replies.values())
        for stage in range(STAGES):  # as each server says: a server that moved counts where it is
            serving = {n: r for n, r in replies.items() if r is not None and r.stage == stage}
            equal &= len({r.state_digest for r in serving.values()}) == 1
            rows += [[stage, n, r.epoch, r.rounds_ok, r.rounds_failed, r.state_digest[:12]] for n, r in serving.items()]
        rows += [["?", n, "no answer", "", "", ""] for n, r in replies.items() if r is None]
        common.table(
            "faults",
            ["t (s)", "fault", "server", "longest stall after it (s)"],
            [[e["t"], e["fault"], e["server"], f"{e['stall']:.1f}"] for e in events],
        )
        common.table("servers at the end", ["stage", "server", "epoch", "rounds ok", "rounds failed", "digest"], rows)
        rounds_ok = sum(r[3] for r in rows if isinstance(r[3], int))
        rounds_failed = sum(r[4] for r in rows if isinstance(r[4], int))
        print(
            f"microbatches {final.get('steps')}, lost {final.get('lost_microbatches')}, retries {final.get('retries')}; "
            f"longest stall {longest:.1f}s; all-reduce rounds ok {rounds_ok}, failed {rounds_failed} "
            f"(these servers' counters; a killed server's are gone); peers of each stage bitwise equal: {equal}"
        )
        common.write_json(
            args.out,
            "soak",
            {"hardware": common.hardware(), "events": events, "servers": rows, "final": final, "equal": equal},
        )


if __name__ == "__main__":
    main()
