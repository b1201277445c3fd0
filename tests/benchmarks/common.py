"""What every benchmark shares: flags, the hardware it ran on, interleaved timing, medians with their spread, tables on
stdout, JSON (and optional PNG) under `--out`, progress on stderr.

Timing rule (the machine is shared): the variants being compared run interleaved, one round at a time with the order
rotated each round, and a ratio is taken per round before its median, so that load which comes and goes hits both.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import socket
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from pathlib import Path

import torch


def parser(description: str, device: bool = False) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="a smaller grid and fewer repeats: about a minute")
    p.add_argument("--out", default="bench-results", help="folder for JSON and PNG results (default: bench-results)")
    p.add_argument("--repeats", type=int, default=None, help="interleaved rounds (default: depends on --quick)")
    if device:
        p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="where stages run")
    return p


def exit_on_sigterm() -> None:
    """SIGTERM (e.g. from run_all's timeout) unwinds like Ctrl+C, so every `finally` and context manager runs."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def hardware() -> dict:
    cpu = platform.processor() or "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    info = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "load_average_1m_at_start": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    with contextlib.suppress(ImportError):
        import grpc

        info["grpcio"] = grpc.__version__
    return info


def machine_cpu_seconds() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, all cores, from /proc/stat ((nan, nan) elsewhere).
    Two readings tell how loaded the machine was in between, whoever loaded it."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return float("nan"), float("nan")
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])  # guest time is already counted in user
    tick = os.sysconf("SC_CLK_TCK")
    return (total - idle) / tick, total / tick


def summary(values: Sequence[float]) -> dict:
    """Median and spread (min, max, inter-quartile range) of repeated measurements."""
    xs = sorted(values)
    if not xs:
        return {"median": float("nan"), "min": float("nan"), "max": float("nan"), "iqr": float("nan"), "n": 0}
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
    return {"median": statistics.median(xs), "min": xs[0], "max": xs[-1], "iqr": q[2] - q[0], "n": len(xs)}


def fmt(s: dict, digits: int = 3, scale: float = 1.0) -> str:
    """'median [min-max]' of a summary."""
    if not s.get("n"):
        return "-"
    m, lo, hi = s["median"] * scale, s["min"] * scale, s["max"] * scale
    if s["n"] == 1:
        return f"{m:.{digits}g}"
    return f"{m:.{digits}g} [{lo:.{digits}g}-{hi:.{digits}g}]"


def interleaved(fns: dict[str, Callable[[], float | None]], repeats: int, warmup: int = 1) -> dict[str, list[float]]:
    """Seconds per call of each variant, `repeats` rounds, each round running every variant once in an order rotated
    by one per round. A function may return its own measured seconds (else the wall time of the call is used)."""
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            start = time.perf_counter()
            measured = fns[name]()
            times[name].append(measured if measured is not None else time.perf_counter() - start)
    return times


async def ainterleaved(
    fns: dict[str, Callable[[], Awaitable[float | None]]], repeats: int, warmup: int = 1
) -> dict[str, list[float]]:
    """`interleaved` for coroutine functions."""
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            await fns[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            start = time.perf_counter()
            measured = await fns[name]()
            times[name].append(measured if measured is not None else time.perf_counter() - start)
    return times


def per_round_ratio(a: Sequence[float], b: Sequence[float]) -> list[float]:
    return [x / y for x, y in zip(a, b, strict=True) if y > 0]


def table(title: str, header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    rows = [[str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))
    out = [f"\n== {title} ==", line, "-" * len(line)]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    text = "\n".join(out)
    print(text, flush=True)
    return text


def write_json(out_dir: str, name: str, payload: dict) -> Path:
    path = Path(out_dir)
    path.mkdir(parents=True, exist_ok=True)
    path = path / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2, default=str))
    log(f"wrote {path}")
    return path


def pyplot():
    """matplotlib's pyplot with a file-only backend, or None when matplotlib is not installed (plots are optional)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed: no plots (pip install matplotlib)")
        return None
    return plt


def free_port() -> int:
    """A port that was free a moment ago on 127.0.0.1 (the caller binds it soon after)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate: Callable[[], bool], timeout: float, what: str, poll: float = 0.2) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(poll)
