"""align stage: which student tokens and which teacher tokens cover the same piece of text.

See DESIGN.md, "Alignment" and "Next-token shift". Public API:

Canonical token text (``canonical``)
    ``token_bytes_table(tokenizer) -> list[bytes | None]``: bytes of every id (``None``: special).
    ``ids_bytes(tokenizer, ids) -> bytes``: the text bytes a sequence of ids spells.
    ``token_table(tokenizer) -> TokenTable``: same in flat numpy form, plus family, prefix-space
    flag and unk id. ``special_token_ids(tok)``, ``is_special_token_id(tok, id)``. Cached.

Aligning (``api``)
    ``TokenAligner(student_tok, teacher_tok)``: holds both tables; build once, reuse.
      ``.align_text(text) / .align_texts(texts) -> Alignment``: tokenise (no special tokens added)
      and align from character offsets: the O(n) fast path (samples where a tokenisation does
      not spell the text byte for byte, e.g. unknown tokens, go to the DP).
      ``.align_ids(student_ids, teacher_ids) -> Alignment``: DP path for ids without text.
    ``align_text(text, s_tok, t_tok)``, ``align_texts``, ``align_ids(s_ids, t_ids, s_tok, t_tok)``:
    one-shot forms. ``load_tokenizer(dir)``: local HF fast tokenizer with clear errors.
    ``Alignment``: ``student_ids``, ``teacher_ids`` (int64 arrays), ``chunks_array`` (int64
    ``[C, 5]``) and ``chunks`` (list of ``(s_start, s_end, t_start, t_end, exact)``, half-open
    spans over the id lists). Chunks are ordered and disjoint; every id except control tokens
    (BOS/EOS/pad, which belong to no chunk) is in exactly one; an empty side has start == end.
    Both paths give the same chunks for the ids of the same text.

Packing (``pack``)
    ``pack_alignments(chunk_lists, student_lengths, teacher_lengths, *, student_offset=0,
    teacher_offset=0, student_width=None, teacher_width=None, max_chunks=None)`` -> dict of
    torch tensors ``student_chunk_id [B, Ts]`` / ``teacher_chunk_id [B, Tt]`` (int64, -1: none),
    ``chunk_valid [B, C]``, ``chunk_exact [B, C]`` (bool), ``student_span`` / ``teacher_span``
    ``[B, C, 2]``. ``*_offset`` = tokens prepended to a side (e.g. 1 for BOS).
    ``predicting_chunk_id(chunk_id)``: the next-token-shifted view (position i predicts i + 1).

CLI: ``xdistill-align show | dump | stats`` (``cli``).

Heavy parts (numba kernels, torch) load on first use, so ``canonical`` imports cheaply.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from .canonical import (
    TokenTable,
    ids_bytes,
    is_special_token_id,
    special_token_ids,
    token_bytes_table,
    token_table,
)

_LAZY = {
    "Alignment": "chunks",
    "Chunk": "chunks",
    "TokenAligner": "api",
    "align_ids": "api",
    "align_text": "api",
    "align_texts": "api",
    "load_tokenizer": "api",
    "pack_alignments": "pack",
    "predicting_chunk_id": "pack",
}

__all__ = [
    "TokenTable",
    "ids_bytes",
    "is_special_token_id",
    "special_token_ids",
    "token_bytes_table",
    "token_table",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
