"""demo stage: the quick-start distillation (``python -m megatron_xdistill.demo``) and the helpers
it shares with ``examples/`` and ``benchmarks/``: fetching the small real models it uses
(:mod:`.assets`), its text corpus (:mod:`.corpus`) and the convert / project / train / evaluate
commands (:mod:`.workflow`). Needs the ``examples`` extra (GGUF reading); the training runtime
does not import it.
"""
