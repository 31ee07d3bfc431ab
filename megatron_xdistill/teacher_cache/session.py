"""A run's ``--teacher-cache DIR``: fill it while training (or in a teacher-only pass), or read it.

*Read* when DIR holds a complete cache: the teacher is neither loaded nor run; each student rank
of the last pipeline stage reads the payloads of its own samples, so any student layout (TP, CP,
PP, DP, batch sizes) reads the same cache, for any number of epochs over the cache's plan.
*Write* otherwise: payloads are computed as without a cache and the teacher ranks that send them
also commit them to DIR; once every sample of the plan is held the manifest says ``complete``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import torch

from .manifest import Manifest, check_key, load_manifest, save_manifest
from .narrowing import Narrowing, narrowing
from .store import (
    COMMIT_SECONDS,
    CacheError,
    ShardReader,
    ShardWriter,
    committed_samples,
    sample_check,
)


class TeacherCache:
    """One rank's handle on the cache folder (see the module docstring)."""

    def __init__(self, root: str | os.PathLike, teacher: int = 0) -> None:
        """``teacher``: which of the run's teachers the cache holds (its tokens in the
        samples)."""
        self.root = Path(root)
        self.teacher = teacher
        if self.root.exists() and not self.root.is_dir():
            raise CacheError(f"--teacher-cache {self.root} exists and is not a directory")
        self.manifest = load_manifest(self.root)
        self.mode = "read" if self.manifest is not None and self.manifest.complete else "write"
        self.writer: ShardWriter | None = None
        self.reader: ShardReader | None = None
        self.run_key: dict | None = None
        self.narrowing: Narrowing | None = None  # a run at a smaller chunk top-k than held
        self._recorded: set[int] = set()  # samples this rank queued (later epochs repeat them)

    @property
    def reading(self) -> bool:
        return self.mode == "read"

    def check(self, run_key: dict) -> None:
        """Refuse a cache made for another configuration (every rank, before any collective,
        so that all ranks fail alike); a new cache takes this run's key."""
        if self.manifest is not None:
            if self.reading:
                self.narrowing = narrowing(self.manifest.key, run_key, self.manifest.numel)
            check_key(self.root, self.manifest, run_key, reading=self.reading,
                      narrowed=self.narrowing is not None)
        self.run_key = run_key

    def attach(self, teacher_model: dict, num_samples: int, numel: int, rank: int,
               writer: bool, reader: bool, barrier: Callable[[], None],
               shard_bytes: int = 256 << 20, commit_seconds: float = COMMIT_SECONDS) -> None:
        """Collective: rank 0 writes a new cache's manifest; then this rank opens its shard
        writer (a teacher rank that sends payloads) or reader (a student's last stage)."""
        if self.manifest is not None:  # narrowed rows have the run's size as they are read
            served = self.narrowing.run_numel if self.narrowing else self.manifest.numel
            if served != numel:
                raise CacheError(f"teacher cache {self.root} holds payloads of "
                                 f"{self.manifest.numel} values, this run needs {numel}")
        if self.manifest is None and rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            save_manifest(self.root, Manifest(self.run_key, teacher_model, num_samples, numel))
        barrier()
        self.manifest = load_manifest(self.root)
        if self.manifest is None:
            raise CacheError(f"rank {rank}: {self.root / 'manifest.json'} missing after rank 0 "
                             f"wrote it (is {self.root} on a file system every rank sees?)")
        if self.reading and reader:
            self.reader = ShardReader(self.root, self.manifest.numel)
        if not self.reading and writer:
            self.writer = ShardWriter(self.root, rank, numel, shard_bytes, commit_seconds)

    # ------------------------------------------------------------------ per step
    def record(self, samples: Mapping[int, dict], payloads: Mapping[int, torch.Tensor]) -> None:
        """Queue this rank's payloads (keys: positions in the global batch) by plan sample."""
        if self.writer is None:
            return
        for position, payload in payloads.items():
            sample = samples[position]
            if sample["index"] in self._recorded:  # a later epoch: the row is held already
                continue
            self._recorded.add(sample["index"])
            self.writer.add(sample["index"], sample_check(sample, self.teacher), payload)

    def fetch(self, samples: Mapping[int, dict], positions, device: torch.device
              ) -> dict[int, torch.Tensor]:
        """Payloads of the samples at ``positions`` of the global batch, checked, on ``device``."""
        if self.reader is None:
            return {}
        rows = self.reader.read((samples[p]["index"], sample_check(samples[p], self.teacher))
                                for p in positions)
        out = {p: rows[samples[p]["index"]].to(device) for p in positions}
        if self.narrowing is not None and out:
            narrowed = self.narrowing(torch.stack([out[p] for p in positions]))
            out = dict(zip(positions, narrowed.unbind(0), strict=True))
        return out

    def flush(self) -> None:
        """Commit the queued rows (before a checkpoint: every step it covers is on disk)."""
        if self.writer is not None:
            self.writer.flush()

    # ------------------------------------------------------------------ fill progress
    def missing(self) -> np.ndarray:
        """Sample ids of the plan that no committed shard holds."""
        held = committed_samples(self.root)
        return np.setdiff1d(np.arange(self.manifest.num_samples), held, assume_unique=True)

    def first_incomplete_step(self, global_batch_size: int) -> int:
        """The first step whose samples are not all held: where a filling pass resumes."""
        missing = self.missing()
        return int(missing[0]) // global_batch_size if len(missing) else \
            -(-self.manifest.num_samples // global_batch_size)

    def close(self, rank: int, barrier: Callable[[], None], log=print) -> bool:
        """Collective: commit queued rows; rank 0 marks the cache complete when every sample is
        held. Returns whether it is complete."""
        self.flush()
        barrier()
        if self.reading:
            return True
        missing = self.missing()
        if rank == 0:
            if len(missing) == 0:
                self.manifest.complete = True
                save_manifest(self.root, self.manifest)
                log(f"> teacher cache {self.root} complete: {self.manifest.num_samples} samples")
            else:
                log(f"> teacher cache {self.root}: {len(missing)} of "
                    f"{self.manifest.num_samples} samples still missing (first: sample "
                    f"{int(missing[0])}); rerun to continue filling it")
        barrier()
        return len(missing) == 0
