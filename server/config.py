"""Server configuration in sections, one per component; `swarm-server`'s flags are generated from it (a section's
flags keep their plain names: `--lr`, not `--optimizer-lr`)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from swarm.compression import CompressionPolicy
from swarm.compression.registry import WHOLE_TENSOR_CODECS
from swarm.metrics import MetricsConfig
from swarm.net import DHT_WAIT_TIMEOUT_HELP, DHT_WAIT_TIMEOUT_S, SWARM_KEY_HELP
from swarm.protocol.tensors import FP16_MAX
from swarm.protocol.tls import TlsConfig
from swarm.rebalance import RebalanceConfig

LOW_RANK_CODECS = ("acp", "powersgd")  # stage all-reduce schemes that send low-rank factors (server/collab/lowrank.py)

SECTION = {"prefix": ""}  # a section's flags are not prefixed with its name


@dataclass(kw_only=True)
class NetworkConfig:
    """Where the peer listens, how it is found, and how often it tells."""

    swarm_name: str = field(default="swarm", metadata={"help": "DHT namespace shared by the swarm's peers"})
    initial_peers: list[str] = field(default_factory=list, metadata={"help": "multiaddrs of any DHT peer"})
    host: str = field(
        default="127.0.0.1",
        metadata={"help": "gRPC listen address (0.0.0.0, or :: for IPv4 and IPv6, for a real swarm)"},
    )
    port: int = field(default=0, metadata={"help": "gRPC port (0: any free port)"})
    announce_host: str | None = field(
        default=None,
        metadata={
            "help": "address trainers dial (default: --host, or if that is 0.0.0.0 or ::, the address the swarm's "
            "peers see us at)"
        },
    )
    announce_port: int | None = field(
        default=None, metadata={"help": "port trainers dial (default: the bound --port); e.g. a proxy in front"}
    )
    dht_port: int = field(default=0, metadata={"help": "libp2p port of this server's DHT node"})
    swarm_key: str | None = field(default=None, metadata={"help": SWARM_KEY_HELP})
    announce_period: float = field(default=5.0, metadata={"help": "seconds between DHT announcements"})
    record_ttl: float = field(default=20.0, metadata={"help": "seconds a DHT record stays valid"})
    peer_timeout: float = field(default=2.0, metadata={"help": "deadline of a progress message to a stage peer"})
    dht_wait_timeout: float = field(default=DHT_WAIT_TIMEOUT_S, metadata={"help": DHT_WAIT_TIMEOUT_HELP})
    drain_timeout: float = field(default=10.0, metadata={"help": "on SIGTERM: seconds to finish queued requests"})
    transport: str = field(
        default="auto",
        metadata={
            "help": "how callers reach this server: grpc (dial host:port), p2p (over libp2p, through its DHT node: for a "
            "server behind NAT), auto (p2p if the reachability check finds the swarm cannot dial us)",
            "choices": ["auto", "grpc", "p2p"],
        },
    )
    dht_no_listen: bool = field(
        default=False,
        metadata={
            "help": "our DHT node accepts no inbound libp2p connection: reachable through a relay only, as behind a "
            "home router (tests; a server behind a real NAT finds a relay without it)"
        },
    )
    check_reachability: bool = field(
        default=True,
        metadata={"help": "at start, ask a few swarm peers to dial our gRPC address back, and say whether they could"},
    )

    def __post_init__(self) -> None:
        if self.record_ttl <= self.announce_period:
            raise ValueError(f"--record-ttl ({self.record_ttl}) must exceed --announce-period ({self.announce_period})")
        if not 0 < self.dht_wait_timeout < float("inf"):
            raise ValueError(f"--dht-wait-timeout must be positive, got {self.dht_wait_timeout}")


@dataclass(kw_only=True)
class OptimizerConfig:
    """The stage's optimizer; identical on every peer of a stage."""

    optimizer: str = field(default="adamw", metadata={"help": "stage optimizer", "choices": ["adamw", "lamb"]})
    lr: float = field(default=2e-3, metadata={"help": "peak learning rate"})
    weight_decay: float = field(default=0.01, metadata={"help": "decoupled weight decay"})
    warmup_steps: int = field(default=0, metadata={"help": "linear learning-rate warm-up, in optimizer steps"})
    total_steps: int = field(default=0, metadata={"help": "cosine decay to 10%% over this many steps (0: constant)"})
    clip_grad_norm: float = field(default=1.0, metadata={"help": "max gradient norm (0: no clipping)"})


@dataclass(kw_only=True)
class ComputeConfig:
    """The stage's compute thread."""

    device: str = field(default="auto", metadata={"help": "auto, cpu, cuda, cuda:N"})
    torch_threads: int = field(default=0, metadata={"help": "torch intra-op threads (0: torch's default)"})
    max_batch_size: int = field(default=64, metadata={"help": "largest microbatch accepted, in samples"})
    forward_chunk_samples: int = field(
        default=-1,
        metadata={
            "help": "a Forward is computed this many samples at a time (the same output with less working memory: "
            "in bench_flood one Forward at batch 128 peaked 193 MB above rest whole, 37 MB in pieces of 16); -1: 16 "
            "on CPU, whole on CUDA (a GPU wants large batches); 0: whole"
        },
    )
    stash_versions: int = field(
        default=2,
        metadata={
            "help": "parameter versions kept so that a backward recomputes its forward at the parameters that served "
            "it, not at ones stepped since (0: always the current ones)"
        },
    )
    slowdown: float = field(
        default=1.0,
        metadata={
            "help": "testing/benchmarks: emulate a device N times slower: each forward/backward lasts N x the least "
            "time this server has taken for the same work (its uncontended cost, unlike the current time, which "
            "grows with CPU contention), sleeping the rest so the CPU stays free for other processes"
        },
    )

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError("--max-batch-size must be >= 1")
        if self.forward_chunk_samples < -1:
            raise ValueError(
                f"--forward-chunk-samples must be -1 (auto), 0 (whole) or more, got {self.forward_chunk_samples}"
            )
        if self.stash_versions < 0:
            raise ValueError(f"--stash-versions must be >= 0, got {self.stash_versions}")
        if self.slowdown < 1.0:
            raise ValueError(f"--slowdown must be >= 1, got {self.slowdown}")


@dataclass(kw_only=True)
class GuardConfig:
    """What the stage refuses, whoever sends it (see server/guard.py)."""

    max_activation: float = field(
        default=FP16_MAX,
        metadata={
            "help": "largest |value| accepted or sent in hidden states and their gradients (default: the fp16 "
            "maximum); a request beyond it gets INVALID_ARGUMENT"
        },
    )
    grad_outlier_factor: float = field(
        default=1000.0,
        metadata={
            "help": "refuse a microbatch whose parameter-gradient norm exceeds N x the stage's scale: the median of "
            "its callers' median norms, each caller one vote, zero norms not counted, at least 0.01 (after 16 norms; 0: "
            "refuse only non-finite gradients). Honest microbatches reached 55x early in training"
        },
    )

    max_active_calls: int = field(
        default=256,
        metadata={
            "help": "Forward/Backward calls held at once (arriving, queued or computing); more get RESOURCE_EXHAUSTED"
        },
    )
    max_buffered_mb: float = field(
        default=0.0,
        metadata={
            "help": "request payload held at once, in MiB, across all calls, counting a frame's worth (up to 2 MiB) for "
            "each request being read; more gets RESOURCE_EXHAUSTED (0: 4 x the stage's largest request and a frame, "
            "at least 64)"
        },
    )
    max_caller_share: float = field(
        default=0.5,
        metadata={
            "help": "the share of --max-active-calls and --max-buffered-mb one caller (a connection, or a libp2p "
            "peer) may hold, and the callers of one IP address together twice that; more of its calls get "
            "RESOURCE_EXHAUSTED while others still get in"
        },
    )

    def __post_init__(self) -> None:
        if self.max_active_calls < 1 or self.max_buffered_mb < 0:
            raise ValueError("--max-active-calls must be >= 1 and --max-buffered-mb >= 0")
        if not 0 < self.max_caller_share <= 1:
            raise ValueError(f"--max-caller-share must be in (0, 1], got {self.max_caller_share}")
        if not 0 < self.max_activation < float("inf"):
            raise ValueError(f"--max-activation must be positive and finite, got {self.max_activation}")
        if not (self.grad_outlier_factor == 0 or 1 < self.grad_outlier_factor < float("inf")):
            raise ValueError(f"--grad-outlier-factor must be 0 or > 1, got {self.grad_outlier_factor}")


@dataclass(kw_only=True)
class EpochConfig:
    """When a stage steps: the global batch, stage 0's admission, delayed updates."""

    samples_per_step: int = field(
        default=32,
        metadata={
            "help": "global batch: samples the whole stage accumulates before its peers average gradients and step"
        },
    )
    lookahead_samples: int = field(
        default=0,
        metadata={
            "help": "stage 0: samples of the next global batch admitted into the pipeline before the current one has "
            "stepped (0: every global batch computes its gradients at one set of parameters, as one process would; "
            "more keeps the pipeline fuller at the cost of gradients one step stale)"
        },
    )
    admission_timeout: float = field(
        default=30.0,
        metadata={
            "help": "stage 0: end an epoch whose admitted microbatches stopped coming back this long ago (a trainer "
            "died with them in flight)"
        },
    )
    delay_optimizer_step: bool = field(
        default=False,
        metadata={"help": "average and step in the background while serving with the previous parameters (DPU)"},
    )
    local_batch: int = field(
        default=0,
        metadata={
            "help": "local-step training (DiLoCo): every N of its own samples a peer steps its own optimizer, and the "
            "stage's peers meet once per global batch (--samples-per-step: the outer interval) to average their "
            "pseudo-gradients (the outer parameters minus their own) and take one outer Nesterov step; 0: "
            "synchronous training (one averaged step per global batch)"
        },
    )
    # DiLoCo's (0.7, 0.9) trained 6-26% worse than plain averaging at the built-in runs' length (bench_local_steps)
    outer_lr: float = field(default=1.0, metadata={"help": "--local-batch: the outer step's learning rate"})
    outer_momentum: float = field(
        default=0.0,
        metadata={"help": "--local-batch: the outer step's Nesterov momentum (DiLoCo's: 0.9 with --outer-lr 0.7)"},
    )
    progress_period: float = field(default=0.5, metadata={"help": "seconds between checks of the stage's progress"})
    solo: bool = field(default=False, metadata={"help": "step alone, never average (debugging)"})

    def __post_init__(self) -> None:
        if self.samples_per_step < 1:
            raise ValueError("--samples-per-step must be >= 1")
        if self.lookahead_samples < 0:
            raise ValueError(f"--lookahead-samples must be >= 0, got {self.lookahead_samples}")
        if self.admission_timeout <= 0:
            raise ValueError(f"--admission-timeout must be > 0, got {self.admission_timeout}")
        if self.local_batch < 0:
            raise ValueError(f"--local-batch must be >= 0, got {self.local_batch}")
        if not (math.isfinite(self.outer_lr) and self.outer_lr > 0):
            raise ValueError(f"--outer-lr must be a finite number > 0, got {self.outer_lr}")
        if not (math.isfinite(self.outer_momentum) and 0 <= self.outer_momentum < 1):
            raise ValueError(f"--outer-momentum must be in [0, 1), got {self.outer_momentum}")
        if self.local_batch and (self.delay_optimizer_step or self.solo):
            flag = "--delay-optimizer-step" if self.delay_optimizer_step else "--solo"
            raise ValueError(f"--local-batch and {flag} are two different training modes: choose one")


@dataclass(kw_only=True)
class AveragingConfig:
    """How the peers of a stage average."""

    allreduce_codec: str = field(
        default="blockwise8",
        metadata={
            "help": "codec of the stage's gradient all-reduce; acp: ACP-SGD, one low-rank factor per epoch with error "
            "feedback; powersgd: PowerSGD, both factors in two rounds per epoch (factors and the tensors that stay "
            "whole are sent fp16)",
            "choices": [*WHOLE_TENSOR_CODECS, *LOW_RANK_CODECS],
        },
    )
    allreduce_rank: int = field(default=4, metadata={"help": "acp/powersgd: rank of the low-rank factors"})
    allreduce_warmup_epochs: int = field(
        default=10, metadata={"help": "acp/powersgd: epochs averaged whole (fp16) before the low-rank rounds begin"}
    )
    allreduce_error_feedback: bool = field(
        default=True, metadata={"help": "acp/powersgd: add what the factors missed to the next epoch's gradients"}
    )
    allreduce_query_reuse: bool = field(
        default=True,
        metadata={"help": "acp/powersgd: multiply by the last round's other factor (else a fresh random one)"},
    )
    allreduce_compress_stages: str = field(
        default="all",
        metadata={
            "help": "acp/powersgd: the stages that average low-rank: 'all', stage indices ('0,1') or a fraction of the "
            "stages counted from stage 0 ('0.5'); the others average whole, 8-bit. Optimus-CC's selective compression: "
            "the earliest stages finish backward last, so their all-reduce is the one on the critical path"
        },
    )
    param_average_every: int = field(
        default=0,
        metadata={
            "help": "also average the peers' parameters every N epochs (0: never). The all-reduce hands every peer "
            "the same average, so peers on the same kind of device stay bitwise equal; peers whose optimizers round "
            "differently (CPU and GPU in one stage) drift apart without it"
        },
    )
    tied_average_every: int = field(
        default=10,
        metadata={
            "help": "with --tie-embeddings: every N epochs the tied weight's round also averages its copies on stage 0 "
            "and the last stage (with --param-average-codec), which brings them back together after a round that "
            "failed for some of them (0: never)"
        },
    )
    param_average_codec: str = field(
        default="none",
        metadata={
            "help": "codec of --param-average-every's parameter averaging (none: exact; the peers take the average as "
            "their parameters, so a lossy codec's error lands in the weights)",
            "choices": list(WHOLE_TENSOR_CODECS),
        },
    )
    param_average_probe: bool = field(
        default=True,
        metadata={
            "help": "before each --param-average-every round, a probe round of a few values learns whether every peer "
            "of the group holds the same parameters (peers on one kind of device do: the all-reduce hands them the "
            "same average), and then nothing is averaged (--no-param-average-probe: always average)"
        },
    )
    state_codec: str = field(
        default="none",
        metadata={
            "help": "codec of the stage state a joining peer downloads (none: the joiner starts bitwise equal to its "
            "source; fp16/blockwise8: fewer bytes, a joiner that differs until the next parameter averaging)",
            "choices": list(WHOLE_TENSOR_CODECS),
        },
    )
    matchmaking_time: float = field(default=1.0, metadata={"help": "seconds peers gather before an all-reduce"})
    early_rounds: bool = field(
        default=True,
        metadata={
            "help": "begin a gradient all-reduce as soon as every peer the stage knows of has gathered, instead of "
            "after --matchmaking-time (--no-early-rounds: always wait it out)"
        },
    )
    fixed_groups: bool = field(
        default=True,
        metadata={
            "help": "a gradient all-reduce's first attempt holds exactly the peers the stage knows for the epoch, with "
            "no matchmaking through the DHT: a round begins when its peers reach it; peers that see the group "
            "differently fail it at once and retry with matchmaking (--no-fixed-groups: always matchmake)"
        },
    )
    averaging_timeout: float = field(default=10.0, metadata={"help": "give up an all-reduce or state download after"})
    robust_clip: float = field(
        default=0.0,
        metadata={
            "help": "robust gradient all-reduce: the parts this peer reduces are CenteredClip's robust mean, which "
            "bounds what a peer sending garbage can do to the stage's step, instead of the weighted mean; the clip "
            "radius is this many times the median distance of the peers' parts to the most central one (0: off; "
            "1 is a sound choice: tests/benchmarks/bench_robust.py; needs 3 or more peers in a round to act)"
        },
    )

    def __post_init__(self) -> None:
        self.compressed_stages(1)  # validates --allreduce-compress-stages
        if self.tied_average_every < 0:
            raise ValueError(f"--tied-average-every must be >= 0, got {self.tied_average_every}")
        if not 0 <= self.robust_clip <= 1e6:
            raise ValueError(f"--robust-clip must be 0 (off) or a positive factor, got {self.robust_clip}")
        for flag, codec in (("--param-average-codec", self.param_average_codec), ("--state-codec", self.state_codec)):
            if codec not in WHOLE_TENSOR_CODECS:
                raise ValueError(f"{flag} must be one of {list(WHOLE_TENSOR_CODECS)}, got {codec!r}")
        if self.allreduce_rank < 1 or self.allreduce_warmup_epochs < 0:
            raise ValueError(
                f"--allreduce-rank must be >= 1 and --allreduce-warmup-epochs >= 0, got {self.allreduce_rank} and "
                f"{self.allreduce_warmup_epochs}"
            )

    def compressed_stages(self, n_stages: int) -> set[int]:
        """The stages --allreduce-compress-stages names, of a model of `n_stages`."""
        spec = self.allreduce_compress_stages.strip()
        try:
            if spec == "all":
                return set(range(n_stages))
            if "." in spec:
                fraction = float(spec)
                if not 0.0 <= fraction <= 1.0:
                    raise ValueError
                return set(range(math.ceil(fraction * n_stages - 1e-9)))
            stages = {int(s) for s in spec.split(",")}
            if min(stages) < 0:
                raise ValueError
            return stages
        except ValueError:
            raise ValueError(
                f"--allreduce-compress-stages must be 'all', stage indices like '0,1' or a fraction like '0.5', got "
                f"{self.allreduce_compress_stages!r}"
            ) from None

    def for_stage(self, stage: int, n_stages: int) -> AveragingConfig:
        """The settings stage `stage` averages with: a stage left out of --allreduce-compress-stages averages whole."""
        if self.allreduce_codec in LOW_RANK_CODECS and stage not in self.compressed_stages(n_stages):
            return dataclasses.replace(self, allreduce_codec="blockwise8")
        return self

    @property
    def scheme(self) -> str:
        """What peers averaging together must agree on: for low-rank codecs, factors of another rank or another query
        do not add up (error feedback and warm-up may differ: each peer's residual is its own, and the phase travels
        anyway)."""
        if self.allreduce_codec not in LOW_RANK_CODECS:
            return self.allreduce_codec
        return f"{self.allreduce_codec}-rank{self.allreduce_rank}-reuse{int(self.allreduce_query_reuse)}"

    @property
    def shared(self) -> dict[str, object]:
        """The settings every peer of a stage must share (their records carry them: a peer with others is ignored,
        with a warning naming the difference): the all-reduce's, and the codecs of parameter averaging and state
        downloads (the exact all-reduce re-encodes the average with its own codec, so peers of two codecs would end
        a round holding different values)."""
        names = [k for k in vars(self) if k.startswith("allreduce_")] + [
            "param_average_codec",
            "state_codec",
            "tied_average_every",
            "fixed_groups",
        ]
        return {k: getattr(self, k) for k in names}

    def policy(self) -> CompressionPolicy:
        """The compression policy of the stage's averaging (the pipeline's codecs are the trainers')."""
        return CompressionPolicy(
            allreduce_gradients=self.wire_codec, parameters=self.param_average_codec, state=self.state_codec
        )

    @property
    def tied_codec(self) -> str:
        """The codec of the tied weight's gradient round, the same on stage 0 and the last stage whatever
        --allreduce-compress-stages says (a group of two codecs would end its round holding different values):
        --allreduce-codec's, 8-bit for the low-rank ones."""
        return "blockwise8" if self.allreduce_codec in LOW_RANK_CODECS else self.allreduce_codec

    @property
    def wire_codec(self) -> str:
        """The codec of what the all-reduce sends. Low-rank factors travel fp16, not 8-bit: a factor's columns can
        differ 30-fold in scale, and 8-bit absmax blocks bury the weak ones (measured: two ACP rounds of a rank-2
        gradient missed it by 20-32% with 8-bit factors, by 0.3% with fp16)."""
        return "fp16" if self.allreduce_codec in LOW_RANK_CODECS else self.allreduce_codec


@dataclass(kw_only=True)
class CheckpointConfig:
    checkpoint_dir: str | None = field(
        default=None,
        metadata={"help": "save the stage here periodically and on exit; resume from it when the stage has no peers"},
    )
    checkpoint_period: float = field(default=300.0, metadata={"help": "seconds between checkpoints"})


@dataclass(kw_only=True)
class ServerConfig:
    stage: str = field(
        default="0", metadata={"help": "stage index to serve, or 'auto': the stage that most needs capacity"}
    )
    network: NetworkConfig = field(default_factory=NetworkConfig, metadata=SECTION)
    tls: TlsConfig = field(default_factory=TlsConfig, metadata=SECTION)
    compute: ComputeConfig = field(default_factory=ComputeConfig, metadata=SECTION)
    guard: GuardConfig = field(default_factory=GuardConfig, metadata=SECTION)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig, metadata=SECTION)
    epochs: EpochConfig = field(default_factory=EpochConfig, metadata=SECTION)
    averaging: AveragingConfig = field(default_factory=AveragingConfig, metadata=SECTION)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig, metadata=SECTION)
    rebalance: bool = field(
        default=True, metadata={"help": "move to another stage when it needs this peer's capacity more (--rebalance-*)"}
    )
    rebalancing: RebalanceConfig = field(default_factory=RebalanceConfig, metadata={"prefix": "rebalance_"})
    metrics: MetricsConfig = field(default_factory=MetricsConfig, metadata={"prefix": "metrics_"})
    migration_drain_s: float = field(
        default=30.0,
        metadata={
            "help": "before moving: seconds to wait for the stage's current epoch, so this peer's gradients count"
        },
    )

    def __post_init__(self) -> None:
        if self.stage != "auto" and not (self.stage.isdigit()):
            raise ValueError(f"--stage must be a non-negative integer or 'auto', got {self.stage!r}")
        if self.epochs.local_batch and (
            self.averaging.param_average_every > 0 or self.averaging.allreduce_codec in LOW_RANK_CODECS
        ):
            raise ValueError(
                "--local-batch averages pseudo-gradients with a whole-tensor --allreduce-codec and needs no "
                "--param-average-every (its outer rounds leave the peers of a stage with one set of parameters)"
            )
        if self.epochs.delay_optimizer_step and self.averaging.param_average_every > 0:
            raise ValueError(
                "--param-average-every works with synchronous steps only: with --delay-optimizer-step a stage "
                "averages in the background and would never average its parameters"
            )
        if self.epochs.admission_timeout < 2 * self.averaging.averaging_timeout:
            raise ValueError(
                f"--admission-timeout ({self.epochs.admission_timeout}) must be at least twice --averaging-timeout "
                f"({self.averaging.averaging_timeout}): a stage waiting out a slow round must not look like lost work"
            )
