"""Teacher payload cache: run the teacher once, train any number of students from disk.

``manifest`` (what the payloads were made from, checked against every run), ``store`` (Arrow IPC
shards committed atomically, read back checked), ``session`` (a run's fill / read handle).
"""

from __future__ import annotations

from .manifest import Manifest, checkpoint_fingerprint, key_differences, load_manifest
from .session import TeacherCache
from .store import CacheError, ShardReader, ShardWriter, committed_samples, sample_check


def cache_is_complete(root) -> bool:
    """Whether ``root`` holds a complete cache (a damaged manifest raises CacheError)."""
    manifest = load_manifest(root)
    return manifest is not None and manifest.complete


__all__ = ["CacheError", "Manifest", "ShardReader", "ShardWriter", "TeacherCache",
           "cache_is_complete", "checkpoint_fingerprint", "committed_samples", "key_differences",
           "load_manifest", "sample_check"]
