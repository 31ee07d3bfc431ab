"""Scratch buffers reused across blocks and calls.

The loss works through a few [block, V_local] buffers per block. Keeping them between calls (as
Megatron keeps its global memory buffer) avoids re-faulting fresh pages, which on CPU costs as
much as a pass over the data. Calls run one at a time, so sharing them is safe.
"""

from __future__ import annotations

import torch

_BUFFERS: dict[tuple, torch.Tensor] = {}


def scratch(name: str, numel: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A flat buffer of ``numel`` elements named ``name`` (contents undefined)."""
    key = (name, torch.device(device), dtype)
    buf = _BUFFERS.get(key)
    if buf is None or buf.numel() < numel:
        _BUFFERS.pop(key, None)
        buf = _BUFFERS[key] = torch.empty(numel, device=device, dtype=dtype)
    return buf[:numel]
