"""Which rank runs where, and the torchrun environment each rank gets (pure functions, no Ray)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

# Variables the launcher owns: never forwarded from the driver, always set per rank.
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS")
# Driver variables that reach every rank by default (the rest only with --env NAME).
FORWARDED_PREFIXES = ("NCCL_", "TORCH_", "PYTORCH_", "CUDA_DEVICE_MAX_CONNECTIONS", "HF_",
                      "TRANSFORMERS_", "TOKENIZERS_", "XDISTILL_", "GLOO_", "OMP_NUM_THREADS")
# Marks every process a launch starts (actors and their children) so teardown can find them.
LAUNCH_ID_VAR = "XDISTILL_LAUNCH_ID"


@dataclass(frozen=True)
class RankSpec:
    """One rank: its global rank, the node (placement group) it belongs to and its place there."""

    rank: int
    group_rank: int
    local_rank: int
    local_world_size: int
    world_size: int
    num_nodes: int


def assign_ranks(num_nodes: int, ranks_per_node: int) -> list[RankSpec]:
    """Ranks ordered by node: node g (placement group g) holds ranks g*R .. g*R + R-1.

    Bundle b of node g's placement group runs local rank b, so node-local ranks are contiguous.
    """
    if num_nodes < 1 or ranks_per_node < 1:
        raise ValueError(f"need at least one node and one rank per node, got {num_nodes} x "
                         f"{ranks_per_node}")
    world = num_nodes * ranks_per_node
    return [RankSpec(rank=g * ranks_per_node + b, group_rank=g, local_rank=b,
                     local_world_size=ranks_per_node, world_size=world, num_nodes=num_nodes)
            for g in range(num_nodes) for b in range(ranks_per_node)]


def rank_env(spec: RankSpec, master_addr: str, master_port: int, restart_count: int = 0,
             max_restarts: int = 0) -> dict[str, str]:
    """The environment torchrun would give this rank."""
    return {
        "RANK": str(spec.rank),
        "WORLD_SIZE": str(spec.world_size),
        "LOCAL_RANK": str(spec.local_rank),
        "LOCAL_WORLD_SIZE": str(spec.local_world_size),
        "GROUP_RANK": str(spec.group_rank),
        "GROUP_WORLD_SIZE": str(spec.num_nodes),
        "ROLE_RANK": str(spec.rank),
        "ROLE_WORLD_SIZE": str(spec.world_size),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "TORCHELASTIC_RESTART_COUNT": str(restart_count),
        "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
    }


def visible_devices(gpu_ids_by_local_rank: Sequence[Sequence[str]]) -> str | None:
    """``CUDA_VISIBLE_DEVICES`` for every rank of one node, or None without GPUs.

    Ray gives each actor only its own GPU; torchrun ranks see all of the node's GPUs and pick
    device ``LOCAL_RANK``. Listing the node's GPUs in local-rank order restores that (and lets
    same-node ranks use CUDA IPC / NVLink peer access).
    """
    ids = [gpu for per_rank in gpu_ids_by_local_rank for gpu in per_rank]
    if not ids:
        return None
    if any(len(per_rank) != 1 for per_rank in gpu_ids_by_local_rank):
        raise ValueError(f"expected one GPU per rank, got {list(gpu_ids_by_local_rank)}")
    return ",".join(ids)


def forwarded_env(environ: Mapping[str, str], extra: Sequence[str] = ()) -> dict[str, str]:
    """Driver variables every rank gets: the usual prefixes plus ``--env NAME[=VALUE]`` items.

    ``NAME`` alone copies the driver's value (an error when the driver has none). Like torchrun,
    ``OMP_NUM_THREADS`` is 1 unless set; ``PYTHONUNBUFFERED`` keeps streamed logs timely.
    """
    env = {key: value for key, value in environ.items()
           if key.startswith(FORWARDED_PREFIXES) and key not in TORCHRUN_VARS}
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    for item in extra:
        name, sep, value = item.partition("=")
        if not name or name in TORCHRUN_VARS or name == LAUNCH_ID_VAR:
            raise ValueError(f"--env {item!r}: not a name the launcher lets you set")
        if not sep:
            if name not in environ:
                raise ValueError(f"--env {name}: not set in the launcher's environment")
            value = environ[name]
        env[name] = value
    return env


def parse_entry_point(spec: str) -> tuple[str, str]:
    """``module.path:function`` -> (module, function)."""
    module, sep, function = spec.partition(":")
    if not sep or not module or not function.isidentifier():
        raise ValueError(f"entry point {spec!r} is not of the form 'module.path:function'")
    return module, function

