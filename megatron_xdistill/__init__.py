"""megatron-xdistill: cross-tokenizer knowledge distillation on Megatron-Core."""

__version__ = "0.1.0"
