"""`swarm-generate`: sample text from an exported model (`swarm-export`), or from a live swarm through its stages.

Tokens are bytes (the default corpus's): the prompt is encoded as UTF-8, only byte ids (< 256) are sampled, and the
text is decoded with errors="replace". The sampler is one pure function; what differs between a file and a swarm is
only the function that maps the context to the next token's logits.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from dht.node import SwarmDHT
from dht.records import PeerEntry, settings
from swarm.cli import (
    add_config_args,
    add_config_file_arg,
    add_model_args,
    config_from_args,
    model_from_args,
    parse_args,
)
from swarm.compression import CODECS, CompressionPolicy
from swarm.config import ModelConfig
from swarm.devices import resolve_device
from swarm.model import GPT
from swarm.net import SWARM_KEY_HELP
from swarm.protocol import access
from swarm.protocol.tensors import WireError, WireStats
from trainer.client import StageClient
from trainer.config import TrainerConfig

BYTES = 256  # token ids that are bytes; the only ones sampled

NextLogits = Callable[[Sequence[int]], torch.Tensor]  # context ids -> logits (V,) of the token after them


@dataclass(kw_only=True)
class GenerateConfig:
    """Where the model is (a file, or a swarm to join) and how to sample. The model's shape comes from the model
    flags (`--preset` and overrides), as for every other command."""

    model: str | None = field(default=None, metadata={"help": "an exported model (swarm-export's safetensors file)"})
    initial_peers: list[str] = field(
        default_factory=list, metadata={"help": "or: multiaddrs of any DHT peer of a live swarm to sample through"}
    )
    swarm_name: str = field(default=TrainerConfig.swarm_name, metadata={"help": "DHT namespace of the live swarm"})
    swarm_key: str | None = field(default=None, metadata={"help": SWARM_KEY_HELP})
    prompt: str = field(default="def ", metadata={"help": "text to continue"})
    max_new_bytes: int = field(default=200, metadata={"help": "bytes to sample after the prompt"})
    temperature: float = field(default=0.8, metadata={"help": "softmax temperature; 0: always the likeliest byte"})
    top_k: int = field(default=40, metadata={"help": "sample among the k likeliest bytes only (0: all)"})
    seed: int = field(
        default=0,
        metadata={
            "help": "seed of the sampling (the weights come from the file or the swarm: the model's own "
            "initialisation seed plays no part here)"
        },
    )
    device: str = field(default="auto", metadata={"help": "where a --model file runs: auto, cpu, cuda, cuda:N"})
    codec: str = field(
        default="none",
        metadata={"help": "wire codec of the hidden states to and from a swarm", "choices": sorted(CODECS)},
    )
    request_timeout: float = field(default=30.0, metadata={"help": "deadline of one stage call, seconds"})

    def __post_init__(self) -> None:
        if (self.model is None) == (not self.initial_peers):
            raise ValueError("pass either --model FILE or --initial-peers MULTIADDR... (exactly one of them)")
        if not self.prompt:
            raise ValueError("--prompt must not be empty: the model needs at least one byte to continue")
        if self.max_new_bytes < 0 or self.top_k < 0:
            raise ValueError("--max-new-bytes and --top-k must be >= 0")
        if not 0 <= self.temperature < math.inf:
            raise ValueError(f"--temperature must be >= 0 and finite, got {self.temperature}")
        if not 0 < self.request_timeout < math.inf:
            raise ValueError(f"--request-timeout must be > 0, got {self.request_timeout}")
        if self.codec not in CODECS:
            raise ValueError(f"unknown --codec {self.codec!r}; choose one of {sorted(CODECS)}")


class SwarmError(Exception):
    """The swarm could not compute a forward pass: a stage had no server that answered."""


def next_token(logits_V: torch.Tensor, temperature: float, top_k: int, generator: torch.Generator) -> int:
    """One id drawn from softmax(logits / temperature) restricted to the `top_k` largest logits (0: all);
    temperature 0 is the argmax. Raises ValueError on logits that are not a finite vector."""
    if logits_V.ndim != 1 or logits_V.numel() == 0:
        raise ValueError(f"logits must be a non-empty vector, got shape {list(logits_V.shape)}")
    logits_V = logits_V.detach().float().cpu()
    if not torch.isfinite(logits_V).all():
        raise ValueError("logits hold NaN or infinite values")
    if temperature == 0:
        return int(logits_V.argmax())
    if 0 < top_k < logits_V.numel():
        kept = torch.topk(logits_V, top_k).indices  # exactly k, even with ties at the k-th value
        logits_V = torch.full_like(logits_V, -math.inf).index_copy_(0, kept, logits_V[kept])
    probs_V = torch.softmax(logits_V / temperature, dim=0)
    return int(torch.multinomial(probs_V, 1, generator=generator))


def sample(
    next_logits_fn: NextLogits,
    prompt_ids: Sequence[int],
    n: int,
    temperature: float,
    top_k: int,
    generator: torch.Generator,
) -> list[int]:
    """The `n` ids that follow `prompt_ids`, drawn one at a time (`next_token`); the same `generator` state gives the
    same ids. `next_logits_fn` sees the whole context so far and crops it to what its model takes."""
    ids = list(prompt_ids)
    for _ in range(n):
        ids.append(next_token(next_logits_fn(ids), temperature, top_k, generator))
    return ids[len(prompt_ids) :]


def encode(prompt: str, cfg: ModelConfig) -> list[int]:
    ids = list(prompt.encode("utf-8"))
    if max(ids, default=0) >= cfg.vocab_size:
        raise ValueError(f"--prompt holds byte {max(ids)}, beyond the model's --vocab-size {cfg.vocab_size}")
    return ids


def decode(ids: Sequence[int]) -> str:
    return bytes(ids).decode("utf-8", errors="replace")


def load_model(path: str | Path, cfg: ModelConfig, device: torch.device | None = None) -> GPT:
    """`swarm.model.GPT` with the weights of an exported file (keys `stages.{i}.{name}`). Raises ValueError saying
    what is wrong: no such file, not safetensors, or weights that do not fit the model of `cfg`."""
    try:
        weights = load_file(str(path))
    except FileNotFoundError:
        raise ValueError(f"--model {path}: no such file") from None
    except (SafetensorError, OSError) as e:
        raise ValueError(f"--model {path}: not a readable safetensors file ({e})") from None
    model = GPT(cfg)
    expected = model.state_dict()
    problems = []
    if missing := sorted(expected.keys() - weights.keys()):
        problems.append(f"{len(missing)} missing (first: {missing[0]})")
    if unexpected := sorted(weights.keys() - expected.keys()):
        problems.append(f"{len(unexpected)} unexpected (first: {unexpected[0]})")
    wrong = [
        f"{k} is {list(weights[k].shape)}, the model's {list(v.shape)}"
        for k, v in expected.items()
        if k in weights and weights[k].shape != v.shape
    ]
    if wrong:
        problems.append(f"{len(wrong)} of another shape (first: {wrong[0]})")
    if problems:
        raise ValueError(
            f"--model {path} does not fit the model of these flags ({cfg.n_stages} stages, d_model {cfg.d_model}, "
            f"vocab {cfg.vocab_size}): tensors {'; '.join(problems)}. Pass the model flags (--preset, --n-stages, "
            f"...) it was trained with"
        )
    if bad := [k for k, v in weights.items() if v.is_floating_point() and not torch.isfinite(v).all()]:
        raise ValueError(f"--model {path}: {bad[0]} holds NaN or infinite values")
    model.load_state_dict(weights, strict=True)
    return model.to(device or torch.device("cpu")).eval()


def model_next_logits(model: GPT) -> NextLogits:
    """Logits of the byte after the context (its last max_seq_len ids), the stages run in sequence."""
    device = next(model.parameters()).device

    @torch.no_grad()
    def next_logits(ids: Sequence[int]) -> torch.Tensor:
        h = torch.tensor([list(ids[-model.cfg.max_seq_len :])], dtype=torch.int64, device=device)  # (1, T)
        for stage in model.stages:
            h = stage(h)
        return h[0, -1, :BYTES]  # (V,) of the last position

    return next_logits


class SwarmPipeline:
    """Forward passes for inference through a live swarm: every stage in order, with the whole (cropped) context, on
    the stage's fastest server by announced throughput. A server that fails is tried again only after the stage's
    others (for the rest of the run); when all of a stage's servers failed, the stage is looked up again once. Every
    reply is checked (dtype, shape, finite values) before it is used. Owned by the event loop."""

    def __init__(self, sdht: SwarmDHT, cfg: ModelConfig, client: StageClient, timeout: float):
        self.sdht, self.cfg, self.client, self.timeout = sdht, cfg, client, timeout
        self.servers: list[list[PeerEntry]] = [[] for _ in range(cfg.n_stages)]
        self.failed: set[str] = set()

    async def next_logits(self, ids: Sequence[int]) -> torch.Tensor:
        """Logits (bytes only) of the byte after the context (its last max_seq_len ids)."""
        h = torch.tensor([list(ids[-self.cfg.max_seq_len :])], dtype=torch.int64)  # (1, T)
        T, last = h.shape[1], self.cfg.n_stages - 1
        for stage in range(self.cfg.n_stages):
            h = await self._forward(stage, h, (1, T, self.cfg.vocab_size if stage == last else self.cfg.boundary_width))
        return h[0, -1, :BYTES]

    async def _discover(self, stage: int) -> None:
        try:
            entries = await self.sdht.discover(stage)
        except Exception as e:  # hivemind's errors, or our timeout
            raise SwarmError(f"could not look stage {stage} up in the DHT: {e!r}") from e
        self.servers[stage] = sorted(entries, key=lambda e: (e.peer_id in self.failed, -e.record.throughput))

    async def _forward(self, stage: int, inputs: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        errors: list[str] = []
        for again in (False, True):
            if again or not self.servers[stage]:
                await self._discover(stage)
            for entry in list(self.servers[stage]):
                address = entry.record.address
                try:
                    reply = await self.client.call(
                        address, "Forward", stage, "generate", {"inputs": inputs}, shape, self.timeout, inference=True
                    )
                    return check_reply(reply.tensor, shape, f"stage {stage} at {address}")
                except (TimeoutError, grpc.aio.AioRpcError, WireError) as e:
                    detail = e.details() if isinstance(e, grpc.aio.AioRpcError) else str(e) or repr(e)
                    errors.append(f"{address}: {detail}")
                    self.failed.add(entry.peer_id)
                    self.servers[stage].remove(entry)
                    self.servers[stage].append(entry)
        if not errors:
            raise SwarmError(
                f"no live server of stage {stage} in swarm {self.sdht.swarm_name!r} with this model (check "
                f"--initial-peers, --swarm-name and the model flags)"
            )
        raise SwarmError(f"no server of stage {stage} answered: {'; '.join(errors[-4:])}")


def check_reply(tensor: torch.Tensor | None, shape: tuple[int, ...], who: str) -> torch.Tensor:
    """`tensor` if it is a finite floating-point tensor of `shape`; else WireError naming `who` sent it."""
    if tensor is None:
        raise WireError(f"{who} replied without a tensor")
    if not tensor.is_floating_point():
        raise WireError(f"{who} replied with {tensor.dtype}, expected floating point")
    if tuple(tensor.shape) != shape:
        raise WireError(f"{who} replied with shape {list(tensor.shape)}, expected {list(shape)}")
    if not torch.isfinite(tensor).all():
        raise WireError(f"{who} replied with NaN or infinite values")
    return tensor.float()


def swarm_settings(cfg: ModelConfig) -> dict:
    """What a server must share with us to be called: its model's shape. Not its initialisation seed: its weights are
    whatever it trained to."""
    return settings(model={k: v for k, v in cfg.shared().items() if k != "seed"})


async def generate_on_swarm(
    sdht: SwarmDHT,
    cfg: ModelConfig,
    prompt_ids: Sequence[int],
    n: int,
    temperature: float,
    top_k: int,
    generator: torch.Generator,
    codec: str = "none",
    timeout: float = 30.0,
) -> list[int]:
    """`sample` with every forward pass through the swarm. The sampler runs on a worker thread and hands each forward
    pass to this event loop, so that the loop never blocks and the sampler stays the same pure function."""
    max_tensor_bytes = cfg.max_seq_len * max(cfg.d_model, cfg.vocab_size) * 4  # batch 1, fp32 at most
    client = StageClient(CompressionPolicy.for_wire(codec), WireStats(), max_tensor_bytes, p2p=sdht.p2p)
    pipeline = SwarmPipeline(sdht, cfg, client, timeout)
    loop = asyncio.get_running_loop()

    def next_logits(ids: Sequence[int]) -> torch.Tensor:
        return asyncio.run_coroutine_threadsafe(pipeline.next_logits(ids), loop).result()

    try:
        return await asyncio.to_thread(sample, next_logits, prompt_ids, n, temperature, top_k, generator)
    finally:
        await client.close()
        await sdht.close_p2p()  # opened if a server was reached over libp2p


async def _on_swarm(
    cfg: GenerateConfig, model_cfg: ModelConfig, sdht: SwarmDHT, prompt_ids: list[int], generator: torch.Generator
) -> list[int]:
    task, loop = asyncio.current_task(), asyncio.get_running_loop()
    assert task is not None
    if threading.current_thread() is threading.main_thread():  # signal handlers can only be set there
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
    n, temperature, top_k = cfg.max_new_bytes, cfg.temperature, cfg.top_k
    return await generate_on_swarm(
        sdht, model_cfg, prompt_ids, n, temperature, top_k, generator, cfg.codec, cfg.request_timeout
    )


def join(cfg: GenerateConfig, model_cfg: ModelConfig) -> SwarmDHT:
    """Blocking: a client DHT node of the swarm (it serves nothing and stores nothing)."""
    try:
        swarm_key = access.load(cfg.swarm_key)
        return SwarmDHT.start(
            cfg.swarm_name, cfg.initial_peers, swarm_settings(model_cfg), client_mode=True, swarm_key=swarm_key
        )
    except ValueError as e:  # the key file
        raise SwarmError(str(e)) from None
    except Exception as e:  # hivemind's errors for unreachable or malformed multiaddrs
        raise SwarmError(f"could not join the DHT through --initial-peers {' '.join(cfg.initial_peers)}: {e!r}") from e


def build_parser() -> argparse.ArgumentParser:
    # "resolve": this command's --seed (the sampling's) replaces the model's --seed (its initialisation), which plays
    # no part here: the weights come from the file or the swarm
    parser = argparse.ArgumentParser(
        prog="swarm-generate", description=__doc__.split("\n\n")[0], conflict_handler="resolve"
    )
    add_model_args(parser)
    add_config_args(parser, GenerateConfig)
    add_config_file_arg(parser)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parse_args(parser, argv)
    try:
        cfg, model_cfg = config_from_args(GenerateConfig, args), model_from_args(args)
        prompt_ids, device = encode(cfg.prompt, model_cfg), resolve_device(cfg.device)
    except ValueError as e:
        parser.error(str(e))
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    generator = torch.Generator().manual_seed(cfg.seed)
    sdht: SwarmDHT | None = None
    try:
        if cfg.model is not None:
            next_logits = model_next_logits(load_model(cfg.model, model_cfg, device))
            new = sample(next_logits, prompt_ids, cfg.max_new_bytes, cfg.temperature, cfg.top_k, generator)
        else:
            sdht = join(cfg, model_cfg)
            new = asyncio.run(_on_swarm(cfg, model_cfg, sdht, prompt_ids, generator))
    except (ValueError, SwarmError) as e:
        sys.exit(f"swarm-generate: {e}")
    except asyncio.CancelledError:
        sys.exit("swarm-generate: interrupted")
    finally:
        if sdht is not None:
            sdht.shutdown()
    print(decode(prompt_ids + new), flush=True)


if __name__ == "__main__":
    main()
