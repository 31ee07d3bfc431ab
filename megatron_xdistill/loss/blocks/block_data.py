"""What a loss kernel reads of one block of positions (:class:`BlockData`), its raw sums
(:data:`Raw`), and the helpers that read payload rows by key for every kernel."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_xdistill.loss.gpu import row_softmax

Raw = dict[str, torch.Tensor]


@dataclass
class BlockData:
    """One block of positions. The softmax p over the TP-wide vocabulary of x = logits / T is
    ``probs_local * factor[:, None]`` (this shard's softmax, rescaled)."""

    x: torch.Tensor            # [n, V_real] logits / T
    probs_local: torch.Tensor  # [n, V_real] softmax of x over this shard's columns (forward,
    # kernels with ``takes_unnormalised_softmax`` on CPU: exp(x - max x), 1 / sum in factor)
    factor: torch.Tensor       # [n] exp(shard log-partition - TP-wide log-partition)
    logz: torch.Tensor         # [n] TP-wide log-partition of x
    seg: torch.Tensor          # [n] row within the block, -1 for none
    num_rows: int
    row_start: int             # first row's index among the rank's rows
    seg_dummy: torch.Tensor    # [n] ``seg`` with 'none' = ``num_rows`` (for index_add / gather)
    extra: torch.Tensor | None = None  # [n] this shard's projected mass (tail bucket)
    index: int = 0             # the block's place among the call's blocks
    unit_factor: bool = False  # factor is all ones (one TP rank): kernels may skip it
    # Fused mode (``row_softmax``): no dense softmax; x holds the logits (any dtype, rows
    # possibly strided), probabilities come from x * scale and this shard's log-partitions.
    # CPU kernels that read only the logits (``needs_softmax`` False): probs_local None, x the
    # logits / T, the shard's softmax exp(x - lz_local).
    lz_local: torch.Tensor | None = None  # [n]
    scale: float = 1.0

    def probs_at(self, pos: torch.Tensor, lin: torch.Tensor) -> torch.Tensor:
        """This shard's softmax at flat [n, V_real] indices ``lin`` (of rows ``pos``), in the
        compute dtype (a new tensor)."""
        if self.probs_local is not None:
            return self.probs_local.reshape(-1).index_select(0, lin)
        v = row_softmax.values_at(self.x, lin, pos).to(self.logz.dtype)
        if self.scale != 1.0:
            v.mul_(self.scale)
        return v.sub_(self.lz_local.index_select(0, pos)).exp_()


def rows_of(payload_part: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Rows ``keys`` (flat b * C + c) of a payload part [B, C, ...]. With several samples the
    part is a strided view into the flat payloads: gather the rows, never reshape the whole
    part (a copy of all of it, per call: per block for the full and gold forms)."""
    if payload_part.is_contiguous():
        return payload_part.reshape(-1, *payload_part.shape[2:]).index_select(0, keys)
    chunks = payload_part.shape[1]
    return payload_part[torch.div(keys, chunks, rounding_mode="floor"), keys % chunks]


def row_table(payload_part: torch.Tensor, keys: torch.Tensor, dtype: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(table, row of the table for each key) in ``dtype``, for kernels that read
    payload rows ``keys`` where they lie: the part as a [B * C, ...] view and the keys when it
    is one contiguous table of ``dtype``; else its rows gathered (and converted), in order."""
    if payload_part.is_contiguous() and payload_part.dtype == dtype:
        return payload_part.reshape(-1, *payload_part.shape[2:]), keys
    rows = rows_of(payload_part, keys).to(dtype)
    return rows, torch.arange(rows.shape[0], device=rows.device)


def with_zero_row(t: torch.Tensor) -> torch.Tensor:
    """``t`` with a row of zeros appended: the row that positions of no chunk row index."""
    return torch.cat([t, t.new_zeros(1, *t.shape[1:])], dim=0)


__all__ = ["BlockData", "Raw", "row_table", "rows_of", "with_zero_row"]
