"""Test and benchmark support, not used by the runtime: the multi-rank harness (CPU ranks with
gloo, :mod:`.multirank`), tiny Megatron and Hugging Face models (:mod:`.tiny_gpt`,
:mod:`.tiny_models`) and synthetic logits and alignments for the loss tests
(:mod:`.synthetic_kd`)."""
