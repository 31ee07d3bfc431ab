"""The projection file on disk: safetensors tensors + string metadata, written atomically.

Layout (DESIGN.md, "Projection W"):
  ``indices``  [V_s, k] int32, teacher token ids, -1 = empty slot
  ``weights``  [V_s, k] float32, 0 in empty slots
  ``row_kind`` [V_s] uint8 (optional): which builder filled the row (see ``RowKind``)
and metadata (all strings): tokenizer names, vocab sizes, vocab hashes, builder options (JSON).
"""

from __future__ import annotations

import json
import os
from enum import IntEnum
from pathlib import Path

import torch

from megatron_xdistill.storage import atomic_file

FORMAT_NAME = "megatron-xdistill.projection"
FORMAT_VERSION = "1"


class RowKind(IntEnum):
    """Which builder produced a student row; stored per row so coverage is known from the file."""

    EMPTY = 0
    EXACT = 1  # canonical text equals one teacher token: one-hot
    MULTI_TOKEN = 2  # teacher re-encoding of the student text, decaying weights
    BYTES = 3  # greedy longest-prefix cover of the student bytes by teacher tokens (fallback)
    REVERSE = 4  # only entries from the reverse pass
    SPECIAL = 5  # special/control token matched by role or name
    EXACT_ALIAS = 6  # exact, but another student token with the same text is the canonical one
    UNKNOWN = 255  # loaded from a file without row kinds


def is_safetensors_file(path: str | os.PathLike) -> bool:
    """True when the file starts like a safetensors file (u64 header length, then a JSON object)."""
    with open(path, "rb") as f:
        head = f.read(9)
    if len(head) < 9:
        return False
    header_len = int.from_bytes(head[:8], "little")
    return head[8:9] == b"{" and 0 < header_len < (1 << 32)


def write_projection_file(
    path: str | os.PathLike,
    tensors: dict[str, torch.Tensor],
    metadata: dict[str, str],
) -> None:
    """Write tensors + metadata to ``path`` via a temp file in the same folder and ``os.replace``."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    bad = [k for k, v in metadata.items() if not isinstance(v, str)]
    if bad:
        raise TypeError(f"projection metadata values must be strings; not for {bad}")
    with atomic_file(path) as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)


def read_projection_file(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Read a projection safetensors file, checking the fields' presence, shapes and dtypes."""
    from safetensors import SafetensorError

    path = Path(path)
    try:
        return _read_checked(path)
    except SafetensorError as err:
        raise ValueError(f"{path}: truncated or corrupt projection file ({err}); rebuild it "
                         f"with `xdistill-projection build`") from None


def _read_checked(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    from safetensors import safe_open

    tensors: dict[str, torch.Tensor] = {}
    with safe_open(str(path), framework="pt") as f:
        metadata = dict(f.metadata() or {})
        keys = set(f.keys())
        for key in ("indices", "weights"):
            if key not in keys:
                raise ValueError(
                    f"{path}: missing tensor '{key}' (a projection file has 'indices' [V_s, k] "
                    f"int32 and 'weights' [V_s, k] float32); found {sorted(keys)}"
                )
        for key in keys & {"indices", "weights", "row_kind"}:
            tensors[key] = f.get_tensor(key)
    fmt = metadata.get("format")
    if fmt is not None and fmt != FORMAT_NAME:
        raise ValueError(f"{path}: metadata 'format' is {fmt!r}, expected {FORMAT_NAME!r}")
    version = metadata.get("format_version", FORMAT_VERSION)
    if version != FORMAT_VERSION:
        raise ValueError(
            f"{path}: metadata 'format_version' is {version!r}; this code reads version "
            f"{FORMAT_VERSION!r}"
        )
    _check_shapes(path, tensors)
    return tensors, metadata


def _check_shapes(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    indices, weights = tensors["indices"], tensors["weights"]
    if indices.dim() != 2:
        raise ValueError(
            f"{path}: 'indices' must be 2-D [V_s, k], got shape {tuple(indices.shape)}"
        )
    if indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{path}: 'indices' must be int32, got {indices.dtype}")
    if weights.shape != indices.shape:
        raise ValueError(
            f"{path}: 'weights' shape {tuple(weights.shape)} differs from 'indices' shape "
            f"{tuple(indices.shape)}"
        )
    if weights.dtype != torch.float32:
        raise ValueError(f"{path}: 'weights' must be float32, got {weights.dtype}")
    kind = tensors.get("row_kind")
    if kind is not None and (kind.dim() != 1 or kind.shape[0] != indices.shape[0]):
        raise ValueError(
            f"{path}: 'row_kind' must be 1-D with {indices.shape[0]} rows, got {tuple(kind.shape)}"
        )


def metadata_json(metadata: dict[str, str], key: str) -> object:
    """Decode one JSON-valued metadata field (None when absent)."""
    raw = metadata.get(key)
    return None if raw is None else json.loads(raw)
