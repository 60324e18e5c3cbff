"""Small host lists onto the device without stopping the host.

`torch.tensor(values, device="cuda")` is a blocking copy: torch synchronizes the stream after it,
so the host waits for every kernel queued before (the whole forward) and then launches the rest of
the step one kernel at a time behind an idle GPU. A step waits for the device once, when it reads
its sampled ids back; what it sends on the way goes from pinned memory, non_blocking (torch's
pinned-memory cache keeps the block until the copy has read it).
"""
from __future__ import annotations

import torch


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A list (or nested lists) of numbers as a tensor on `device`, without a host sync."""
    return host_to_device(torch.tensor(values, dtype=dtype), device)


def host_to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`, without a host sync."""
    return host if device.type == "cpu" else host.pin_memory().to(device, non_blocking=True)
