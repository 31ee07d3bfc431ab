"""The GPU backend: fused Triton row passes over the student's logits (:mod:`.row_softmax`,
its kernels in :mod:`.triton_rows`) and the one-rounding gradient writer of 16-bit logits
(:mod:`.fused_grad`). Where Triton is missing the kernels' blockwise torch path serves."""
