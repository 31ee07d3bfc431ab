"""A model's parallel layout (TP x CP x DP x PP) as its own process-group collection.

The student and the teacher each get a :class:`ModelParallelGroups` built from a Megatron-Core
``HyperCommGrid`` over the same world (colocated) or over a slice of it (``rank_offset``), so the
two models never share Megatron's global ``parallel_state``. Rank order follows Megatron's
default ``tp-cp-ep-dp-pp`` (TP fastest), so node-local ranks share TP groups.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core.hyper_comm_grid import HyperCommGrid
from megatron.core.process_groups_config import ProcessGroupCollection

from megatron_xdistill.parallel.context_parallel import slice_for_cp_rank
from megatron_xdistill.parallel.shape import ParallelLayout

__all__ = ["ModelParallelGroups", "ParallelLayout", "build_model_parallel_groups"]


@dataclass
class ModelParallelGroups:
    """One model's process groups on this rank plus its coordinates in the layout."""

    layout: ParallelLayout
    pg_collection: ProcessGroupCollection
    grid: HyperCommGrid
    rank_offset: int

    @property
    def member(self) -> bool:
        """Whether this rank holds a shard of the model."""
        rank = dist.get_rank() - self.rank_offset
        return 0 <= rank < self.layout.world_size

    @property
    def coords(self) -> dict[str, int]:
        return self.layout.coords(dist.get_rank() - self.rank_offset)

    def cp_local(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's context-parallel share of a full-sequence tensor [b, s, ...] (the one
        rule for tokens, positions, labels and chunk ids alike)."""
        return slice_for_cp_rank(full, 1, self.coords["cp"], self.layout.cp)

    @property
    def ep_rank(self) -> int:
        """This rank's expert-parallel rank (0 without expert parallelism)."""
        return self.layout.ep_rank(dist.get_rank() - self.rank_offset)

    @property
    def is_first_stage(self) -> bool:
        return self.coords["pp"] == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coords["pp"] == self.layout.pp - 1


def _embedding_groups(grid: HyperCommGrid, layout: ParallelLayout) -> tuple:
    """Groups tying the first and last pipeline stage (word embeddings) and the first stage alone
    (position embeddings), as Megatron's parallel_state builds them."""
    pp_ranks = grid.get_rank_enum("pp")
    embd_ranks = [[r[0], r[-1]] if len(r) > 1 else [r[0]] for r in pp_ranks]
    pos_ranks = [[r[0]] for r in pp_ranks]
    embd, _ = dist.new_subgroups_by_enumeration(embd_ranks, backend=grid.backend)
    pos_embd, _ = dist.new_subgroups_by_enumeration(pos_ranks, backend=grid.backend)
    return embd, pos_embd


def _expert_groups(pgs: ProcessGroupCollection, layout: ParallelLayout, rank_offset: int) -> None:
    """Expert-parallel groups as Megatron-Core's parallel_state makes them: a second grid over
    the same ranks, TP (= expert TP) x EP x expert DP x PP, where EP x expert DP spans each
    stage's CP x DP ranks."""
    expert = HyperCommGrid(
        [layout.tp, layout.ep, layout.cp * layout.dp // layout.ep, layout.pp],
        ["tp", "ep", "dp", "pp"],
        rank_offset=rank_offset,
    )
    pgs.ep = expert.create_pg("ep")
    pgs.expt_dp = expert.create_pg("dp")
    pgs.intra_expt_dp = pgs.expt_dp_gtp_remat = pgs.expt_dp
    pgs.tp_ep = expert.create_pg(["tp", "ep"])
    pgs.tp_ep_pp = expert.create_pg(["tp", "ep", "pp"])


def build_model_parallel_groups(layout: ParallelLayout, rank_offset: int = 0) -> ModelParallelGroups:
    """Create every process group a GPTModel (dense or MoE), its DDP wrapper, optimizer and
    schedules use.

    Collective: every rank of the world must call this with the same arguments, in the same order
    relative to other group creation (torch.distributed.new_group semantics).
    """
    grid = HyperCommGrid(
        [layout.tp, layout.cp, 1, layout.dp, layout.pp],
        ["tp", "cp", "ep", "dp", "pp"],
        rank_offset=rank_offset,
    )
    pgs = ProcessGroupCollection()
    pgs.tp = grid.create_pg("tp")
    pgs.cp = grid.create_pg("cp")
    pgs.pp = grid.create_pg("pp")
    pgs.ep = grid.create_pg("ep")
    pgs.dp = grid.create_pg("dp")
    pgs.dp_cp = grid.create_pg(["cp", "dp"])
    pgs.tp_cp = grid.create_pg(["tp", "cp"])
    pgs.tp_dp = grid.create_pg(["tp", "dp"])
    pgs.tp_dp_cp = grid.create_pg(["tp", "cp", "dp"])
    pgs.mp = grid.create_pg(["tp", "pp"])
    pgs.tp_ep_pp = grid.create_pg(["tp", "ep", "pp"])
    pgs.tp_ep = grid.create_pg(["tp", "ep"])
    pgs.expt_tp = pgs.tp
    pgs.expt_dp = pgs.dp_cp
    pgs.intra_dp_cp = pgs.dp_cp
    pgs.intra_expt_dp = pgs.dp_cp
    pgs.dp_cp_gtp_remat = pgs.dp_cp  # no GTP weight rematerialisation
    pgs.expt_dp_gtp_remat = pgs.expt_dp
    if layout.ep > 1:
        _expert_groups(pgs, layout, rank_offset)
    # One distributed-optimizer instance spanning the layout: its grad-norm / zero-count group.
    pgs.intra_dist_opt = grid.create_pg(["tp", "cp", "ep", "dp", "pp"])
    pgs.embd, pgs.pos_embd = _embedding_groups(grid, layout)
    return ModelParallelGroups(layout=layout, pg_collection=pgs, grid=grid, rank_offset=rank_offset)
