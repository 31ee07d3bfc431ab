"""Collectives the losses use, tolerant of ``group=None`` / a single process (size 1: no-ops).

The two autograd wrappers are for values that every rank of the group then uses identically
(the per-chunk KL after a TP reduction is the same on every TP rank): the gradient of such a
replicated result with respect to this rank's contribution is the result's own gradient (sum) or
this rank's slice of it (gather), with no communication in backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

Group = dist.ProcessGroup | None


def group_size(group: Group) -> int:
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def group_rank(group: Group) -> int:
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 0
    return dist.get_rank(group)


def all_reduce(tensor: torch.Tensor, group: Group, op: str = "sum") -> torch.Tensor:
    """In-place all-reduce ("sum" | "max") of a contiguous tensor; returns it."""
    if group_size(group) > 1:
        reduce_op = dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX
        dist.all_reduce(tensor, op=reduce_op, group=group)
    return tensor


def all_gather(tensor: torch.Tensor, group: Group) -> list[torch.Tensor]:
    """Every rank's ``tensor`` (same shape on all ranks), in rank order."""
    if group_size(group) == 1:
        return [tensor]
    tensor = tensor.contiguous()
    parts = [torch.empty_like(tensor) for _ in range(group_size(group))]
    dist.all_gather(parts, tensor, group=group)
    return parts


class _ReplicatedSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: Group) -> torch.Tensor:
        return all_reduce(tensor.detach().clone().contiguous(), group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _ReplicatedGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
        ctx.dim, ctx.rank, ctx.size = dim, group_rank(group), tensor.shape[dim]
        return torch.cat(all_gather(tensor.detach(), group), dim=dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.narrow(ctx.dim, ctx.rank * ctx.size, ctx.size), None, None


def replicated_sum(tensor: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum over the group, differentiable for a result every rank uses identically."""
    if group_size(group) == 1:
        return tensor
    return _ReplicatedSum.apply(tensor, group)


def replicated_gather(tensor: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """Concatenation over the group along ``dim``, differentiable likewise."""
    if group_size(group) == 1:
        return tensor
    return _ReplicatedGather.apply(tensor, group, dim)
