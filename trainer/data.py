"""Training text as bytes. Default corpus: the Python standard library's own source, read at run time, so every
machine with Python has it and nothing is downloaded or committed."""

from __future__ import annotations

import sysconfig
from collections.abc import Iterator
from pathlib import Path

import torch


def _read_tree(root: Path, max_bytes: int, suffixes: tuple[str, ...] | None) -> bytes:
    chunks, total = [], 0
    for path in sorted(root.rglob("*")):
        if not path.is_file() or (suffixes and path.suffix not in suffixes) or "site-packages" in path.parts:
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        if b"\0" in data[:4096]:  # binary
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return b"\n".join(chunks)[:max_bytes]


def load_corpus(path: str | None = None, max_bytes: int = 32 << 20) -> torch.Tensor:
    """(N,) uint8 tensor of text bytes from `path` (a file or a folder of text files), or the standard library."""
    if path is None:
        data = _read_tree(Path(sysconfig.get_paths()["stdlib"]), max_bytes, suffixes=(".py",))
    else:
        p = Path(path)
        if not p.exists():
            raise FileNotFoundError(f"--data {path}: no such file or folder")
        data = p.read_bytes()[:max_bytes] if p.is_file() else _read_tree(p, max_bytes, suffixes=None)
    if len(data) < 1024:
        raise ValueError(f"corpus at {path or 'the standard library'} has only {len(data)} bytes of text")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def microbatches(
    corpus: torch.Tensor, batch_size: int, seq_len: int, seed: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless (tokens, labels), each (batch_size, seq_len) int64, labels shifted by one byte. Seeded."""
    if len(corpus) <= seq_len + 1:
        raise ValueError(f"corpus ({len(corpus)} bytes) is shorter than a sequence ({seq_len + 1})")
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.arange(seq_len + 1)
    while True:
        starts = torch.randint(0, len(corpus) - seq_len - 1, (batch_size, 1), generator=gen)
        window = corpus[starts + offsets].long()  # (B, T + 1)
        yield window[:, :-1].contiguous(), window[:, 1:].contiguous()
