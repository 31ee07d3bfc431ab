"""Device operations the student-side loss issues per block of positions, per form (CPU is enough).

On a GPU the loss is bound by kernel launches, not arithmetic: on one H200 at 16k tokens the
chunk top-k form ran 6,105 kernels in a forward + backward that kept the GPU busy for 21.7 ms of
its 94 ms (2026-11-26). Every block of positions repeats the same sequence of operations, so the
operations per block (times the number of blocks: ~48 at 16k tokens x 49k vocabulary and the
default 64 MiB blocks) decide that overhead. This counts them with a TorchDispatchMode (each
non-view aten operation is one kernel, or a few, on CUDA), for one and for many blocks of the same
batch: per block = the difference / the difference in blocks; per call = the rest. The counts do
not depend on the machine.

  python benchmarks/bench_loss_launches.py [--forms topk chunk_topk gold full image] [--ce]
      [--gpu-paths] [--forward-grad]

Measured (torch 2.13 CPU, 2026-11-26; 2,048 positions, V_s 4,096, V_t 6,000, k = 64; fused CE;
before = commit 74eaced, after = the W entries expanded once per call (``loss/blocks/block_entries.py``),
per-position label and block-row arithmetic done once per call, no TP reductions with one TP rank;
"after" re-measured at the commit that added ``StudentLossPlan._factor`` (then ``_Plan``)):

  form         ops / block          ops / call
               before   after      before   after
  topk          184.7    20.7        483     300
  chunk_topk    208.6    37.2        566     373
  gold          182.3   103.9       1155    1052
  full          164.5    93.7       1335    1302

GPU paths (``--gpu-paths``, CE fused), 2026-11-27 (commit 3b9a82e): gold 98.8 -> 88.7 and full 93.3 -> 86.6
operations per block when a block's rows are all held by the rank (no CP split: the KL takes
the block's raw sums as they are, no [rows, V] row selections or zero-filled gradients).

On the H200 (16k tokens, V_s 49,152, fp32, k = 256, 64 MiB blocks): chunk top-k 59 -> 30 ms,
top-k 39 -> 26 ms against Megatron CE's 12 ms (bench_loss.py's table).

GPU paths with every Numba choice answered no (2026-11-29; before, gold had taken the CPU's
logits-only blocks here and the exact forms the CPU's Numba rows), CE not fused; before = commit
fbac932, after = the image form's KL and gradient made together by torch operations (no
autograd recompute of the KL), the projection's rows from the blocks' row map and without the
unit factor's product, its backward's <p, h> one batched product with inv_t taken on [rows,
|I|], a block's KL and top-1 sums written into a per-call table, the log-partition written in
place (commit 070b99b); then gold's forward KL and its gradient made together by torch
operations with one TP rank (its means over all columns once, no autograd recompute), its
block gradient without TP's reduction or the unit factor's product with one TP rank;
"forward-written" = ``--forward-grad`` (training's one-teacher call):

  form         ops / block, recomputed     ops / block, forward-written
               before   after              before   after
  topk           19.5    18.5                19.5    18.5
  chunk_topk     36.0    35.0                36.0    35.0
  gold           88.2    69.4                84.0    46.6
  full           86.1    66.5                77.8    61.6
  image          82.7    56.4                74.5    40.5
"""

from __future__ import annotations

import argparse

from torch.utils._python_dispatch import TorchDispatchMode

#: aten operations that only make views (no kernel).
VIEW_OPS = {"slice", "select", "view", "unsqueeze", "expand", "as_strided", "detach", "alias",
            "reshape", "t", "transpose", "permute", "squeeze", "_unsafe_view", "split",
            "_reshape_alias", "unbind", "narrow"}


class OpCount(TorchDispatchMode):
    """Counts the non-view aten operations dispatched inside the ``with`` block."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.softmax = 0  # the forward runs one per block (T = 1)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in VIEW_OPS:
            self.count += 1
        self.softmax += name == "_softmax"
        return func(*args, **(kwargs or {}))


def count_ops(form: str, ce: bool, positions_per_block: int, forward_grad: bool = False
              ) -> tuple[int, int]:
    """(operations, blocks) of one forward + backward of ``form`` with blocks of about
    ``positions_per_block`` positions; ``forward_grad``: the loss's weights given ahead
    (``loss_weights``, training's one-teacher call: the forward writes the gradient)."""
    from megatron_xdistill.loss import parallel_kd_loss, teacher_image
    from megatron_xdistill.loss.definitions.common import (
        common_vocab_from_dense,
        predicting_chunk_id,
    )
    from megatron_xdistill.loss.teacher import payload_spec, teacher_payload
    from megatron_xdistill.testing.synthetic_kd import make_case

    case = make_case(batch=4, ts=512, tt=448, vs=4096, vt=6000, seed=0, realistic=True,
                     normalised_rows=True)
    mode = "gold" if form == "gold" else "pkl"
    common = (None, None) if mode == "pkl" else common_vocab_from_dense(case.projection, mode)
    topk = {"topk": 64, "chunk_topk": 64}.get(form)
    v = case.student_logits.shape[-1]
    image = teacher_image(*case.projection_rows(v), case.vs) if form == "image" else None
    spec = payload_spec(form, case.chunk_valid.shape[1], case.vt, topk=topk,
                        num_common=None if common[0] is None else common[0].numel(),
                        num_image=None if image is None else image.numel())
    payload = teacher_payload(case.teacher_logits, predicting_chunk_id(case.teacher_chunk_id),
                              spec, vocab_size=case.vt, common_teacher_ids=common[1],
                              image_teacher_ids=image)
    logits = case.student_logits.clone().requires_grad_(True)
    with OpCount() as forward:
        terms = parallel_kd_loss(
            logits, payload, predicting_chunk_id(case.student_chunk_id), case.chunk_valid,
            case.chunk_exact, case.projection_rows(v), student_vocab_size=case.vs, mode=mode,
            common_student_ids=common[0], labels=case.labels if ce else None,
            block_bytes=4 * v * positions_per_block,
            loss_weights=(1.0, 1.0) if forward_grad else None)
    loss = terms.kd_sum + terms.ce_sum
    with OpCount() as backward:
        loss.backward()
    return forward.count + backward.count, forward.softmax


def take_gpu_paths() -> None:
    """Where the loss picks its implementation by device, take the one a GPU runs (on CPU
    tensors): every choice of a Numba pass (``numba_takes`` / ``supported``) answered no, so
    the blocks hold their softmax, the exact form takes the sparse-matrix projection, the
    few-slice torch teacher pass and the torch rows, gold ``torch.topk`` and torch's sorted L1.
    The counts then follow the GPU's operation sequence."""
    import torch

    from megatron_xdistill.loss.cpu import exact as exact_rows
    from megatron_xdistill.loss.cpu import rows as cpu_rows
    from megatron_xdistill.loss.cpu import sorted_l1, sorted_top
    from megatron_xdistill.loss.kernels import gold as gold_kernel
    from megatron_xdistill.loss.kernels import image as image_kernel
    from megatron_xdistill.loss.kernels import image_projection
    from megatron_xdistill.loss.kernels import pkl as kernels
    from megatron_xdistill.loss.student import kernel_choice
    from megatron_xdistill.loss.student import plan as student_plan

    def never(t: torch.Tensor) -> bool:
        return False

    for module in (student_plan, gold_kernel, kernel_choice, cpu_rows):
        module.numba_takes = never
    image_kernel._rows_on_cpu = never
    exact_rows.supported = sorted_l1.supported = never
    image_projection.ImageProjection._numba = staticmethod(never)
    rule = kernels.DenseKernel.teacher_rows_per_step.__func__
    kernels.DenseKernel.teacher_rows_per_step = classmethod(
        lambda cls, n, device: rule(cls, n, torch.device("cuda")))
    sorted_top._numba_path = lambda x: False


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--forms", nargs="+", default=["topk", "chunk_topk", "gold", "full"],
                        choices=["topk", "chunk_topk", "gold", "full", "image"])
    parser.add_argument("--ce", action="store_true", help="fuse the next-token CE")
    parser.add_argument("--forward-grad", action="store_true",
                        help="give the loss's weights ahead (loss_weights), as training's "
                             "one-teacher call does: the forward writes the gradient")
    parser.add_argument("--gpu-paths", action="store_true",
                        help="count the operations of the GPU's implementation choices")
    args = parser.parse_args(argv)
    if args.gpu_paths:
        take_gpu_paths()
    print(f"{'form':<12} {'ops / block':>11} {'ops / call':>10} {'blocks':>7}   (CE fused: "
          f"{'yes' if args.ce else 'no'}; {'GPU' if args.gpu_paths else 'CPU'} paths; gradient "
          f"{'by the forward' if args.forward_grad else 'recomputed'})")
    for form in args.forms:
        few_ops, few = count_ops(form, args.ce, 64, args.forward_grad)
        many_ops, many = count_ops(form, args.ce, 16, args.forward_grad)
        per_block = (many_ops - few_ops) / (many - few)
        print(f"{form:<12} {per_block:>11.1f} {few_ops - per_block * few:>10.0f} "
              f"{few:>3}-{many:<3}", flush=True)


if __name__ == "__main__":
    main()
