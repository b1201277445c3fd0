"""Where tensors live. Device handling is explicit: every component takes a `torch.device`, resolved once here."""

from __future__ import annotations

import torch


def resolve_device(name: str) -> torch.device:
    """ "auto" (CUDA if present, else CPU), "cpu", "cuda" or "cuda:N"; raises ValueError if CUDA is asked for and absent."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available on this machine")
    return device


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels, so that a clock read after it times the work and not its launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
