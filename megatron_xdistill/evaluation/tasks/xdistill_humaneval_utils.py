"""The functions the task YAMLs here name (lm-eval's ``!function`` loads this file by path)."""

from megatron_xdistill.evaluation.humaneval import (  # noqa: F401
    bits_per_byte,
    doc_to_solution,
    doc_to_text,
    load_dataset,
    process_bpb,
    process_results,
)
