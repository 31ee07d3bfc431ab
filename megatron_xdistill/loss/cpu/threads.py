"""How the loss's Numba kernels run on a CPU: which tensors they take, how many threads, which
thread pool. Every module with a Numba kernel imports this first, so the pool is chosen before
the first parallel loop runs.
"""

from __future__ import annotations

import os

import numba
import torch

# Numba's OpenMP layer keeps its threads spinning after each parallel loop (a rank that should use
# one core uses two) and shares the OpenMP runtime with torch; its own thread pool does neither.
if "NUMBA_THREADING_LAYER" not in os.environ:
    numba.config.THREADING_LAYER = "workqueue"


def use_torch_threads() -> int:
    """Numba's parallel loops take as many threads as torch (one per rank on a shared CPU);
    returns that number (for loops that split their rows over the threads themselves)."""
    threads = max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
    numba.set_num_threads(threads)
    return threads


def numba_takes(t: torch.Tensor) -> bool:
    """Whether the loss's Numba kernels take ``t`` (a CPU float32 / float64 tensor)."""
    return t.device.type == "cpu" and t.dtype in (torch.float32, torch.float64)


__all__ = ["numba_takes", "use_torch_threads"]
