"""Spelling one vocabulary's token texts with another vocabulary's tokens.

Used by the multi-token builder (student texts spelled by teacher tokens) and the reverse pass
(teacher texts spelled by student tokens). Two routes, tried in order:

text
    Decode the bytes as UTF-8 and re-encode with the target tokenizer (parallel batch encode, no
    prefix space). Accepted only when the target pieces' canonical bytes concatenate back to the
    source bytes; normalizers (NFC in Qwen2), unknown-token replacement or special-token matching
    can break that.
bytes
    For what the text route cannot spell, above all byte-level tokens that are partial UTF-8
    sequences (e.g. ``b"\\xe4\\xb8"``, not decodable as text): a greedy cover of the bytes by the
    target's longest matching token, left to right. Byte-level and byte-fallback vocabularies hold
    every single byte, so the cover always exists for them.

At most ``max_pieces`` pieces are kept (the first ones); ``complete`` says whether they spell the
whole text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .reencode import Reencoder

VIA_NONE, VIA_TEXT, VIA_BYTES = 0, 1, 2


@dataclass(frozen=True)
class Spelling:
    """Target-vocabulary pieces that spell one source text, in text order."""

    pieces: tuple[int, ...]
    complete: bool
    via: int  # VIA_TEXT, VIA_BYTES, or VIA_NONE (no spelling found)


class BytesCover:
    """Greedy longest-prefix cover of a byte string by the tokens of a vocabulary."""

    def __init__(self, canonical: dict[bytes, int]) -> None:
        self._ids = canonical
        self._lengths = sorted({len(b) for b in canonical}, reverse=True)

    def cover(self, data: bytes, max_pieces: int) -> Spelling:
        """Pieces covering ``data`` from the left, longest token first at each position.

        Greedy can get stuck where a vocabulary lacks some bytes (SmolLM2 has no token for
        ``\\x04``); then a fewest-pieces segmentation is searched, and if none exists the text
        cannot be spelled at all (``VIA_NONE``).
        """
        pieces: list[int] = []
        pos, n = 0, len(data)
        while pos < n and len(pieces) < max_pieces:
            for length in self._lengths:
                if length <= n - pos:
                    tid = self._ids.get(data[pos : pos + length])
                    if tid is not None:
                        pieces.append(tid)
                        pos += length
                        break
            else:
                return self._fewest_pieces(data, max_pieces)
        return Spelling(tuple(pieces), pos == n, VIA_BYTES)

    def _fewest_pieces(self, data: bytes, max_pieces: int) -> Spelling:
        n = len(data)
        inf = n + 1
        best = [inf] * (n + 1)  # best[i]: fewest pieces covering data[i:]
        step = [0] * (n + 1)
        best[n] = 0
        for i in range(n - 1, -1, -1):
            for length in self._lengths:  # longest first: ties keep the longer piece
                if length <= n - i and best[i + length] + 1 < best[i]:
                    if data[i : i + length] in self._ids:
                        best[i], step[i] = best[i + length] + 1, length
        if best[0] >= inf:
            return Spelling((), False, VIA_NONE)
        pieces, pos = [], 0
        while pos < n and len(pieces) < max_pieces:
            pieces.append(self._ids[data[pos : pos + step[pos]]])
            pos += step[pos]
        return Spelling(tuple(pieces), pos == n, VIA_BYTES)


def spell_all(
    sources: Sequence[bytes],
    target_table: Sequence[bytes | None],
    target_reencoder: Reencoder,
    target_cover: BytesCover,
    max_pieces: int,
    on_progress: Callable[[int], None] | None = None,
) -> list[Spelling]:
    """Spell every source text with target tokens (text route first, then the bytes cover)."""
    out: list[Spelling | None] = [None] * len(sources)
    text_pos, texts = [], []
    for i, b in enumerate(sources):
        try:
            texts.append(b.decode("utf-8"))
            text_pos.append(i)
        except UnicodeDecodeError:
            pass
    encoded = target_reencoder.encode(texts, on_chunk=on_progress)
    for i, ids in zip(text_pos, encoded):
        parts = [target_table[t] if 0 <= t < len(target_table) else None for t in ids]
        if ids and None not in parts and b"".join(parts) == sources[i]:
            kept = tuple(ids[:max_pieces])
            out[i] = Spelling(kept, len(kept) == len(ids), VIA_TEXT)
    missing = [i for i, s in enumerate(out) if s is None]
    for i in missing:
        out[i] = target_cover.cover(sources[i], max_pieces)
    if on_progress is not None and len(sources) > len(texts):
        on_progress(len(sources) - len(texts))
    return out  # type: ignore[return-value]
