"""Stream tensors in and out of Hugging Face safetensors folders, one tensor at a time.

Reading uses plain positioned reads (no memory map), so a conversion holds one source tensor at a
time rather than a mapped file. Writing plans every shard's header from the tensor shapes first,
then writes each tensor as it is produced: an export holds the model plus one tensor, never a
second copy. Sharding follows transformers (``model-0000i-of-0000n.safetensors`` plus
``model.safetensors.index.json``); one file is ``model.safetensors``.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


@dataclass(frozen=True)
class TensorSpec:
    """Name, shape and dtype of one tensor (a header entry before the data exists)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class _Entry:
    file: str
    spec: TensorSpec
    start: int  # absolute byte offset in the file
    end: int


def _read_header(path: str) -> tuple[dict, int]:
    with open(path, "rb") as fh:
        raw = fh.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: truncated safetensors file")
        (size,) = struct.unpack("<Q", raw)
        header = json.loads(fh.read(size))
    return header, 8 + size


class SafetensorsFolder:
    """The tensors of an HF model folder (single file or index + shards), read on demand."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        index = os.path.join(folder, INDEX_FILE)
        if os.path.isfile(index):
            with open(index) as fh:
                files = sorted(set(json.load(fh)["weight_map"].values()))
        elif os.path.isfile(os.path.join(folder, SINGLE_FILE)):
            files = [SINGLE_FILE]
        else:
            files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
        if not files:
            other = [f for f in os.listdir(folder) if f.endswith((".bin", ".pt", ".pth"))]
            hint = f" (found {other}: re-save with safe_serialization)" if other else ""
            raise FileNotFoundError(f"{folder}: no safetensors weights{hint}")
        self._entries: dict[str, _Entry] = {}
        for name in files:
            path = os.path.join(folder, name)
            header, data_start = _read_header(path)
            for key, meta in header.items():
                if key == "__metadata__":
                    continue
                if meta["dtype"] not in _DTYPES:
                    raise ValueError(f"{path}: tensor {key} has unsupported dtype {meta['dtype']}")
                begin, end = meta["data_offsets"]
                spec = TensorSpec(key, tuple(meta["shape"]), _DTYPES[meta["dtype"]])
                self._entries[key] = _Entry(path, spec, data_start + begin, data_start + end)
        self._handles: dict[str, object] = {}

    def names(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def spec(self, name: str) -> TensorSpec:
        return self._entries[name].spec

    def file_of(self, name: str) -> str:
        return self._entries[name].file

    def get(self, name: str) -> torch.Tensor:
        """Read one tensor into fresh memory."""
        if name not in self._entries:
            raise KeyError(f"{self.folder}: no tensor {name!r}")
        entry = self._entries[name]
        fh = self._handles.get(entry.file)
        if fh is None:
            fh = self._handles[entry.file] = open(entry.file, "rb")
        buf = torch.empty(entry.end - entry.start, dtype=torch.uint8)
        view = memoryview(buf.numpy())
        fh.seek(entry.start)
        done = 0
        while done < len(view):
            n = fh.readinto(view[done:])
            if not n:
                raise ValueError(f"{entry.file}: truncated while reading tensor {name}")
            done += n
        return buf.view(entry.spec.dtype).reshape(entry.spec.shape)

    def close(self) -> None:
        for fh in self._handles.values():
            fh.close()
        self._handles.clear()

    def __enter__(self) -> SafetensorsFolder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def plan_shards(specs: Sequence[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
    """Split tensors, in order, into shards of at most ``max_shard_bytes`` (a bigger tensor gets a
    shard of its own)."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if shards[-1] and size + spec.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards


def _header_bytes(shard: Sequence[TensorSpec]) -> bytes:
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for spec in shard:
        header[spec.name] = {"dtype": _NAMES[spec.dtype], "shape": list(spec.shape),
                             "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as the safetensors library writes
    return struct.pack("<Q", len(raw)) + raw


def write_safetensors(
    folder: str,
    specs: Sequence[TensorSpec],
    tensors: Iterable[tuple[str, torch.Tensor]],
    max_shard_bytes: int = 5 * 2**30,
) -> list[str]:
    """Write ``tensors`` (yielded in ``specs`` order) into ``folder``; returns the file names.

    Each yielded tensor must match its spec (name, shape, dtype); a mismatch raises naming it.
    """
    shards = plan_shards(specs, max_shard_bytes)
    n = len(shards)
    names = [SINGLE_FILE] if n == 1 else [
        f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    stream = iter(tensors)
    for file_name, shard in zip(names, shards):
        with open(os.path.join(folder, file_name), "wb") as fh:
            fh.write(_header_bytes(shard))
            for spec in shard:
                try:
                    name, tensor = next(stream)
                except StopIteration:
                    raise ValueError(f"tensor stream ended before {spec.name}") from None
                if name != spec.name or tuple(tensor.shape) != spec.shape \
                        or tensor.dtype != spec.dtype:
                    raise ValueError(
                        f"tensor {name} {tuple(tensor.shape)} {tensor.dtype} does not match the "
                        f"planned {spec.name} {spec.shape} {spec.dtype}")
                data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
                fh.write(memoryview(data.numpy()))
    if next(stream, None) is not None:
        raise ValueError("tensor stream has more tensors than planned")
    if n > 1:
        index = {"metadata": {"total_size": sum(s.nbytes for s in specs)},
                 "weight_map": {s.name: f for f, shard in zip(names, shards) for s in shard}}
        with open(os.path.join(folder, INDEX_FILE), "w") as fh:
            json.dump(index, fh, indent=2)
            fh.write("\n")
    return names
