"""Scratch buffers reused across blocks and calls.

The loss works through a few [block, V_local] buffers per block. Keeping them between calls (as
Megatron keeps its global memory buffer) avoids re-faulting fresh pages, which on CPU costs as
much as a pass over the data. Calls run one at a time, so sharing them is safe.

On Linux a CPU buffer of 2 MiB or more starts on a 2 MiB boundary and is advised for
transparent huge pages (``madvise(MADV_HUGEPAGE)``, which the kernel's default ``madvise``
mode of THP waits for): W's sparse products read rows of these buffers at random, one 4 KiB
page a row, and with 4 KiB pages nearly every read missed the TLB (16k tokens, V_s 49,152,
the demo's W, one thread: the two products 1.37-1.46 -> 1.09-1.29 s in-process). A hint: the
kernel may decline it, and no value changes either way.
"""

from __future__ import annotations

import ctypes
import sys

import torch

_BUFFERS: dict[tuple, torch.Tensor] = {}
#: bytes of a transparent huge page (x86-64, aarch64 with 4 KiB base pages)
HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # <sys/mman.h>, Linux


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


_LIBC = _libc()


def _cpu_buffer(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """``numel`` elements, on a huge-page boundary and advised for huge pages where they
    fill one (see the module docstring); a plain ``torch.empty`` elsewhere."""
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    if _LIBC is None or nbytes < HUGE_PAGE:
        return torch.empty(numel, dtype=dtype)
    span = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    raw = torch.empty(span + HUGE_PAGE, dtype=torch.uint8)  # untouched: no page faulted yet
    start = (-raw.data_ptr()) % HUGE_PAGE
    _LIBC.madvise(ctypes.c_void_p(raw.data_ptr() + start), ctypes.c_size_t(span),
                  _MADV_HUGEPAGE)  # a refusal (EINVAL without THP) leaves 4 KiB pages
    return raw[start: start + nbytes].view(dtype)


def scratch(name: str, numel: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A flat buffer of ``numel`` elements named ``name`` (contents undefined)."""
    key = (name, torch.device(device), dtype)
    buf = _BUFFERS.get(key)
    if buf is None or buf.numel() < numel:
        _BUFFERS.pop(key, None)
        if torch.device(device).type == "cpu":
            buf = _cpu_buffer(numel, dtype)
        else:
            buf = torch.empty(numel, device=device, dtype=dtype)
        _BUFFERS[key] = buf
    return buf[:numel]
