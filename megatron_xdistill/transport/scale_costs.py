"""The cost model of the scale simulation (:mod:`.simulate`): model FLOPs, the network, and what
torch.distributed's group creation and collectives cost at a world size. docs/scale.md states
the same numbers and where they come from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_xdistill.transport.counting import DistRecord


@dataclass(frozen=True)
class ModelShape:
    """What the FLOP model needs of a model: active parameters (embeddings and output layer
    included), layers, attention width (heads x head dim), vocabulary."""

    active_params: float
    layers: int
    attention_width: int
    vocab: int


def moe_shape(layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int,
              experts_active: int, moe_intermediate: int, vocab: int,
              num_experts: int) -> ModelShape:
    """A Qwen3-MoE decoder's :class:`ModelShape` from its config.json fields: per layer the
    attention projections (Q and O: hidden x heads x head_dim; K and V: hidden x kv_heads x
    head_dim), the router (hidden x ``num_experts``), the ``experts_active`` routed SwiGLU
    experts a token runs (3 x hidden x ``moe_intermediate`` each), the Q/K norms and the two
    layer norms; untied input embedding and output layer, the final norm."""
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    per_layer = (attention + hidden * num_experts + experts_active * 3 * hidden
                 * moe_intermediate + 2 * head_dim + 2 * hidden)
    active = layers * per_layer + 2 * vocab * hidden + hidden
    return ModelShape(float(active), layers, heads * head_dim, vocab)


#: Public configurations (Hugging Face config.json of each model); the MoE models' active
#: parameters (8 of 128 experts a token) from their config shapes.
MODELS = {
    "llama-3.2-1b": ModelShape(1.24e9, 16, 32 * 64, 128256),
    "llama-3.1-8b": ModelShape(8.03e9, 32, 32 * 128, 128256),
    "qwen3-8b": ModelShape(8.19e9, 36, 32 * 128, 151936),
    "qwen3-32b": ModelShape(32.8e9, 64, 64 * 128, 151936),
    "qwen3-30b-a3b": moe_shape(48, 2048, 32, 4, 128, 8, 768, 151936, num_experts=128),
    "qwen3-235b-a22b": moe_shape(94, 4096, 64, 4, 128, 8, 1536, 151936, num_experts=128),
}


def forward_flops_per_token(model: ModelShape, seq_length: int) -> float:
    """2 x active parameters (the matmuls) + causal attention: QK^T and AV, 2 x 2 x width FLOPs
    per attended position each, half the sequence attended on average."""
    return 2 * model.active_params + 2 * model.layers * seq_length * model.attention_width


@dataclass(frozen=True)
class CostModel:
    """Stated costs (docs/scale.md).

    * ``peak_flops`` x ``mfu``: per-GPU compute rate (H100 SXM dense BF16, 40 % MFU).
    * ``nic_bytes_per_s``: one GPU's NIC, 400 Gb/s.
    * ``store_op_s``: one TCPStore request seen from a rank (a round trip to the store host).
    * ``store_ops_per_s``: what the one store server answers per second; the world's store
      requests of the construction queue there, so every rank waits for all of them.
    * ``connect_s``: one gloo TCP pair connection.
    * ``ring_step_s``: one step of a ring collective (NCCL's all-gather at small sizes).
    * ``barrier_step_s``: one round of gloo's barrier (log2 rounds).
    * ``nccl_init_s`` + ``nccl_init_per_rank_s`` x n: an NCCL communicator of n ranks (lazy:
      paid at the group's first collective).
    * ``colocated_overhead``: a colocated (synchronous) exchange counts as hidden when it adds at
      most this fraction to the step.
    """

    peak_flops: float = 989e12
    mfu: float = 0.4
    nic_bytes_per_s: float = 400e9 / 8
    store_op_s: float = 200e-6
    store_ops_per_s: float = 50_000.0
    connect_s: float = 100e-6
    ring_step_s: float = 10e-6
    barrier_step_s: float = 50e-6
    nccl_init_s: float = 0.5
    nccl_init_per_rank_s: float = 50e-6
    colocated_overhead: float = 0.05

    @staticmethod
    def store_ops_of_member(backend: str, size: int) -> int:
        """Store requests one member makes to create a group: gloo connects the full mesh at
        creation (publish its addresses once, fetch each peer's: 1 + (n - 1)); NCCL creates
        its communicator lazily, at the first collective (root publishes the unique id, the
        others fetch it: 1)."""
        if size <= 1:
            return 0
        return size if backend == "gloo" else 1

    def collective_s(self, kind: str, size: int) -> float:
        if size <= 1:
            return 0.0
        if kind == "all_gather_object":  # two all-gathers (sizes, then the objects), rings
            return 2 * (size - 1) * self.ring_step_s
        return math.ceil(math.log2(size)) * self.barrier_step_s

    def construction(self, record: DistRecord, world_size: int) -> dict:
        """Modelled seconds of one rank's construction beyond its Python time (JSON-ready)."""
        own_ops = sum(self.store_ops_of_member(g.backend, len(g.ranks))
                      for g in record.member_groups)
        # Every rank enters every group: the world's requests of the gloo groups (created now;
        # the NCCL ones are lazy) follow from the groups this rank saw.
        world_ops = sum(len(g.ranks) * self.store_ops_of_member("gloo", len(g.ranks))
                        for g in record.groups if g.backend == "gloo")
        connects = sum(len(g.ranks) - 1 for g in record.member_groups if g.backend == "gloo")
        collectives = sum(self.collective_s(c.kind, c.group_size) for c in record.collectives)
        nccl = [len(g.ranks) for g in record.member_groups
                if g.backend == "nccl" and len(g.ranks) > 1]
        modelled = (own_ops * self.store_op_s + world_ops / self.store_ops_per_s
                    + connects * self.connect_s + collectives)
        return {"store_ops": own_ops, "world_store_ops": world_ops, "gloo_connects": connects,
                "collectives_s": round(collectives, 4), "modelled_s": round(modelled, 4),
                "nccl_communicators": len(nccl),
                "first_use_nccl_init_s": round(sum(self.nccl_init_s + self.nccl_init_per_rank_s
                                                   * n for n in nccl), 2)}
