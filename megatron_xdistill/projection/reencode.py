"""Re-encoding token texts with another tokenizer, as that tokenizer would mid-text.

A token's text usually sits in the middle of a document, so the re-encoding must not add what a
tokenizer adds only at the start of a text: the SentencePiece dummy prefix (Metaspace
``prepend_scheme``, a ``Prepend("▁")`` normalizer) or byte-level ``add_prefix_space``. We clone the
tokenizer's Rust backend with those switched off (only when it has them) and use its parallel
``encode_batch``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

SP_SPACE = "\u2581"


def _strip_prefix_space(node: Any) -> Any:
    """Return the component config with prefix-space insertion turned off (recursively)."""
    if isinstance(node, list):
        return [c for c in (_strip_prefix_space(x) for x in node) if c is not None]
    if not isinstance(node, dict):
        return node
    kind = node.get("type")
    if kind == "Prepend" and node.get("prepend") in (SP_SPACE, " "):
        return None
    out = {k: _strip_prefix_space(v) for k, v in node.items()}
    if kind == "Metaspace":
        out["prepend_scheme"] = "never"
        if "add_prefix_space" in out:
            out["add_prefix_space"] = False
    if kind == "ByteLevel" and "add_prefix_space" in out:
        out["add_prefix_space"] = False
    return out


def _component(node: Any) -> Any:
    return None if node is None else json.loads(node.__getstate__())


def _without_prefix_space(backend: Any) -> Any:
    """``backend`` itself when it adds no prefix space (and has no truncation/padding set), else
    a clone with those switched off. Cloning serialises the whole vocabulary, so it is avoided."""
    from tokenizers import Tokenizer

    parts = {"normalizer": backend.normalizer, "pre_tokenizer": backend.pre_tokenizer}
    configs = {k: _component(v) for k, v in parts.items()}
    fixed = {k: _strip_prefix_space(v) for k, v in configs.items()}
    if fixed == configs and backend.truncation is None and backend.padding is None:
        return backend
    config = json.loads(backend.to_str())
    config.update(fixed)
    config["truncation"] = config["padding"] = None
    return Tokenizer.from_str(json.dumps(config))


class Reencoder:
    """Batch-encode texts with a tokenizer's vocabulary, no special tokens, no prefix space."""

    def __init__(self, tokenizer: Any, chunk_size: int = 16384) -> None:
        self.chunk_size = chunk_size
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._hf = tokenizer
        self._backend = None
        if backend is not None:
            self._backend = _without_prefix_space(backend)

    def encode(
        self, texts: Sequence[str], on_chunk: Callable[[int], None] | None = None
    ) -> list[list[int]]:
        """Token ids of each text; ``on_chunk(n)`` is called after each chunk of n texts."""
        out: list[list[int]] = []
        for start in range(0, len(texts), self.chunk_size):
            chunk = list(texts[start : start + self.chunk_size])
            if self._backend is not None:
                encode = getattr(self._backend, "encode_batch_fast", self._backend.encode_batch)
                out.extend(e.ids for e in encode(chunk, add_special_tokens=False))
            else:  # slow tokenizer: no control over its prefix space; callers verify spellings
                out.extend(self._hf(chunk, add_special_tokens=False)["input_ids"])
            if on_chunk is not None:
                on_chunk(len(chunk))
        return out
