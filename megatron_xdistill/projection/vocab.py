"""Tokenizer identity: loading, a display name, and a hash of the vocabulary.

A projection file records both vocabularies' hashes so that a file built for other tokenizers is
refused at load time (DESIGN.md, "Projection W"). The hash covers every id in
``range(len(tokenizer))`` and its token string, so adding, removing or renaming any token changes it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any
from weakref import WeakKeyDictionary

from ..align.tokenizer_cache import auto_tokenizer

TokenizerLike = Any  # a Hugging Face tokenizer (PreTrainedTokenizerBase) or a path to one


def load_tokenizer(spec: TokenizerLike) -> Any:
    """Return a Hugging Face tokenizer: ``spec`` itself, or ``AutoTokenizer`` loaded from a path
    (once per process: :mod:`..align.tokenizer_cache`)."""
    if isinstance(spec, str | Path):
        path = Path(spec)
        if not path.exists():
            raise FileNotFoundError(f"tokenizer directory {path} does not exist")
        if not path.is_dir():
            raise NotADirectoryError(f"tokenizer path {path} is not a directory (expected a "
                                     "Hugging Face tokenizer directory)")
        return auto_tokenizer(path)
    if not hasattr(spec, "convert_ids_to_tokens"):
        raise TypeError(
            f"expected a Hugging Face tokenizer or a path to one, got {type(spec).__name__}"
        )
    return spec


def tokenizer_name(tokenizer: Any) -> str:
    """A human-readable name: the path or hub id it was loaded from, else its class name."""
    name = getattr(tokenizer, "name_or_path", "") or ""
    return str(name) if name else type(tokenizer).__name__


def token_strings(tokenizer: Any) -> list[str | None]:
    """Token string per id for every id in ``range(len(tokenizer))`` (None where an id is unused)."""
    n = len(tokenizer)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return [backend.id_to_token(i) for i in range(n)]
    return list(tokenizer.convert_ids_to_tokens(list(range(n))))


#: each tokenizer object's hash with the vocabulary size it was taken at (a tokenizer that
#: gains tokens is hashed again)
_HASHES: WeakKeyDictionary = WeakKeyDictionary()


def vocab_hash(tokenizer: Any) -> str:
    """SHA-256 over (vocab size, then each id's token string, length-prefixed), as
    ``sha256:<hex>``; taken once per tokenizer object (0.17 s for a 150k vocabulary)."""
    try:
        size, digest = _HASHES.get(tokenizer, (None, None))
    except TypeError:  # not weak-referenceable: no memo
        return _vocab_hash(tokenizer)
    if size != len(tokenizer):
        digest = _vocab_hash(tokenizer)
        _HASHES[tokenizer] = (len(tokenizer), digest)
    return digest


def _vocab_hash(tokenizer: Any) -> str:
    h = hashlib.sha256()
    strings = token_strings(tokenizer)
    h.update(len(strings).to_bytes(8, "little"))
    for s in strings:
        if s is None:
            h.update(b"\xff\xff\xff\xff")
            continue
        b = s.encode("utf-8", "surrogatepass")
        h.update(len(b).to_bytes(4, "little"))
        h.update(b)
    return "sha256:" + h.hexdigest()
