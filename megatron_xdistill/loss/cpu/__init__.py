"""The CPU backend: Numba passes over CPU float32 / float64 tensors, one module per form's
work (:mod:`.exact` the full payload's rows, :mod:`.image_rows` / :mod:`.image_block` /
:mod:`.image_projection` the image form, :mod:`.gold_rows` / :mod:`.gold_block` /
:mod:`.sorted_top` / :mod:`.sorted_l1` gold and H-KL), on the shared row primitives of
:mod:`.rows` (vectorised exp / log, log-partitions, the logits' gradient), :mod:`.projected`
(the projected mass's normalisation) and :mod:`.runs` (a block's chunk rows as runs of
positions). :mod:`.threads` picks the thread pool. Each says how a form's math is computed
here; the math itself is :mod:`definitions`'."""
