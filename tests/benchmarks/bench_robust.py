"""Robust aggregation (`--robust-clip`): what the CenteredClip reducer costs a stage's all-reduce, and what it buys.

Cost: the seconds a reducer spends on one round of its share, hivemind's weighted mean against ClippedPartReducer,
for groups of n senders and hivemind's part sizes (2^19 bytes: 131072 values uncompressed, about 4x that 8-bit),
interleaved (clip 1). The bytes sent do not change. Benefit: with one of the n senders sending garbage (huge values, a
flipped and scaled gradient, heavy noise), the error of each mean against the honest peers' weighted mean,
relative to that mean's norm. Honest gradients are a shared signal plus per-peer noise twice its size, as
microbatch gradients are.

    python -m tests.benchmarks.bench_robust [--quick] [--repeats R]
"""

from __future__ import annotations

import asyncio
import functools

import torch
from hivemind.averaging.partition import TensorPartReducer

from server.collab.compat.runner import ClippedPartReducer
from tests.benchmarks import common

CLIPS = (1.0, 2.0)  # --robust-clip factors: the one its help suggests, and a looser one


async def reduce(reducer: TensorPartReducer, senders: list[list[torch.Tensor]], weights: list[float]) -> torch.Tensor:
    """Every sender streams its parts, as hivemind's runner does; returns the reduced parts, concatenated."""

    async def stream(i: int) -> list[torch.Tensor]:
        return [await reducer.accumulate_part(i, k, part, weight=weights[i]) for k, part in enumerate(senders[i])]

    reduced = await asyncio.gather(*(stream(i) for i in range(len(senders))))
    return torch.cat(reduced[0])


async def reduce_with(robust: bool, part: int, n_parts: int, senders: list[list[torch.Tensor]], weights: list[float]):
    await reduce(make_reducer(robust, part, n_parts, len(senders)), senders, weights)


def make_reducer(robust: bool, part: int, n_parts: int, n: int, clip: float = CLIPS[0]) -> TensorPartReducer:
    shapes = [torch.Size([part])] * n_parts
    return ClippedPartReducer(shapes, n, clip) if robust else TensorPartReducer(shapes, n)


def gradients(n: int, values: int, gen: torch.Generator) -> list[torch.Tensor]:
    signal = torch.randn(values, generator=gen)
    return [signal + 2 * torch.randn(values, generator=gen) for _ in range(n)]


ATTACKS = {
    "none": None,
    "huge values (1e4)": lambda honest: torch.full_like(honest[0], 1e4),
    "flipped, 10x": lambda honest: -10 * torch.stack(honest).mean(0),
    "noise, 100x": lambda honest: 100 * torch.randn_like(honest[0]),
}


async def run(args) -> dict:
    repeats = args.repeats or (3 if args.quick else 7)
    groups = [3, 4] if args.quick else [3, 4, 8]
    part_sizes = [131072] if args.quick else [131072, 524288]
    n_parts = 8
    gen = torch.Generator().manual_seed(0)
    cost_rows, cost = [], {}
    for n in groups:
        for part in part_sizes:
            senders = [list(g.split(part)) for g in gradients(n, part * n_parts, gen)]
            weights = [float(i + 1) for i in range(n)]

            variants = {
                name: functools.partial(reduce_with, robust, part, n_parts, senders, weights)
                for name, robust in (("mean", False), ("robust", True))
            }
            times = await common.ainterleaved(variants, repeats)
            per_mvalue = {k: common.summary([t / (part * n_parts / 1e6) for t in v]) for k, v in times.items()}
            ratio = common.summary(common.per_round_ratio(times["robust"], times["mean"]))
            cost[f"n={n}, part={part}"] = {"ms_per_million_values": per_mvalue, "robust_vs_mean": ratio}
            cost_rows.append(
                [
                    n,
                    part,
                    common.fmt(per_mvalue["mean"], scale=1e3),
                    common.fmt(per_mvalue["robust"], scale=1e3),
                    common.fmt(ratio),
                ]  # fmt: skip
            )
            common.log(f"n={n}, part={part}: robust / mean {ratio['median']:.2f}")
    common.table(
        f"reducer time per round, ms per million values of the reducer's share (median [min-max] of {repeats})",
        ["senders", "part values", "weighted mean", "robust (CenteredClip)", "robust / mean"],
        cost_rows,
    )

    quality_rows, quality = [], {}
    values = 131072 * 4
    for n in groups:
        for attack, make in ATTACKS.items():
            honest = gradients(n - (make is not None), values, gen)
            sent = [*honest, make(honest)] if make is not None else honest
            target = torch.stack(honest).mean(0)
            errors = {"one honest peer": ((honest[0] - target).norm() / target.norm()).item()}
            for clip in (0.0, *CLIPS):
                reducer = make_reducer(clip > 0, 131072, 4, n, clip)
                got = await reduce(reducer, [list(s.split(131072)) for s in sent], [1.0] * n)
                errors[f"robust, clip {clip:g}" if clip else "mean"] = ((got - target).norm() / target.norm()).item()
            quality[f"n={n}, {attack}"] = errors
            quality_rows.append([n, attack, *(f"{e:.3g}" for e in errors.values())])
    common.table(
        "error against the honest peers' mean, relative to its norm (one of n senders attacks; equal weights); for "
        "scale, one honest peer's own gradient",
        ["senders", "attack", "one honest peer", "weighted mean", *(f"robust, clip {c:g}" for c in CLIPS)],
        quality_rows,
    )
    return {"cost": cost, "quality": quality}


def main(argv: list[str] | None = None) -> dict:
    p = common.parser(__doc__.split("\n\n")[0])
    args = p.parse_args(argv)
    common.exit_on_sigterm()
    torch.set_num_threads(1)  # an averager's reducer shares the machine with the stage's compute
    result = asyncio.run(run(args))
    payload = {"benchmark": "robust", "hardware": common.hardware(), "clips": CLIPS, **result}
    common.write_json(args.out, "robust", payload)
    return payload


if __name__ == "__main__":
    main()
