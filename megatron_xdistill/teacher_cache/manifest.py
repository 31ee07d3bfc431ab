"""What a teacher cache holds and what it was made from: ``manifest.json`` beside the shards.

The key lists everything the payloads depend on: the teacher checkpoint (a fingerprint of its
files) and precision, both tokenizers (vocabulary hashes), the data plan (files by name and size,
text field, sequence lengths, seed, number of samples) and the payload (form, top-k, temperature,
width, the common vocabulary of gold / H-KL). A run whose key differs is refused with each
differing field and both values. ``complete`` turns true once every sample of the plan is held;
until then the cache is being filled (and a resumed filler continues it).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from megatron_xdistill.storage import write_json_atomic

from .store import CacheError

FORMAT = "xdistill-teacher-cache"
#: 2: image payloads ship the teacher's P on W's image and the sum of P log P over all of V_t
#: (1: log P and that sum outside the image only); the other forms are as in 1
VERSION = 2
MANIFEST = "manifest.json"
# Fields a reading run may differ in: it trains on the cache's own plan (any number of epochs).
READER_FREE = ("data.num_samples",)


def checkpoint_fingerprint(path: str | os.PathLike) -> str:
    """SHA-256 over the checkpoint folder's file names and sizes and its small metadata files
    (model description, tracker): identifies a checkpoint without reading its weights."""
    root = Path(path)
    if not root.is_dir():
        raise CacheError(f"teacher checkpoint {root} is not a directory")
    digest = hashlib.sha256()
    for file in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = file.relative_to(root).as_posix()
        digest.update(f"{rel}\0{file.stat().st_size}\0".encode())
        small_json = file.suffix == ".json" and file.stat().st_size < 1 << 20
        if small_json or file.name.startswith("latest_checkpointed_iteration"):
            digest.update(file.read_bytes())
    return "sha256:" + digest.hexdigest()


@dataclass
class Manifest:
    """The key, the teacher's model description (so a reader needs no teacher checkpoint) and
    whether every sample of the plan is held."""

    key: dict
    teacher_model: dict
    num_samples: int
    numel: int
    complete: bool = False

    def to_json(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "complete": self.complete,
                "num_samples": self.num_samples, "payload_numel": self.numel, "key": self.key,
                "teacher_model": self.teacher_model}

    @classmethod
    def from_json(cls, data: dict, path: Path) -> Manifest:
        if data.get("format") != FORMAT:
            raise CacheError(f"{path} is not a teacher cache manifest (format "
                             f"{data.get('format')!r}, expected {FORMAT!r})")
        version = data.get("version")
        form = (data.get("key") or {}).get("payload", {}).get("form")
        if version != VERSION and not (version == 1 and form != "image"):
            raise CacheError(f"{path}: teacher cache version {version}"
                             f"{' of an image payload' if version == 1 else ''}, this release "
                             f"reads version {VERSION}; refill the cache")
        try:
            return cls(data["key"], data["teacher_model"], int(data["num_samples"]),
                       int(data["payload_numel"]), bool(data["complete"]))
        except KeyError as err:
            raise CacheError(f"{path}: field {err} missing; the manifest is damaged") from err


def load_manifest(root: str | os.PathLike) -> Manifest | None:
    """The cache's manifest, or None for a cache not yet started (missing or empty folder)."""
    path = Path(root) / MANIFEST
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CacheError(f"{path} is not valid JSON ({err}); the manifest is damaged") from err
    return Manifest.from_json(data, path)


def save_manifest(root: str | os.PathLike, manifest: Manifest) -> None:
    """Write the manifest atomically (temporary file, fsync, rename)."""
    write_json_atomic(Path(root) / MANIFEST, manifest.to_json(), indent=1, sort_keys=True)


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for name, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{name}."))
        else:
            out[f"{prefix}{name}"] = value
    return out


def key_differences(cached: dict, run: dict, ignore: tuple[str, ...] = ()) -> list[str]:
    """``field: cache <value>, this run <value>`` for every field whose values differ."""
    a, b = _flatten(cached), _flatten(run)
    lines = []
    for name in sorted(set(a) | set(b)):
        if name in ignore:
            continue
        left, right = a.get(name, "<absent>"), b.get(name, "<absent>")
        if json.dumps(left) != json.dumps(right):  # tuples and lists compare alike
            lines.append(f"{name}: cache {left!r}, this run {right!r}")
    return lines


def check_key(root: str | os.PathLike, manifest: Manifest, run_key: dict, reading: bool,
              narrowed: bool = False) -> None:
    """Refuse a cache made for another configuration, naming every differing field.
    ``narrowed``: the reading run takes fewer of a chunk top-k cache's columns (see
    :mod:`.narrowing`), so its top-k and payload size may be smaller."""
    free = (READER_FREE + (("payload.topk", "payload.numel", "payload.gold_topk") if narrowed
                           else ())
            if reading else ())
    diff = key_differences(manifest.key, run_key, free)
    if diff:
        raise CacheError(
            f"teacher cache {root} was made for another configuration:\n  " + "\n  ".join(diff)
            + "\nUse another --teacher-cache folder, or run with the cache's settings.")
