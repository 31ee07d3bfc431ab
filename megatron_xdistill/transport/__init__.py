"""transport stage of megatron-xdistill (see DESIGN.md)."""
