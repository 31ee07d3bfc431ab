"""The exact (image) P-KL and gold / H-KL (full and compact payload) as whole-call Triton passes
(see :mod:`fused.call`).

:mod:`fused.layout` lays a call's chunk rows out on the device and groups them, :mod:`fused.image`,
:mod:`fused.gold` and :mod:`fused.gold_topk` run each form's kernels over a group, :mod:`fused.call` is the call's
autograd Function and the switch (``XDISTILL_FUSED_FORMS``) that says where the passes serve.
"""
