"""Block size of the student-side loss: how many positions one block of the chunked loss takes.

The loss walks the student's logits block by block (whole chunks a block), so that its
temporaries stay a few [block, V_local] buffers. Small blocks keep memory low and, on a GPU,
make the per-block kernels launch-bound; large ones the reverse. This module holds that trade's
rule and the numbers it was measured with.
"""

from __future__ import annotations

import torch

#: Default size of one block's fp32 [block, V_local] buffer.
BLOCK_BYTES = 64 * 1024 * 1024


#: Accelerators: the share of the logits' bytes that the per-block kernels' buffers may take.
BLOCK_MEMORY_SHARE = 0.10

#: Fewest positions a default block takes (within BLOCK_BYTES): below it the per-block work's
#: fixed cost rules. The exact form on the demo's real W, 128 tokens, 1 CPU thread: 1 position
#: a block (the 1/128 share) 0.255 s forward + backward, 4 positions 0.156 s, 12 0.144 s, 32
#: 0.141 s. Only calls under 32 x 8 (column forms) / 128 x 8 (per-block kernels) positions
#: change, whose buffers are a few MiB (at 1,024 positions the per-block kernels' 12 fp32
#: [8, V] buffers are ~10% of the logits, as the share rule intends).
MIN_BLOCK_POSITIONS = 8


def block_positions(kernel_class: type, num_positions: int, v_local: int, logits_itemsize: int,
                    device: torch.device, block_bytes: int | None = None) -> int:
    """Positions per block: how finely a call is cut (the memory / launches trade).

    ``block_bytes`` given (tests, the block-size benchmark): one block's fp32 [block, V_local]
    buffer of that size (a quarter of it for the per-block kernels), taken as asked. Otherwise
    the default:

    CPU (and the kernels that keep one [block, V] buffer): ``BLOCK_BYTES`` of fp32 and at most
    1/32 of the positions; the per-block kernels (all of V_t, gold / H-KL: several [rows, V]
    temporaries a block) a quarter of that and at most 1/128 of the positions: cache-sized
    blocks, the rule the CPU tables of ``benchmarks/bench_loss.py`` were measured with. Never
    fewer than ``MIN_BLOCK_POSITIONS`` (within the bytes).

    Accelerators, per-block kernels: as many positions as keep their ``block_buffers`` fp32
    [block, V_local] temporaries within ``BLOCK_MEMORY_SHARE`` of the logits, and never fewer
    than the CPU rule. A GPU runs these forms launch-bound (~100 operations a block): on one
    H200 (16k tokens, V_s 49,152, fp32) gold took 378 ms at 85 positions a block and 113 ms at
    682, the exact form 403 and 249 ms, while their extra memory grew 6 and 12 block buffers.
    """
    v = max(v_local, 1)
    shrink = 4 if kernel_class.per_block else 1
    if block_bytes is not None:
        return max(1, block_bytes // (4 * v * shrink))
    share = max(MIN_BLOCK_POSITIONS, -(-num_positions // (32 * shrink)))
    cpu_rule = max(1, min(BLOCK_BYTES // (4 * v * shrink), share))
    if torch.device(device).type == "cpu" or not kernel_class.per_block:
        return cpu_rule
    budget = BLOCK_MEMORY_SHARE * num_positions * v * logits_itemsize
    return max(cpu_rule, int(budget // (4 * v * kernel_class.block_buffers)))


__all__ = ["BLOCK_BYTES", "BLOCK_MEMORY_SHARE", "MIN_BLOCK_POSITIONS", "block_positions"]
