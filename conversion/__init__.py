"""HF <-> Megatron checkpoint conversion (library + the ``xdistill-convert`` CLI).

Library (each function is collective over the ranks of an initialised torch.distributed world;
``conversion.launch.run_distributed`` starts one)::

    convert_hf_to_mcore(hf_dir, out, tp=1, pp=1, dtype=None)   # -> checkpoint + xdistill_model.json
    convert_mcore_to_hf(load, out, hf_template=None, dtype=None)  # -> safetensors, config, tokenizer
    verify_conversion(hf_dir, load, tp=1, pp=1)               # -> logit differences, top-1 agreement

Tensor mapping: :mod:`conversion.mapping`; streaming safetensors I/O:
:mod:`conversion.safetensors_io`.
"""

from importlib import import_module
from typing import Any

_EXPORTS = {
    "convert_hf_to_mcore": "conversion.hf_to_mcore",
    "preflight": "conversion.hf_to_mcore",
    "convert_mcore_to_hf": "conversion.mcore_to_hf",
    "verify_conversion": "conversion.verify",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    # Lazy: `python -m conversion.cli` must be able to hide CUDA before Megatron is imported.
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'conversion' has no attribute {name!r}")
