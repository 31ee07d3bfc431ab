"""What a launch is: nodes x ranks, the entry point and its arguments, restarts, timeouts."""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass, field

DEFAULT_ENTRY_POINT = "megatron_xdistill.training.run:main"


@dataclass
class LaunchConfig:
    """A job: N nodes x R ranks, each rank calling ``entry_point(entry_args)``."""

    num_nodes: int
    ranks_per_node: int
    entry_args: list[str] = field(default_factory=list)
    gpus_per_rank: int = 0
    cpus_per_rank: float = 1.0
    entry_point: str = DEFAULT_ENTRY_POINT
    max_restarts: int = 0
    master_port: int | None = None
    env: dict[str, str] = field(default_factory=dict)  # for every rank (see layout.forwarded_env)
    working_dir: str | None = field(default_factory=os.getcwd)
    launch_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    placement_timeout_s: float = 600.0
    startup_timeout_s: float = 600.0
    failure_grace_s: float = 3.0  # after a failure, how long to collect the others'
    stop_timeout_s: float = 30.0

    def actor_name(self, rank: int) -> str:
        """Name of rank ``rank``'s actor (in the driver's Ray namespace)."""
        return f"xdistill-{self.launch_id}-rank{rank}"
