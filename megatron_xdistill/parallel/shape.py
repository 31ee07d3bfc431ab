"""The sizes of one model's parallel layout (TP x CP x PP x DP, and EP within CP x DP) and its
rank order, without torch or Megatron (argument checks use it before either is imported)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelLayout:
    """Sizes of one model's layout. ``dp`` follows from the ranks it spans. ``ep`` (expert
    parallelism, MoE models) splits each stage's CP x DP ranks as Megatron does: the experts are
    spread over EP ranks and replicated over the CP x DP / EP others."""

    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1

    @classmethod
    def for_world(cls, world_size: int, tp: int = 1, cp: int = 1, pp: int = 1,
                  who: str = "model", ranks: str | None = None,
                  fix: str | None = None, ep: int = 1) -> ParallelLayout:
        """Layout that fills ``world_size`` ranks; DP is the rest. The one home of the rule
        (the argument checks use it too): errors say what to change, ``ranks`` naming the ranks
        (e.g. "world size 4 is") and ``fix`` the flags to change, where a caller knows them."""
        for name, size in (("tensor", tp), ("context", cp), ("pipeline", pp), ("expert", ep)):
            if size < 1:
                raise ValueError(f"{who}: {name}-model-parallel size must be >= 1, got {size}")
        model_parallel = tp * cp * pp
        if world_size % model_parallel:
            raise ValueError(
                f"{ranks or f'{who}: world size {world_size} is'} not divisible by the {who}'s "
                f"TP x PP x CP = {tp} x {pp} x {cp}; change "
                f"{fix or f'the {who} layout or the number of ranks'}")
        dp = world_size // model_parallel
        if (cp * dp) % ep:
            raise ValueError(
                f"{who}: expert-model-parallel size {ep} does not divide the CP x DP = {cp} x "
                f"{dp} ranks of each pipeline stage; choose an EP size that divides {cp * dp}")
        return cls(tp=tp, cp=cp, pp=pp, dp=dp, ep=ep)

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    def sequence_multiple(self, sequence_parallel: bool) -> int:
        """What a sequence length must be a multiple of: 2 x CP with context parallelism
        (load-balanced halves), times TP with sequence parallelism."""
        parts = 2 * self.cp if self.cp > 1 else 1
        return parts * self.tp if sequence_parallel else parts

    def coords(self, rank: int) -> dict[str, int]:
        """(tp, cp, dp, pp) coordinates of a rank within this layout (rank relative to offset)."""
        tp = rank % self.tp
        cp = (rank // self.tp) % self.cp
        dp = (rank // (self.tp * self.cp)) % self.dp
        pp = rank // (self.tp * self.cp * self.dp)
        return {"tp": tp, "cp": cp, "dp": dp, "pp": pp}

    def ep_rank(self, rank: int) -> int:
        """Expert-parallel rank of a rank within this layout (Megatron's expert order: TP, EP,
        expert DP, PP; EP spans consecutive CP x DP positions)."""
        return (rank // self.tp) % self.ep
