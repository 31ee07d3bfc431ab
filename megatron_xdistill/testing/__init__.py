"""Test and benchmark support: the multi-rank harness (CPU ranks with gloo)."""
