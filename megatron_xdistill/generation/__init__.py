"""Generation with the student's own Megatron model, in its training layout (on-policy data).

Stage after ``models`` and ``parallel``, before ``training``: KV-cached sampling
(:func:`generate`), the sampling rules (:class:`SamplingParams`), and the switch of a training
model into decoding (:func:`decoding_mode`).
"""

from megatron_xdistill.generation.decoder import Generation, generate
from megatron_xdistill.generation.decoding_mode import decoding_mode, unwrap
from megatron_xdistill.generation.sampling import SamplingParams, filter_logits, sample_next

__all__ = ["Generation", "SamplingParams", "decoding_mode", "filter_logits", "generate",
           "sample_next", "unwrap"]
