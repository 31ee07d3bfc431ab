"""What ``import megatron.core`` needs on a machine without Triton, done when the package is
imported so that every module can import Megatron-Core at its top.

Megatron-Core imports Triton at module level in one place it never uses without a GPU (MoE paged
stash, reached from ``import megatron.core``); where Triton is missing a stand-in module that
raises on use takes its place. Megatron's import-time warnings about optional accelerators it
then does without (TE, Apex, absl) are silenced. Nothing else changes here: the adaptations that
change behaviour are :func:`megatron_xdistill.mcore.compat.install`'s, called by entry points.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types
import warnings

_PAGED_STASH = "megatron.core.transformer.moe.ops.paged_stash"


def _stub_triton_paged_stash() -> None:
    """Covers: ``import megatron.core`` -> pipeline_parallel.schedules -> moe.paged_stash, whose
    ops module imports Triton at module level. MoE paged stash is never used on CPU; calling its
    kernels raises."""
    if _PAGED_STASH in sys.modules or importlib.util.find_spec("triton") is not None:
        return
    module = types.ModuleType(_PAGED_STASH)
    module.__spec__ = importlib.machinery.ModuleSpec(_PAGED_STASH, loader=None)
    module.GLOBAL_BLOCK_SIZE = 1024

    def _unavailable(*args, **kwargs) -> None:
        raise RuntimeError("MoE paged stash needs Triton and a CUDA GPU")

    module.paged_stash_copy_kernel = _unavailable
    module.paged_stash_pop_kernel = _unavailable
    module.__all__ = ["GLOBAL_BLOCK_SIZE", "paged_stash_copy_kernel", "paged_stash_pop_kernel"]
    sys.modules[_PAGED_STASH] = module


def _quiet_import_warnings() -> None:
    """Megatron warns at import about optional accelerators (TE, Apex, absl) it then does without;
    on a CPU machine those are expected, so they are silenced (nothing else is)."""
    for pattern in (
        r".*Transformer Engine and Apex are not installed.*",
        r".*Apex is not installed.*",
        r".*absl.logging is not installed.*",
        r".*full scope is deprecated.*",
        r".*CUDA_DEVICE_MAX_CONNECTIONS.*",
        r".*we are deprecating ShardedTensor.*",
    ):
        warnings.filterwarnings("ignore", message=pattern)


def make_megatron_importable() -> None:
    """Idempotent; see the module docstring."""
    _quiet_import_warnings()
    _stub_triton_paged_stash()
