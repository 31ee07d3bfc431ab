#!/usr/bin/env python
"""Cross-tokenizer knowledge distillation on Megatron-Core.

    torchrun --nproc-per-node N pretrain_xdistill.py --load STUDENT_CKPT --teacher-load TEACHER_CKPT \
        --tokenizer-model STUDENT_TOK --teacher-tokenizer-model TEACHER_TOK \
        --data-path train.jsonl --seq-length 1024 --micro-batch-size 1 --global-batch-size 32 \
        --train-iters 1000 --lr 1e-5 [--tensor-model-parallel-size 2 --teacher-pipeline-model-parallel-size 2 ...]

A disaggregated teacher (teacher ranks apart from student ranks; the teacher computes the next
global batch while the student trains on this one) takes the last N ranks:

    ... --teacher-placement disaggregated --teacher-ranks 4 --teacher-tensor-model-parallel-size 4

Run with --help for every argument.
"""

import sys

if __name__ == "__main__":  # dist_checkpointing starts helper processes: keep this guard
    from megatron_xdistill.training.arguments import parse_command_line

    try:  # --help, usage and config errors at once, before torch is imported
        parse_command_line(sys.argv[1:])
    except ValueError as exc:  # reported once (rank 0), exit code 2
        from megatron_xdistill.training.user_errors import InputError, report

        sys.exit(report(InputError(str(exc))))
    from megatron_xdistill.training.run import main

    sys.exit(main())
