"""Wire benchmark: bytes per microbatch per traffic class for every codec, and codec speed.

1. Bytes: one microbatch through real in-process gRPC stage servers with the trainer's StageClient; its WireStats count
   what crossed per class (headers included). The all-reduce class is the encoded size of each stage's gradient
   tensors (what one peer would send of its stage's gradients per averaging round, before any all-reduce fan-out),
   with swarm's codecs and with hivemind's, which the server's averager uses (serialized protobuf size).
2. Speed: encode+decode of a 4x512x1024 fp32 activation (8 MiB) per codec against a plain copy of the same tensor,
   interleaved rounds, medians. GB/s count the fp32 bytes in.
3. Codec time as a fraction of stage compute: what a middle server does per microbatch (3 decodes, 2 encodes of its
   activation) against its forward + backward (with recompute), interleaved. This is the GPU-mode number of the paper
   (< 1%); on CPU it is reported too.

    python -m tests.benchmarks.bench_wire [--quick] [--device auto|cpu|cuda] [--preset NAME] [--batch-size B]
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import torch

from swarm.compression import CODECS, Blockwise8Codec, Codec, CompressionPolicy
from swarm.compression.registry import WHOLE_TENSOR_CODECS
from swarm.config import PRESETS, ModelConfig, model_config
from swarm.devices import resolve_device, synchronize
from swarm.model import Stage
from swarm.pipeline import stage_backward, stage_forward
from swarm.protocol.tensors import WireStats, decode_tensor, encode_tensor
from tests.benchmarks import common
from tests.stages import InProcessStages, random_batch, run_microbatch
from trainer.client import StageClient

ACTIVATION_SHAPE = (4, 512, 1024)  # the transport benchmark's "realistic activation"
TARGET_8BIT = 3.9  # x fewer bytes than fp32


def pick_model(preset: str | None, device: torch.device, seq_len: int | None) -> ModelConfig:
    """Default: the debug model on CPU; a 1B-parameter, 4-stage model on GPU (what the paper's < 1% is about)."""
    name = preset or ("gpt_1b_4stages" if device.type == "cuda" else "local_debug")
    cfg = model_config(name)
    return dataclasses.replace(cfg, max_seq_len=seq_len) if seq_len else cfg


# ---------------------------------------------------------------------------------------------------- bytes on the wire
def hivemind_codecs() -> dict:
    """The all-reduce's own codecs (hivemind's), as the server configures them."""
    from server.collab.stage_averager import hivemind_compression

    return {name: hivemind_compression(CODECS[name]) for name in WHOLE_TENSOR_CODECS}


def hivemind_bytes(codec, t: torch.Tensor) -> int:
    from hivemind.compression import CompressionInfo

    t = t.detach().cpu()
    return codec.compress(t, CompressionInfo.from_tensor(t)).ByteSize()


async def bytes_per_microbatch(cfg: ModelConfig, device: torch.device, batch_size: int) -> dict:
    tokens, labels = random_batch(cfg, batch_size)
    out = {}
    async with InProcessStages(cfg, device, max_batch=batch_size) as stages:
        for name, codec in CODECS.items():
            stats = WireStats()
            client = StageClient(CompressionPolicy.for_wire(name), stats, max_tensor_bytes=1 << 34)
            try:
                await run_microbatch(stages, client, tokens, labels)
            finally:
                await client.close()
            by_class = stats.as_dict()["by_role"]
            allreduce, hm = {"wire": 0, "fp32": 0}, {"wire": 0, "fp32": 0}
            hm_codec = hivemind_codecs().get(name)
            for worker in stages.workers.values():  # gradients of this microbatch, accumulated on every stage
                for p in worker.stage.parameters():
                    if p.grad is None:
                        continue
                    enc = encode_tensor("grad", p.grad, codec)
                    allreduce["wire"] += enc.wire_bytes
                    allreduce["fp32"] += p.numel() * 4 + enc.header.ByteSize()
                    if hm_codec is not None:
                        hm["wire"] += hivemind_bytes(hm_codec, p.grad)
                        hm["fp32"] += p.numel() * 4  # payload only: the row's ratio uses codec none's bytes
                worker.stage.zero_grad(set_to_none=True)
            by_class["allreduce, swarm codec"] = allreduce
            if hm_codec is not None:
                by_class["allreduce, hivemind codec (per tensor)"] = hm
            out[name] = by_class
            common.log(f"bytes: codec {name} done")
    return out


# ---------------------------------------------------------------------------------------------------- codec speed
BNB_ENCODER = "blockwise8 (bitsandbytes' CPU encoder)"


def codec_variants(device: torch.device) -> dict[str, Codec]:
    """Every codec, and on the CPU the 8-bit codec as it was before its torch encoder: the two side by side."""
    variants: dict[str, Codec] = dict(CODECS)
    if device.type == "cpu":
        variants[BNB_ENCODER] = Blockwise8Codec(cpu_encoder="bitsandbytes")
    return variants


def codec_speed(device: torch.device, repeats: int) -> dict:
    x = torch.randn(ACTIVATION_SHAPE, device=device)
    nbytes = x.numel() * 4
    parts: dict[str, dict[str, list[float]]] = {}

    dst = torch.empty_like(x)

    def copy() -> float:  # memcpy into a preallocated tensor: the memory-bandwidth reference
        start = time.perf_counter()
        dst.copy_(x)
        synchronize(device)
        return time.perf_counter() - start

    def round_trip(codec_name: str, codec: Codec):
        parts[codec_name] = {"encode": [], "decode": []}

        def run() -> float:
            t0 = time.perf_counter()
            enc = encode_tensor("outputs", x, codec)  # payload is host bytes, as on the wire
            t1 = time.perf_counter()
            decode_tensor(enc, device)
            synchronize(device)
            t2 = time.perf_counter()
            parts[codec_name]["encode"].append(t1 - t0)
            parts[codec_name]["decode"].append(t2 - t1)
            return t2 - t0

        return run

    fns = {"copy": copy, **{name: round_trip(name, codec) for name, codec in codec_variants(device).items()}}
    times = common.interleaved(fns, repeats, warmup=2)
    for p in parts.values():  # drop the warm-up entries
        for k in p:
            p[k] = p[k][-repeats:]
    result = {"shape": list(ACTIVATION_SHAPE), "fp32_bytes": nbytes, "device": str(device), "variants": {}}
    for name, ts in times.items():
        result["variants"][name] = {
            "seconds": common.summary(ts),
            "gb_per_s": common.summary([nbytes / t / 1e9 for t in ts]),
            "time_vs_copy": common.summary(common.per_round_ratio(ts, times["copy"])),
            **({k: common.summary(v) for k, v in parts[name].items()} if name in parts else {}),
        }
    return result


# ---------------------------------------------------------------------------------------------------- codec vs compute
def codec_fraction(cfg: ModelConfig, device: torch.device, batch_size: int, repeats: int) -> dict:
    """A middle stage (or stage 0 of a 1-stage model) per microbatch: compute vs the codec work its server does."""
    index = min(1, cfg.n_stages - 1)
    stage = Stage(cfg, index).to(device).train()
    if index == 0:
        raise SystemExit("codec fraction needs a model with >= 2 stages")
    x = torch.randn(batch_size, cfg.max_seq_len, cfg.d_model, device=device)
    g = torch.randn_like(x) * 1e-3
    is_last = index == cfg.n_stages - 1
    labels = torch.randint(0, cfg.vocab_size, (batch_size, cfg.max_seq_len), device=device)

    def compute() -> float:
        t0 = time.perf_counter()
        stage_forward(stage, x)
        if is_last:
            stage_backward(stage, x, labels=labels)
        else:
            stage_backward(stage, x, grad_outputs=g)
        synchronize(device)
        stage.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    fns = {"compute": compute}
    variants = codec_variants(device)
    for name, codec in variants.items():

        def codec_work(codec=codec) -> float:
            t0 = time.perf_counter()
            encs = [encode_tensor("t", x, codec) for _ in range(2)]  # outputs (Forward), grad_inputs (Backward)
            for _ in range(3):  # inputs (Forward), inputs and grad_outputs (Backward)
                decode_tensor(encs[0], device)
            synchronize(device)
            return time.perf_counter() - t0

        fns[name] = codec_work
    times = common.interleaved(fns, repeats, warmup=1)
    return {
        "stage": index,
        "batch_size": batch_size,
        "device": str(device),
        "compute_seconds": common.summary(times["compute"]),
        "codec": {
            name: {
                "seconds": common.summary(times[name]),
                "fraction_of_compute": common.summary(common.per_round_ratio(times[name], times["compute"])),
            }
            for name in variants
        },
    }


def main(argv: list[str] | None = None) -> dict:
    p = common.parser(__doc__.split("\n\n")[0], device=True)
    p.add_argument(
        "--preset",
        default=None,
        choices=sorted(PRESETS),
        help="model (default: local_debug on CPU, " "gpt_1b_4stages on GPU)",
    )
    p.add_argument("--batch-size", type=int, default=None, help="samples per microbatch (default: 8 CPU, 4 GPU)")
    p.add_argument("--seq-len", type=int, default=None, help="override the preset's max_seq_len")
    args = p.parse_args(argv)
    device = resolve_device(args.device)
    repeats = args.repeats or (7 if args.quick else 21)
    cfg = pick_model(args.preset, device, args.seq_len)
    batch_size = args.batch_size or (4 if device.type == "cuda" else 8)
    torch.manual_seed(0)
    common.log(f"bench_wire on {device}: model {cfg}, batch {batch_size}, {repeats} rounds")

    wire = asyncio.run(bytes_per_microbatch(cfg, device, batch_size))
    speed = codec_speed(device, repeats)
    frac = codec_fraction(cfg, device, batch_size, repeats)

    classes = [c for c in wire["none"] if c != "tokens"]
    rows = []
    for cls in classes:
        fp32 = wire["none"][cls]["wire"]  # codec none sends fp32: its bytes are the fp32 reference
        fp16 = wire["fp16"][cls]["wire"]
        for name in CODECS:
            if cls not in wire[name]:  # no hivemind codec of this name: the all-reduce takes whole-tensor codecs
                continue
            w = wire[name][cls]["wire"]
            rows.append([f"{fp32 / w:.3f}x", f"{fp16 / w:.3f}x", cls, name, f"{w / 1e6:.3f}"])
    if "tokens" in wire["none"]:
        rows.append(
            ["1.000x", "-", "tokens (ids, labels: always raw)", "all", f"{wire['none']['tokens']['wire'] / 1e6:.3f}"]
        )
    common.table(
        f"bytes per microbatch (batch {batch_size}, {cfg.n_stages} stages, d_model {cfg.d_model}, seq "
        f"{cfg.max_seq_len}); headers included",
        ["fp32/this", "fp16/this", "traffic class", "codec", "MB"],
        rows,
    )
    b8 = {c: wire["none"][c]["wire"] / wire["blockwise8"][c]["wire"] for c in classes}
    ours = [v for c, v in b8.items() if "hivemind" not in c]
    verdict = "meets" if min(ours) >= TARGET_8BIT else "falls short of"
    print(
        f"blockwise8 (swarm codec): {min(ours):.3f}x-{max(ours):.3f}x fewer bytes than fp32 per class; {verdict} the "
        f"target {TARGET_8BIT}x" + "".join(f"; {c}: {v:.3f}x" for c, v in b8.items() if "hivemind" in c)
    )

    rows = []
    for name, v in speed["variants"].items():
        rows.append(
            [
                common.fmt(v["time_vs_copy"]),
                name,
                common.fmt(v["gb_per_s"]),
                common.fmt(v["seconds"], scale=1e3),
                common.fmt(v["encode"], scale=1e3) if "encode" in v else "-",
                common.fmt(v["decode"], scale=1e3) if "decode" in v else "-",
            ]
        )
    common.table(
        f"codec encode+decode of {list(ACTIVATION_SHAPE)} fp32 on {device}: median [min-max] of {repeats} "
        "interleaved rounds",
        ["time/copy", "variant", "GB/s", "ms", "encode ms", "decode ms"],
        rows,
    )

    rows = [
        [
            common.fmt(c["fraction_of_compute"], scale=100),
            name,
            common.fmt(c["seconds"], scale=1e3),
            common.fmt(frac["compute_seconds"], scale=1e3),
        ]
        for name, c in frac["codec"].items()
    ]
    common.table(
        f"codec work of a middle server per microbatch (3 decodes + 2 encodes) vs its compute, on {device}",
        ["% of compute", "codec", "codec ms", "fwd+bwd ms"],
        rows,
    )

    result = {
        "benchmark": "wire",
        "hardware": common.hardware(),
        "model": dataclasses.asdict(cfg),
        "batch_size": batch_size,
        "repeats": repeats,
        "bytes_per_microbatch": wire,
        "blockwise8_fp32_ratio": {**b8, "target": TARGET_8BIT},
        "codec_speed": speed,
        "codec_fraction_of_compute": frac,
    }
    common.write_json(args.out, "wire", result)
    return result


if __name__ == "__main__":
    main()
