"""Megatron GPTModel builders and layer specs (torch-native everywhere, TE when installed)."""

from megatron_xdistill import mcore_compat

mcore_compat.install()
