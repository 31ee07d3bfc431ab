"""Each form's student-side kernel: a block of positions to per-chunk-row raw sums, the KL
from them and the gradient back onto the block's logits. P-KL on teacher columns or on all of
V_t (:mod:`.pkl`), the exact form from an image payload (:mod:`.image`, W on its image:
:mod:`.image_projection`), gold / H-KL (:mod:`.gold`). Each is torch operations on any device,
handing its passes to the CPU backend (:mod:`cpu`) or the GPU's
(:mod:`gpu`) where those serve."""
