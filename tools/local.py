"""`swarm-local`: a whole swarm on this machine. One DHT node, S stages with R servers each (or any allocation,
e.g. 4,1,1, to watch the servers rebalance) and T trainers, each a separate OS process in its own process group on
127.0.0.1; a live progress line; a JSON summary; nothing left behind.

The processes themselves (each in its own process group, stopped with nothing left behind) are `tools/processes.py`'s.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from server.config import (
    AveragingConfig,
    ComputeConfig,
    EpochConfig,
    OptimizerConfig,
    ServerConfig,
)
from swarm.cli import (
    ONE_STAGE,
    add_config_args,
    add_config_file_arg,
    config_from_args,
    config_values,
    parse_args,
    to_argv,
    write_config_file,
)
from swarm.compression import CODECS
from swarm.config import PRESETS, ModelConfig, model_config
from swarm.rebalance import RebalanceConfig
from tools.processes import Child, LocalSwarm, dying_with_parent, local_server, local_trainer
from trainer.config import TrainerConfig


def flag_of(config: type, name: str):
    """A field of a server's or trainer's config, with its default and metadata, for swarm-local to pass on."""
    source = next(f for f in dataclasses.fields(config) if f.name == name)
    return field(default=source.default, metadata=source.metadata)


@dataclass(kw_only=True)
class LocalConfig:
    """What to start. The training knobs here default to `swarm-server`'s and `swarm-trainer`'s own defaults (read from
    their config classes, so there is one set); `server_config` and `trainer_config` turn this into their configs."""

    stages: int = field(default=3, metadata={"help": "pipeline stages"})
    servers_per_stage: str = field(
        default="2", metadata={"help": "servers per stage: one count for all, or one per stage (4,1,1)"}
    )
    trainers: int = field(default=2, metadata={"help": "trainer processes"})
    max_steps: int = field(default=0, metadata={"help": "stop after this many microbatches in all (0: no limit)"})
    duration: float = field(default=180.0, metadata={"help": "stop after this many seconds of training (0: no limit)"})
    summary_json: str | None = field(default=None, metadata={"help": "write the run's summary here"})
    preset: str = field(default="local_debug", metadata={"help": "model preset", "choices": sorted(PRESETS)})
    boundary: str = flag_of(ModelConfig, "boundary")
    boundary_factor: int = flag_of(ModelConfig, "boundary_factor")
    tie_embeddings: bool = flag_of(ModelConfig, "tie_embeddings")
    codec: str = field(default=TrainerConfig.codec, metadata={"help": "wire codec", "choices": sorted(CODECS)})
    backward_codec: str | None = flag_of(TrainerConfig, "backward_codec")
    backward_epilogue: float = flag_of(TrainerConfig, "backward_epilogue")
    batch_size: int = field(default=TrainerConfig.batch_size, metadata={"help": "samples per microbatch"})
    in_flight: int = field(default=TrainerConfig.in_flight, metadata={"help": "microbatches in flight per trainer"})
    samples_per_step: int = field(
        default=EpochConfig.samples_per_step, metadata={"help": "global batch of each stage, in samples"}
    )
    lr: float = field(default=OptimizerConfig.lr, metadata={"help": "servers' learning rate"})
    # the servers' stage-averaging flags, as swarm-server has them (default, help, choices)
    allreduce_codec: str = flag_of(AveragingConfig, "allreduce_codec")
    allreduce_rank: int = flag_of(AveragingConfig, "allreduce_rank")
    allreduce_warmup_epochs: int = flag_of(AveragingConfig, "allreduce_warmup_epochs")
    allreduce_error_feedback: bool = flag_of(AveragingConfig, "allreduce_error_feedback")
    allreduce_query_reuse: bool = flag_of(AveragingConfig, "allreduce_query_reuse")
    allreduce_compress_stages: str = flag_of(AveragingConfig, "allreduce_compress_stages")
    fixed_groups: bool = flag_of(AveragingConfig, "fixed_groups")
    delay_optimizer_step: bool = field(
        default=EpochConfig.delay_optimizer_step,
        metadata={"help": "servers average and step in the background (delayed parameter updates)"},
    )
    lookahead_samples: int = field(
        default=EpochConfig.lookahead_samples,
        metadata={"help": "stage 0 admits this many samples of the next global batch early (see swarm-server)"},
    )
    # local-step training (swarm-server's flags: default, help)
    local_batch: int = flag_of(EpochConfig, "local_batch")
    outer_lr: float = flag_of(EpochConfig, "outer_lr")
    outer_momentum: float = flag_of(EpochConfig, "outer_momentum")
    stash_versions: int = flag_of(ComputeConfig, "stash_versions")
    log_dir: str | None = field(default=None, metadata={"help": "per-process logs (default: a new temporary folder)"})
    swarm_name: str = field(default="local", metadata={"help": "DHT namespace"})
    private: bool = field(
        default=False,
        metadata={"help": "a private swarm: every peer gets a new swarm key (log dir's swarm.key), others are refused"},
    )
    rebalance_period_s: float = field(
        default=RebalanceConfig.period_s,
        metadata={
            "help": "servers' rebalancing period; a peer stays 2 periods on a stage it joined (try 15 with 4,1,1)"
        },
    )
    slowdown: float = field(
        default=ComputeConfig.slowdown, metadata={"help": "servers emulate a device N times slower (see swarm-server)"}
    )
    monitor_port: int = field(
        default=0, metadata={"help": "port of the swarm-monitor dashboard on 127.0.0.1 (0: any free port, -1: none)"}
    )
    sample_bytes: int = field(
        default=200,
        metadata={
            "help": "at the end, print this many bytes sampled from the trained swarm by swarm-generate (0: none)"
        },
    )

    def __post_init__(self) -> None:
        if self.trainers < 1:
            raise ValueError("--trainers must be >= 1")
        if self.stages < 2:
            raise ValueError(f"--stages must be >= 2, got {self.stages}: {ONE_STAGE}")
        if self.rebalance_period_s <= 0 or self.slowdown < 1:
            raise ValueError("--rebalance-period-s must be > 0 and --slowdown >= 1")
        if not -1 <= self.monitor_port < 65536:
            raise ValueError(f"--monitor-port must be -1 (none) or a port in [0, 65535], got {self.monitor_port}")
        if self.sample_bytes < 0:
            raise ValueError(f"--sample-bytes must be >= 0, got {self.sample_bytes}")
        self.allocation  # noqa: B018 -- validates --servers-per-stage
        self.trainer_config(0)  # validates the trainers' flags (--backward-codec)
        self.model()  # and the model's (--boundary-factor)

    @property
    def allocation(self) -> list[int]:
        """Servers to start on each stage."""
        try:
            counts = [int(c) for c in self.servers_per_stage.split(",")]
        except ValueError:
            counts = []
        if len(counts) == 1:
            counts *= self.stages
        if len(counts) != self.stages or min(counts) < 1:
            raise ValueError(
                f"--servers-per-stage must be one count >= 1 or {self.stages} comma-separated counts "
                f"(one per stage), got {self.servers_per_stage!r}"
            )
        return counts

    def server_config(self, stage: int) -> ServerConfig:
        base = local_server(stage)
        return dataclasses.replace(
            base,
            optimizer=dataclasses.replace(base.optimizer, lr=self.lr),
            epochs=dataclasses.replace(
                base.epochs,
                samples_per_step=self.samples_per_step,
                delay_optimizer_step=self.delay_optimizer_step,
                lookahead_samples=self.lookahead_samples,
                local_batch=self.local_batch,
                outer_lr=self.outer_lr,
                outer_momentum=self.outer_momentum,
            ),
            averaging=dataclasses.replace(
                base.averaging,
                **{
                    f.name: getattr(self, f.name)
                    for f in dataclasses.fields(self)
                    if f.name.startswith("allreduce_") or f.name == "fixed_groups"
                },
            ),
            compute=dataclasses.replace(base.compute, slowdown=self.slowdown, stash_versions=self.stash_versions),
            rebalancing=RebalanceConfig(period_s=self.rebalance_period_s, cooldown_s=2 * self.rebalance_period_s),
        )

    def model(self) -> ModelConfig:
        return model_config(
            self.preset,
            n_stages=self.stages,
            boundary=self.boundary,
            boundary_factor=self.boundary_factor,
            tie_embeddings=self.tie_embeddings,
        )

    def model_args(self) -> list[str]:
        """The model flags every server and trainer gets."""
        args = ["--preset", self.preset, "--n-stages", str(self.stages)]
        args += ["--tie-embeddings"] if self.tie_embeddings else []
        return args + ["--boundary", self.boundary, "--boundary-factor", str(self.boundary_factor)]

    def trainer_config(self, index: int) -> TrainerConfig:
        return dataclasses.replace(
            local_trainer(),
            batch_size=self.batch_size,
            in_flight=self.in_flight,
            codec=self.codec,
            backward_codec=self.backward_codec,
            backward_epilogue=self.backward_epilogue,
            data_seed=index,
        )


def start_peers(
    swarm: LocalSwarm,
    cfg: LocalConfig,
    server_extra: Callable[[str], Sequence[str]] = lambda name: (),
    trainer_extra: Callable[[str], Sequence[str]] = lambda name: (),
) -> None:
    """The servers and trainers of `cfg` (the DHT node must be running); `*_extra(name)`: more flags for one peer."""
    for stage, count in enumerate(cfg.allocation):
        for r in range(count):
            name = f"server-s{stage}-r{r}"
            server = cfg.server_config(stage)
            swarm.start_server(name, stage, [*to_argv(server, base=local_server(stage)), *server_extra(name)])
    for t in range(cfg.trainers):
        name = f"trainer-{t}"
        base = swarm.local_trainer(name)
        trainer = dataclasses.replace(cfg.trainer_config(t), stats_file=base.stats_file)
        swarm.start_trainer(name, [*to_argv(trainer, base=base), *trainer_extra(name)])


def aggregate(stats: list[dict], elapsed: float) -> dict:
    def mean(key: str) -> float | None:
        values = [s[key] for s in stats if s.get(key) is not None]
        return sum(values) / len(values) if values else None

    return {
        "steps": sum(s["steps"] for s in stats),
        "samples": sum(s["samples"] for s in stats),
        "initial_loss": mean("initial_loss"),
        "final_loss": mean("recent_loss"),
        "samples_per_second": sum(s["samples_per_second"] for s in stats),
        "wire_bytes": sum(s["wire_bytes"] for s in stats),
        "fp32_bytes": sum(s["fp32_bytes"] for s in stats),
        "lost_microbatches": sum(s["lost_microbatches"] for s in stats),
        "retries": sum(s["retries"] for s in stats),
        "peers_per_stage": [max(col) for col in zip(*(s["peers_per_stage"] for s in stats), strict=False)]
        if stats
        else [],
        "training_seconds": elapsed,
    }


def progress_line(agg: dict) -> str:
    return f"[{agg['training_seconds']:6.0f}s] {progress_status(agg)}"


def progress_status(agg: dict) -> str:
    loss = f"{agg['final_loss']:.3f}" if agg["final_loss"] is not None else "-"
    ratio = agg["fp32_bytes"] / agg["wire_bytes"] if agg["wire_bytes"] else 0.0
    return (
        f"step {agg['steps']:5d} | loss {loss} | {agg['samples_per_second']:5.1f} "
        f"samples/s | peers/stage {'/'.join(map(str, agg['peers_per_stage'])) or '-'} | wire "
        f"{agg['wire_bytes'] / 1e6:7.1f} MB ({ratio:.2f}x < fp32) | lost {agg['lost_microbatches']}"
    )


def progress_bar(cfg: LocalConfig) -> tqdm:
    """A terminal's live progress: towards --max-steps if set, else towards --duration, else open-ended; the status
    of `progress_line` follows the bar. Cleared when closed: the final `progress_line` takes its place."""
    if cfg.max_steps > 0:
        total, unit = float(cfg.max_steps), " steps"
    elif cfg.duration > 0:
        total, unit = cfg.duration, "s"
    else:
        return tqdm(file=sys.stdout, bar_format="{elapsed}{postfix}", dynamic_ncols=True, leave=False)
    bar_format = "{percentage:3.0f}%|{bar}| {n:.0f}/{total:.0f}" + unit + " [{elapsed}<{remaining}]{postfix}"
    return tqdm(total=total, file=sys.stdout, bar_format=bar_format, dynamic_ncols=True, leave=False)


def show_progress(bar: tqdm, cfg: LocalConfig, agg: dict) -> None:
    done = agg["steps"] if cfg.max_steps > 0 else agg["training_seconds"]
    bar.n = min(done, bar.total) if bar.total else done
    bar.set_postfix_str(progress_status(agg), refresh=False)
    bar.refresh()


SAMPLE_TIMEOUT_S = 120.0  # swarm-generate's start (a DHT node) and one forward pass through every stage per byte


def sample_text(swarm: LocalSwarm, cfg: LocalConfig, stop: threading.Event) -> str | None:
    """`cfg.sample_bytes` bytes sampled from the live swarm by swarm-generate (a child process, stopped like the
    others), or None after printing why not: a sample that fails never fails the run."""
    from tools.generate import GenerateConfig  # here: it imports hivemind, which the launcher needs nowhere else

    out_path, log_path = swarm.log_dir / "sample.txt", swarm.log_dir / "generate.log"
    try:
        gen = GenerateConfig(
            initial_peers=swarm.initial_peers,
            swarm_name=swarm.swarm_name,
            max_new_bytes=cfg.sample_bytes,
            swarm_key=swarm.key_args[1] if swarm.key_args else None,
        )
        print(f"sampling {cfg.sample_bytes} bytes after {gen.prompt!r} from the swarm (see {log_path})...", flush=True)
        with open(out_path, "wb") as out, open(log_path, "ab") as log:
            proc = subprocess.Popen(
                dying_with_parent(["-m", "tools.generate", *to_argv(gen), *swarm.model_args]),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=log,
                start_new_session=True,
            )
    except (OSError, ValueError) as e:
        print(f"swarm-local: warning: no sample: could not start swarm-generate: {e}", flush=True)
        return None
    swarm.children["generate"] = child = Child("generate", proc, log_path)
    deadline = time.monotonic() + SAMPLE_TIMEOUT_S
    while child.alive() and time.monotonic() < deadline and not stop.wait(0.2):
        pass
    why = None
    if child.alive():
        why = "interrupted" if stop.is_set() else f"timed out after {SAMPLE_TIMEOUT_S:.0f}s"
    swarm.stop(["generate"], grace=5)
    if why is None and proc.returncode != 0:
        why = f"swarm-generate exited with {proc.returncode}:\n{swarm.tail(child, 5)}"
    if why is not None:
        print(f"swarm-local: warning: no sample: {why}", flush=True)
        return None
    text = out_path.read_text(errors="replace").removesuffix("\n")
    return "".join(c if c.isprintable() or c in "\n\t" else "\ufffd" for c in text)  # no terminal escapes


def run(cfg: LocalConfig, stop: threading.Event) -> dict:
    log_dir = Path(cfg.log_dir or tempfile.mkdtemp(prefix="swarm-local-"))
    model_args = cfg.model_args()
    tty = sys.stdout.isatty()
    print(
        f"swarm-local: {cfg.stages} stages, servers {'/'.join(map(str, cfg.allocation))}, {cfg.trainers} trainers; "
        f"logs in {log_dir}",
        flush=True,
    )
    with LocalSwarm(log_dir, cfg.swarm_name, model_args, cfg.private) as swarm:
        swarm.start_dht()
        start_peers(swarm, cfg)
        if cfg.monitor_port >= 0:
            try:
                print(f"dashboard: {swarm.start_monitor(cfg.monitor_port)}", flush=True)
            except RuntimeError as e:  # the swarm trains without it
                print(f"swarm-local: no dashboard: {e}", flush=True)
        started, last_print, agg = time.monotonic(), 0.0, aggregate([], 0.0)
        reported_dead: set[str] = set()
        bar = progress_bar(cfg) if tty else None
        while not stop.wait(1.0):
            elapsed = time.monotonic() - started
            agg = aggregate(swarm.trainer_stats(), elapsed)
            for child in swarm.children.values():
                if not child.alive() and child.name not in reported_dead:
                    reported_dead.add(child.name)
                    message = f"{child.name} exited with {child.proc.returncode}:\n{swarm.tail(child)}"
                    if bar is not None:
                        bar.write(message, file=sys.stdout)
                    else:
                        print("\n" + message, flush=True)
            if all(not c.alive() for n, c in swarm.children.items() if n.startswith("trainer")):
                break
            if bar is not None:
                show_progress(bar, cfg, agg)
            elif elapsed - last_print >= 5:
                last_print = elapsed
                print(progress_line(agg), flush=True)
            if (0 < cfg.max_steps <= agg["steps"]) or (0 < cfg.duration <= elapsed):
                break
        swarm.stop([n for n in swarm.children if n.startswith("trainer")])  # trainers write their final stats
        agg = aggregate(swarm.trainer_stats(), time.monotonic() - started)
        if bar is not None:
            bar.close()
        print(progress_line(agg), flush=True)
        if agg["initial_loss"] and agg["final_loss"]:
            print(
                f"loss {agg['initial_loss']:.3f} -> {agg['final_loss']:.3f} "
                f"({agg['final_loss'] / agg['initial_loss']:.0%} of initial) in {agg['steps']} microbatches",
                flush=True,
            )
        sample = None
        if cfg.sample_bytes > 0 and not stop.is_set():  # after Ctrl-C the user wants out, not a sample
            sample = sample_text(swarm, cfg, stop)
            if sample is not None:
                print(f"sample of the trained model:\n{sample}", flush=True)
    summary = {**agg, "sample": sample, "config": {k: v for k, v in vars(cfg).items()}, "log_dir": str(log_dir)}
    if cfg.summary_json:
        Path(cfg.summary_json).write_text(json.dumps(summary, indent=2))
    return summary


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="swarm-local", description=__doc__.split("\n\n")[0])
    add_config_file_arg(parser)
    parser.add_argument(
        "--write-config",
        metavar="FILE",
        help="write this run's settings to FILE as TOML, then run; --config FILE repeats the run",
    )
    add_config_args(parser, LocalConfig)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parse_args(parser, argv)
    try:
        cfg = config_from_args(LocalConfig, args)
    except ValueError as e:
        parser.error(str(e))
    if args.write_config:
        try:
            write_config_file(args.write_config, config_values(cfg))
        except OSError as e:
            parser.error(f"--write-config {args.write_config}: {e.strerror or e}")
    stop, signals = threading.Event(), []

    def on_signal(signum: int, _frame: object) -> None:
        signals.append(signum)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    run(cfg, stop)
    if signals:  # stopped, not done: the shell's 128 + the signal, 130 after Ctrl+C
        sys.exit(128 + signals[0])


if __name__ == "__main__":
    main()
