"""Device operations the student-side loss issues per block of positions, per form (CPU is enough).

On a GPU the loss at small sizes is bound by kernel launches, not arithmetic. Every block of positions repeats the same sequence of operations, so the
operations per block (times the number of blocks: ~48 at 16k tokens x 49k vocabulary and the
default 64 MiB blocks) decide that overhead. This counts them with a TorchDispatchMode (each
non-view aten operation is one kernel, or a few, on CUDA), for one and for many blocks of the same
batch: per block = the difference / the difference in blocks; per call = the rest. The counts do
not depend on the machine.

  python benchmarks/bench_loss_launches.py [--forms topk chunk_topk gold full image] [--ce]
      [--gpu-paths] [--forward-grad]

Prints a table and keeps its rows as a result file under ``benchmarks/results/``
(``benchmarks/results.py``); the docs' tables are generated from those files
(``tools/docs_tables.py``).
"""

from __future__ import annotations

import argparse

from results import write_rows
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
    rows = []
    for form in args.forms:
        few_ops, few = count_ops(form, args.ce, 64, args.forward_grad)
        many_ops, many = count_ops(form, args.ce, 16, args.forward_grad)
        if many == few:  # this path takes the call whole (CPU gold: its Numba rows)
            print(f"{form:<12} {'-':>11} {few_ops:>10.0f} {few:>3} (one pass, no blocks)",
                  flush=True)
            rows.append({"form": form, "ops_per_block": None, "ops_per_call": few_ops,
                         "blocks": f"{few}"})
            continue
        per_block = (many_ops - few_ops) / (many - few)
        print(f"{form:<12} {per_block:>11.1f} {few_ops - per_block * few:>10.0f} "
              f"{few:>3}-{many:<3}", flush=True)
        rows.append({"form": form, "ops_per_block": per_block,
                     "ops_per_call": few_ops - per_block * few, "blocks": f"{few}-{many}"})
    write_rows("bench_loss_launches", rows,
               table="gpu_paths" if args.gpu_paths else "cpu_paths",
               params={"ce_fused": args.ce, "forward_grad": args.forward_grad,
                       "gpu_paths": args.gpu_paths})


if __name__ == "__main__":
    main()
