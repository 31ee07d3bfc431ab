"""The student-side driver: :func:`.parallel_loss.parallel_kd_loss` (one autograd Function per
call), its plan over chunk rows and blocks (:mod:`.plan`, the block gradients
:mod:`.gradients`), the choice of kernel and its inputs (:mod:`.kernel_choice`) and the total
loss from the global sums (:mod:`.total`)."""
