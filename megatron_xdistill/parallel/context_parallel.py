"""Context-parallel (CP) sequence layout helpers: Megatron's load-balanced 2*CP ("zig-zag") order.

With CP = c the sequence is cut into 2c equal chunks; CP rank r holds chunks r and 2c-1-r, so every
rank gets the same share of causal-attention work. These helpers slice a full-sequence tensor into
the local part, give the global positions of the local tokens, and put local parts back together.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def cp_chunk_ids(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """The two sequence chunks (of 2*cp_size) that CP rank ``cp_rank`` holds."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def local_positions(seq_length: int, cp_rank: int, cp_size: int) -> torch.Tensor:
    """Global positions [seq_length // cp_size] of the tokens CP rank ``cp_rank`` holds."""
    if cp_size == 1:
        return torch.arange(seq_length)
    if seq_length % (2 * cp_size):
        raise ValueError(
            f"sequence length {seq_length} must be divisible by 2 * context-parallel size "
            f"({2 * cp_size}) for the load-balanced CP layout"
        )
    chunk = seq_length // (2 * cp_size)
    first, second = cp_chunk_ids(cp_rank, cp_size)
    return torch.cat(
        [torch.arange(first * chunk, (first + 1) * chunk),
         torch.arange(second * chunk, (second + 1) * chunk)]
    )


def slice_for_cp_rank(
    tensor: torch.Tensor, seq_dim: int, cp_rank: int, cp_size: int
) -> torch.Tensor:
    """This CP rank's part of a full-sequence tensor (sequence along ``seq_dim``)."""
    if cp_size == 1:
        return tensor
    index = local_positions(tensor.size(seq_dim), cp_rank, cp_size).to(tensor.device)
    return tensor.index_select(seq_dim, index)


def restore_from_cp_parts(parts: list[torch.Tensor], seq_dim: int) -> torch.Tensor:
    """Inverse of :func:`slice_for_cp_rank`: full-sequence tensor from every CP rank's part."""
    cp_size = len(parts)
    if cp_size == 1:
        return parts[0]
    seq_length = parts[0].size(seq_dim) * cp_size
    order = torch.cat([local_positions(seq_length, r, cp_size) for r in range(cp_size)])
    stacked = torch.cat(parts, dim=seq_dim)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(seq_length)
    return stacked.index_select(seq_dim, inverse.to(stacked.device))


class _AllGatherSequence(torch.autograd.Function):
    """All-gather along dim 0 over a group; backward sums gradients and keeps the local slice.

    Written with all_reduce in backward (not reduce_scatter) because gloo has no reduce_scatter.
    """

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        ctx.rank = dist.get_rank(group)
        ctx.local = tensor.size(0)
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        start = ctx.rank * ctx.local
        return grad[start : start + ctx.local], None


def all_gather_sequence(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along dim 0 (rank order), differentiably."""
    if group is None or dist.get_world_size(group) == 1:
        return tensor
    return _AllGatherSequence.apply(tensor, group)
