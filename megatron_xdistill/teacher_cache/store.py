"""Payload shards on disk: Arrow IPC files of (sample, check, crc, payload) rows.

A writer (one per teacher rank that sends payloads) buffers rows and commits them as a shard:
written under a temporary name, fsynced, then renamed, so a killed writer leaves either a whole
shard or none that a reader lists. A shard's name carries its writer and its first and last
sample ids (``payloads-w00003-s0000000128-0000000255.arrow``); its rows are sorted by sample.

A reader finds the shards that can hold a sample from their names, memory-maps them (a few at a
time) and checks each row it returns: the payload's CRC32 (a damaged file), and the sample's
``check`` against the run's own tokens (a cache made from other data). Memory does not grow with
the dataset: nothing but the shard names is held for shards not being read.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
import zlib
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from megatron_xdistill.storage import atomic_file

SHARD_DIR = "shards"
_NAME = re.compile(r"^payloads-w(\d{5})-s(\d{10})-(\d{10})\.arrow$")
_OPEN_SHARDS = 8  # memory-mapped shards kept open by a reader


class CacheError(RuntimeError):
    """A teacher cache that cannot be used as it is; the message names the file and the fix."""


def sample_check(sample: Mapping, teacher: int = 0) -> int:
    """64-bit digest of what a sample's payload depends on: both token sequences, their lengths
    and the alignment chunks (the teacher-side reduction averages over them). A sample of a
    several-teacher dataset (``"teachers"``: per teacher its tokens and chunks) is checked as
    teacher ``teacher`` sees it."""
    if "teachers" in sample:
        sample = {**sample, **sample["teachers"][teacher]}
    digest = hashlib.blake2b(digest_size=8)
    for key in ("tokens", "teacher_tokens", "chunks"):
        digest.update(np.ascontiguousarray(sample[key], dtype=np.int64).tobytes())
    digest.update(np.array([sample["student_length"], sample["teacher_length"]],
                           dtype=np.int64).tobytes())
    return int.from_bytes(digest.digest(), "little")


def _schema(numel: int) -> pa.Schema:
    return pa.schema([("sample", pa.int64()), ("check", pa.uint64()), ("crc", pa.uint32()),
                      ("payload", pa.list_(pa.float32(), numel))])


@dataclass(frozen=True)
class ShardName:
    path: Path
    writer: int
    first: int
    last: int

    @classmethod
    def parse(cls, path: Path) -> ShardName | None:
        match = _NAME.match(path.name)
        if match is None:
            return None
        writer, first, last = (int(g) for g in match.groups())
        return cls(path, writer, first, last)


def list_shards(root: str | os.PathLike) -> list[ShardName]:
    """Committed shards under ``root`` (temporary files of a writer in progress are not)."""
    folder = Path(root) / SHARD_DIR
    if not folder.is_dir():
        return []
    names = (ShardName.parse(p) for p in folder.iterdir())
    return sorted((n for n in names if n is not None), key=lambda n: (n.first, n.writer))


def _open(path: Path) -> pa.Table:
    try:
        with pa.memory_map(str(path)) as source:
            return pa.ipc.open_file(source).read_all()
    except (pa.ArrowInvalid, OSError) as err:
        raise CacheError(f"teacher cache shard {path} is truncated or corrupt ({err}); delete it "
                         f"and rerun the teacher pass (--teacher-cache-only) to refill it") from err


def committed_samples(root: str | os.PathLike) -> np.ndarray:
    """Sorted unique sample ids held by the committed shards (reads their sample columns)."""
    ids = [_open(s.path).column("sample").to_numpy() for s in list_shards(root)]
    return np.unique(np.concatenate(ids)) if ids else np.zeros(0, np.int64)


#: A writer commits its queued rows at least this often (s): what a killed pass can lose.
COMMIT_SECONDS = 120.0


class ShardWriter:
    """Buffers one writer's rows and commits them as shards of about ``shard_bytes``, or of
    whatever is queued once the oldest queued row is ``commit_seconds`` old (a slow teacher
    would otherwise hold hours of payloads in memory, lost to a kill)."""

    def __init__(self, root: str | os.PathLike, writer: int, numel: int,
                 shard_bytes: int = 256 << 20, commit_seconds: float = COMMIT_SECONDS) -> None:
        self.folder = Path(root) / SHARD_DIR
        self.folder.mkdir(parents=True, exist_ok=True)
        self.writer, self.numel = writer, numel
        self.rows_per_shard = max(1, shard_bytes // (4 * max(numel, 1)))
        self.commit_seconds = commit_seconds
        self._oldest: float | None = None
        self._rows: dict[int, tuple[int, np.ndarray]] = {}
        for stale in self.folder.glob(f".payloads-w{writer:05d}-*.tmp"):
            stale.unlink()  # this writer's own shard that a kill cut short

    def add(self, sample: int, check: int, payload: torch.Tensor) -> None:
        """Queue one sample's flat payload; commits a shard when enough rows are queued."""
        row = payload.detach().to("cpu", torch.float32).numpy().reshape(-1)
        if row.size != self.numel:
            raise ValueError(f"payload of sample {sample} has {row.size} values, the cache "
                             f"holds {self.numel}")
        self._rows[int(sample)] = (int(check), row.copy())
        if self._oldest is None:
            self._oldest = time.monotonic()
        if (len(self._rows) >= self.rows_per_shard
                or time.monotonic() - self._oldest >= self.commit_seconds):
            self.flush()

    def flush(self) -> Path | None:
        """Commit the queued rows as one shard (atomically); None when nothing is queued."""
        if not self._rows:
            return None
        ids = sorted(self._rows)
        payload = np.stack([self._rows[i][1] for i in ids])
        table = pa.table({
            "sample": pa.array(ids, pa.int64()),
            "check": pa.array([self._rows[i][0] for i in ids], pa.uint64()),
            "crc": pa.array([zlib.crc32(row.tobytes()) for row in payload], pa.uint32()),
            "payload": pa.FixedSizeListArray.from_arrays(pa.array(payload.reshape(-1)),
                                                         self.numel),
        }, schema=_schema(self.numel))
        name = f"payloads-w{self.writer:05d}-s{ids[0]:010d}-{ids[-1]:010d}.arrow"
        final = self.folder / name
        options = pa.ipc.IpcWriteOptions(compression="zstd")
        with atomic_file(final) as tmp, open(tmp, "wb") as handle:
            with pa.ipc.new_file(handle, table.schema, options=options) as out:
                out.write_table(table)
        self._rows.clear()
        self._oldest = None
        return final


class ShardReader:
    """Payload rows by sample id from the committed shards, checked as they are read."""

    def __init__(self, root: str | os.PathLike, numel: int) -> None:
        self.root = Path(root)
        self.numel = numel
        self.shards = list_shards(root)
        self._open: OrderedDict[Path, tuple[np.ndarray, pa.Table]] = OrderedDict()

    def _table(self, shard: ShardName) -> tuple[np.ndarray, pa.Table]:
        if shard.path in self._open:
            self._open.move_to_end(shard.path)
            return self._open[shard.path]
        table = _open(shard.path)
        width = table.schema.field("payload").type.list_size
        if width != self.numel:
            raise CacheError(f"teacher cache shard {shard.path} holds payloads of {width} values, "
                             f"this run's payload form needs {self.numel}")
        entry = (table.column("sample").to_numpy(), table)
        self._open[shard.path] = entry
        while len(self._open) > _OPEN_SHARDS:
            self._open.popitem(last=False)
        return entry

    def read(self, wanted: Iterable[tuple[int, int]]) -> dict[int, torch.Tensor]:
        """``{sample: payload}`` for ``(sample, check)`` pairs; every row checked."""
        out: dict[int, torch.Tensor] = {}
        for sample, check in wanted:
            out[sample] = self._one(int(sample), int(check))
        return out

    def _one(self, sample: int, check: int) -> torch.Tensor:
        for shard in self.shards:
            if not shard.first <= sample <= shard.last:
                continue
            ids, table = self._table(shard)
            at = int(np.searchsorted(ids, sample))
            if at == len(ids) or ids[at] != sample:
                continue
            stored = int(table.column("check")[at].as_py())
            if stored != check:
                raise CacheError(
                    f"teacher cache {self.root}: sample {sample} in {shard.path.name} was made "
                    f"from other tokens or another alignment than this run's data (check "
                    f"{stored:#x} vs {check:#x}); the data or tokenizers changed since the cache "
                    f"was written: refill it with --teacher-cache-only")
            row = table.column("payload")[at].values.to_numpy(zero_copy_only=False)
            if zlib.crc32(row.tobytes()) != int(table.column("crc")[at].as_py()):
                raise CacheError(f"teacher cache shard {shard.path} is corrupt (sample {sample} "
                                 f"fails its CRC32); delete it and refill with "
                                 f"--teacher-cache-only")
            return torch.from_numpy(row.copy())
        raise CacheError(f"teacher cache {self.root} holds no payload for sample {sample}; "
                         f"it is incomplete: finish it with --teacher-cache-only")
