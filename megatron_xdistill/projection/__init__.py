"""projection stage of megatron-xdistill: the sparse vocabulary map W (see DESIGN.md).

Build W once per tokenizer pair (``build_projection`` or ``xdistill-projection build``), save it as
safetensors, and load it for training (``load_projection``), which refuses a file built for other
tokenizers. ``ProjectionMatrix`` is the runtime form the losses use.
"""

from .build import BuildOptions, build_projection
from .fileio import RowKind
from .runtime import (
    ProjectionMatrix,
    ProjectionMismatchError,
    identity_projection,
    load_projection,
    save_projection,
)

__all__ = [
    "BuildOptions",
    "ProjectionMatrix",
    "ProjectionMismatchError",
    "identity_projection",
    "RowKind",
    "build_projection",
    "load_projection",
    "save_projection",
]
