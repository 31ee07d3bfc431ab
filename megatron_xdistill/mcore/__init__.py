"""Megatron-Core on any machine: what ``import megatron.core`` needs without Triton
(:mod:`.importable`, done when the package is imported) and the CPU + gloo adaptations that entry
points switch on with :func:`.compat.install` (a no-op where CUDA is present).

The first stage: every other stage may import it; it imports none of them.
"""
