"""``pretrain_xdistill.py``'s arguments: the parser in Megatron-LM's names (:mod:`.parser`),
Megatron-LM's own flags and habits (:mod:`.megatron_lm`), a YAML file as their defaults
(:mod:`.config_file`) and the checks of their values before anything is built
(:mod:`.checks`, whose ``parse_args`` parses and validates). This package's names are the
parser's; importing it imports nothing heavy (``--help`` answers before torch loads)."""

from megatron_xdistill.training.arguments.parser import (
    KD_LOSSES,
    TOPK_MODES,
    build_parser,
    model_options,
    parse_command_line,
    recompute_options,
    trains_ce_only,
)

__all__ = ["KD_LOSSES", "TOPK_MODES", "build_parser", "model_options", "parse_command_line",
           "recompute_options", "trains_ce_only"]
