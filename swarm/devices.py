"""Where tensors live. Device handling is explicit: every component takes a `torch.device`, resolved once here."""

from __future__ import annotations

import torch


def resolve_device(name: str) -> torch.device:
    """ "auto" (CUDA if present, else CPU), "cpu", "cuda" or "cuda:N"; raises ValueError, naming --device, for a name
    torch does not know and for a CUDA device this machine does not have."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name}: not a device; give auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available on this machine")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA devices")
    return device


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels, so that a clock read after it times the work and not its launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
