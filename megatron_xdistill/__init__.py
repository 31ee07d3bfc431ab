"""megatron-xdistill: cross-tokenizer knowledge distillation on Megatron-Core.

Importing the package changes nothing in torch or Megatron; it only lets ``megatron.core`` be
imported on machines without Triton (see :mod:`.mcore.importable`). Code that builds models or
runs the runtime calls :func:`megatron_xdistill.mcore.compat.install` once first, as the entry
points do.
"""

from megatron_xdistill.mcore.importable import make_megatron_importable

make_megatron_importable()

__version__ = "0.1.0"
