"""``xdistill-lm-eval``: lm-evaluation-harness's command line with this project's backend.

    xdistill-lm-eval --model xdistill --model_args load=CKPT,tokenizer=DIR --tasks hellaswag \\
        --batch_size 8 --output_path results/
    torchrun --nproc-per-node 4 -m megatron_xdistill.evaluation.lm_eval_cli \\
        --model xdistill --model_args load=CKPT,tp=2,pp=2 --tasks path/to/task.yaml

Registers the ``xdistill`` model (:mod:`.lm_eval_backend`), adds this project's tasks
(``xdistill_humaneval``, ``xdistill_humaneval_bpb``) as ``--include_path`` unless one is given,
and hands every argument to ``lm-eval``'s own CLI (``lm-eval run --help`` lists them). Under
torchrun every rank runs the harness; rank 0 of each node prints and writes the results.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    import torch.distributed as dist
    from lm_eval.__main__ import cli_evaluate

    import megatron_xdistill.evaluation.lm_eval_backend  # noqa: F401  registers "xdistill"
    from megatron_xdistill.evaluation.lm_eval_tasks import TASKS_DIR

    args = list(sys.argv[1:] if argv is None else argv)
    if args and not any(a.startswith("--include_path") for a in args) and not set(args) & {
            "-h", "--help"}:
        args += ["--include_path", TASKS_DIR]
    sys.argv = ["xdistill-lm-eval", *args]
    try:
        cli_evaluate()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
