"""Trainer configuration; `swarm-trainer`'s flags are generated from it."""

from __future__ import annotations

from dataclasses import dataclass, field

from swarm.compression import CODECS, CompressionPolicy
from swarm.compression.registry import CODEC_NAMES_HELP
from swarm.metrics import MetricsConfig
from swarm.net import DHT_WAIT_TIMEOUT_HELP, DHT_WAIT_TIMEOUT_S, SWARM_KEY_HELP
from swarm.protocol.tensors import FP16_MAX
from trainer.data import parse_hub_name


@dataclass(kw_only=True)
class TrainerConfig:
    swarm_name: str = field(default="swarm", metadata={"help": "DHT namespace shared by the swarm's peers"})
    initial_peers: list[str] = field(default_factory=list, metadata={"help": "multiaddrs of any DHT peer"})
    data: str | None = field(
        default=None,
        metadata={
            "help": "training text: a text file (memory-mapped), a folder of text files, a folder written by a "
            "`datasets` save_to_disk, or a hub dataset hf:OWNER/NAME[/CONFIG] (streamed) (default: Python's stdlib "
            "source)"
        },
    )
    data_column: str = field(default="text", metadata={"help": "the text column of a --data dataset"})
    data_split: str = field(default="train", metadata={"help": "the split of a --data dataset"})
    tokenizer: str | None = field(
        default=None,
        metadata={"help": "a `tokenizers` JSON file; its ids must fit --vocab-size (default: bytes, ids < 256)"},
    )
    batch_size: int = field(default=8, metadata={"help": "samples per microbatch"})
    in_flight: int = field(default=3, metadata={"help": "microbatches in the pipeline at once"})
    codec: str = field(
        default="blockwise8",
        metadata={
            "help": "wire codec of hidden states (and of their gradients, unless --backward-codec)",
            "choices": sorted(CODECS),
        },
    )
    backward_codec: str | None = field(
        default=None,
        metadata={
            "help": f"wire codec of activation gradients (Backward replies, relayed between stages): {CODEC_NAMES_HELP}"
        },
    )
    backward_epilogue: float = field(
        default=1.0,
        metadata={
            "help": "with a low-rank or top-k --backward-codec: use it only for the microbatches that complete the "
            "last this share of each stage's global batch, 8-bit for the others (Optimus-CC's epilogue-only "
            "compression: the gradients a step waits for); 1: every microbatch"
        },
    )
    max_steps: int = field(default=0, metadata={"help": "stop after this many microbatches (0: no limit)"})
    duration: float = field(default=0.0, metadata={"help": "stop after this many seconds (0: no limit)"})
    data_seed: int = field(default=0, metadata={"help": "seed of the data order"})
    request_timeout: float = field(
        default=60.0, metadata={"help": "longest deadline of one stage call, seconds (until calls are measured)"}
    )
    min_request_timeout: float = field(
        default=20.0,
        metadata={
            "help": "shortest deadline of one stage call, seconds; between the two, 4 x the slowest of the last 64 "
            "calls of its kind (a frozen peer costs that, not --request-timeout). Keep it at least twice the "
            "servers' --averaging-timeout: a healthy server's calls wait while its stage's round waits for a peer"
        },
    )
    max_retries: int = field(default=8, metadata={"help": "tries of one stage call on different peers"})
    discovery_period: float = field(default=2.0, metadata={"help": "seconds between DHT lookups of stage peers"})
    log_period: float = field(default=5.0, metadata={"help": "seconds between progress lines"})
    stats_file: str | None = field(default=None, metadata={"help": "keep a JSON snapshot of progress here"})
    loss_log: str | None = field(
        default=None, metadata={"help": "append one JSON line per microbatch: step, loss, " "stage versions"}
    )
    dht_port: int = field(default=0, metadata={"help": "libp2p port of this trainer's DHT node"})
    dht_wait_timeout: float = field(default=DHT_WAIT_TIMEOUT_S, metadata={"help": DHT_WAIT_TIMEOUT_HELP})
    swarm_key: str | None = field(default=None, metadata={"help": SWARM_KEY_HELP})
    max_activation: float = field(
        default=FP16_MAX,
        metadata={
            "help": "largest |value| accepted in a server's reply (default: the fp16 maximum); a server that "
            "replies beyond it, or with NaN, is banned like one that fails"
        },
    )
    metrics: MetricsConfig = field(default_factory=MetricsConfig, metadata={"prefix": "metrics_"})

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.in_flight < 1 or self.max_retries < 1:
            raise ValueError("--batch-size, --in-flight and --max-retries must be >= 1")
        if self.codec not in CODECS:
            raise ValueError(f"unknown --codec {self.codec!r}; choose one of {sorted(CODECS)}")
        self.policy()  # names the flag and the choices if --backward-codec is not a codec for gradients
        if not 0 < self.backward_epilogue <= 1:
            raise ValueError(f"--backward-epilogue must be in (0, 1], got {self.backward_epilogue}")
        if not 0 < self.max_activation < float("inf"):
            raise ValueError(f"--max-activation must be positive and finite, got {self.max_activation}")
        if not 0 < self.min_request_timeout <= self.request_timeout:
            raise ValueError("--min-request-timeout must be > 0 and <= --request-timeout")
        if self.request_timeout <= 0 or self.discovery_period <= 0 or not 0 < self.dht_wait_timeout < float("inf"):
            raise ValueError("--request-timeout, --discovery-period and --dht-wait-timeout must be > 0")
        if self.data is not None and self.data.startswith("hf:"):
            parse_hub_name(self.data)
        if not self.data_column or not self.data_split:
            raise ValueError("--data-column and --data-split must not be empty")

    def policy(self) -> CompressionPolicy:
        """The pipeline's codecs: --codec for hidden states, --backward-codec (or --codec) for their gradients."""
        try:
            return CompressionPolicy.for_wire(self.codec, self.backward_codec)
        except ValueError as e:
            raise ValueError(f"--backward-codec: {e}") from None
