"""Run a collective conversion function on N CPU ranks (gloo) and return rank 0's result.

One rank runs in this process; more are spawned (or, under ``torchrun``, the existing world is
used). Conversion is I/O and memory bound, so it always runs on the CPU with gloo, also on GPU
machines.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def log(message: str) -> None:
    """Progress line from rank 0 only (every process prints when no group exists)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"[xdistill-convert] {message}", flush=True)


def quiet_known_noise() -> None:
    """Silence messages that say nothing about a conversion: GPTModel's deprecation notice, the
    async-save notice, and torch DCP's notes about its own argument order / single process."""
    import logging
    import warnings

    for name in ("megatron.core.models.gpt.gpt_model",
                 "megatron.core.dist_checkpointing.strategies.torch"):
        logging.getLogger(name).setLevel(logging.ERROR)
    for pattern in (r".*torch.distributed is disabled.*", r".*argument order of load.*",
                    r".*async save is deprecated.*"):
        warnings.filterwarnings("ignore", message=pattern)


_GROUPS: dict[tuple, Any] = {}


def layout_groups(tp: int = 1, pp: int = 1, who: str = "conversion", cp: int = 1, ep: int = 1):
    """This world's process groups for TP x CP x PP (DP = the rest; EP within CP x DP for MoE
    models), created once per layout and
    world: every gloo group starts threads, so repeated conversions in one process reuse them.
    Collective on first use for a layout."""
    from megatron_xdistill.parallel.layout import ParallelLayout, build_model_parallel_groups

    world = dist.distributed_c10d._get_default_group()
    key = (id(world), dist.get_world_size(), tp, pp, cp, ep)
    if key not in _GROUPS:
        layout = ParallelLayout.for_world(dist.get_world_size(), tp=tp, cp=cp, pp=pp, who=who,
                                          ep=ep)
        _GROUPS[key] = build_model_parallel_groups(layout)
    return _GROUPS[key]


def _destroy_world() -> None:
    _GROUPS.clear()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _threads_per_rank(world_size: int) -> int:
    return max(1, (os.cpu_count() or 1) // world_size)


def _spawned(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple,
             kwargs: dict, results: Any) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(_threads_per_rank(world_size))
    from megatron_xdistill.mcore import compat as mcore_compat

    mcore_compat.install()
    quiet_known_noise()
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        value = fn(*args, **kwargs)
        if rank == 0:
            results.put(value)
    finally:
        _destroy_world()


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` on ``world_size`` ranks; returns rank 0's value.

    Under torchrun (``WORLD_SIZE`` set) the launched world is used as it is. A rank that fails
    stops all of them and the error (with its traceback) is raised here.
    """
    from megatron_xdistill.mcore import compat as mcore_compat

    mcore_compat.install()
    quiet_known_noise()
    if dist.is_initialized():
        return fn(*args, **kwargs)
    env_world = int(os.environ.get("WORLD_SIZE", "1"))
    if env_world > 1:
        dist.init_process_group("gloo")
        try:
            return fn(*args, **kwargs)
        finally:
            _destroy_world()
    if world_size == 1:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            return fn(*args, **kwargs)
        finally:
            _destroy_world()
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    mp.start_processes(_spawned, args=(world_size, _free_port(), fn, args, kwargs, results),
                       nprocs=world_size, join=True, start_method="spawn")
    return results.get() if not results.empty() else None
