"""Align texts (offset path) or id lists (DP path) between a student and a teacher tokenizer."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .canonical import token_table
from .chunks import Alignment
from .dp_aligner import align_sides, check_dp_options
from .offset_aligner import align_offsets
from .sides import Side, make_side
from .tokenizer_cache import auto_tokenizer

__all__ = ["TokenAligner", "align_ids", "align_text", "align_texts", "check_texts", "load_tokenizer"]

METHODS = ("offsets", "dp")


def load_tokenizer(path: str | os.PathLike[str]) -> Any:
    """Load a Hugging Face fast tokenizer from a local directory, with a clear error if absent."""
    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(f"tokenizer directory {str(path)!r} does not exist")
    if not any((p / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        raise FileNotFoundError(
            f"{str(path)!r} holds no tokenizer.json / tokenizer_config.json (expected a Hugging "
            "Face tokenizer directory)"
        )
    try:
        tok = auto_tokenizer(p, local_files_only=True)
    except Exception as e:  # transformers raises many types; name the directory
        raise ValueError(f"could not load a tokenizer from {str(path)!r}: {e}") from e
    if not getattr(tok, "is_fast", False):
        raise ValueError(f"tokenizer in {str(path)!r} is not a fast tokenizer (no offsets)")
    return tok


def _as_text(text: str | bytes, what: str = "text") -> str:
    """Check that ``text`` is valid Unicode that UTF-8 can carry; decode bytes strictly."""
    if isinstance(text, bytes | bytearray):
        try:
            return bytes(text).decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(
                f"{what} is not valid UTF-8 (byte {e.start}: {bytes(text)[e.start:e.start + 4]!r})"
            ) from None
    if not isinstance(text, str):
        raise TypeError(f"{what} must be str or bytes, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"{what} holds a character UTF-8 cannot encode at index {e.start} "
            f"({text[e.start]!r}, a lone surrogate?)"
        ) from None
    return text


def check_texts(texts: Sequence[str | bytes]) -> list[str]:
    """Each text as valid Unicode (bytes decoded as UTF-8); a bad one fails naming its index."""
    return [_as_text(t, f"text #{k}") for k, t in enumerate(texts)]


class TokenAligner:
    """Student/teacher tokenizer pair with their canonical tables, ready to align.

    Build once (tables are cached per tokenizer) and reuse, e.g. in each DataLoader worker; it
    pickles. ``max_step``, ``anchor_bytes``, ``band``: DP options (see ``dp_aligner``).
    """

    def __init__(self, student_tokenizer: Any, teacher_tokenizer: Any, *, max_step: int = 4,
                 anchor_bytes: int = 16, band: int = 64) -> None:
        check_dp_options(max_step, anchor_bytes, band)
        self.student_tokenizer = student_tokenizer
        self.teacher_tokenizer = teacher_tokenizer
        self.student_table = token_table(student_tokenizer)
        self.teacher_table = token_table(teacher_tokenizer)
        self.dp_options = {"max_step": max_step, "anchor_bytes": anchor_bytes, "band": band}

    # -- tokenisation ---------------------------------------------------------------------------
    @staticmethod
    def _encode(tokenizer: Any, texts: list[str]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Ids and character offsets, no special tokens added (the Rust tokenizer, batched)."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ValueError(f"{type(tokenizer).__name__} is not a fast tokenizer (no offsets)")
        encs = backend.encode_batch(texts, add_special_tokens=False)
        out = []
        for e in encs:
            ids = np.asarray(e.ids, dtype=np.int64)
            offs = np.asarray(e.offsets, dtype=np.int64).reshape(-1, 2)
            out.append((ids, offs))
        return out

    # -- sides ------------------------------------------------------------------------------------
    def _text_sides(self, text: str, s_ids: np.ndarray, t_ids: np.ndarray) -> tuple[Side, Side]:
        """Both sides of one text; control tokens are dropped (even where the text spells them)."""
        s = make_side(s_ids, self.student_table, None, self.student_table.strips_prefix(text))
        t = make_side(t_ids, self.teacher_table, None, self.teacher_table.strips_prefix(text))
        return s, t

    # -- public -----------------------------------------------------------------------------------
    def encode_texts(self, texts: Sequence[str | bytes]) -> tuple[list[str], list, list]:
        """Validated texts and, per side, ``(ids, offsets)`` for each (no special tokens added).

        All texts are checked before any work, so a bad one fails the call naming its index.
        """
        clean = check_texts(texts)
        return clean, self._encode(self.student_tokenizer, clean), self.encode_teacher(clean)

    def encode_teacher(self, texts: Sequence[str]) -> list:
        """The teacher side of :meth:`encode_texts` alone, for texts already checked."""
        return self._encode(self.teacher_tokenizer, list(texts))

    def align_encoded(self, texts: Sequence[str], student_enc: Sequence, teacher_enc: Sequence,
                      method: str = "offsets") -> list[Alignment]:
        """Align texts already tokenised by :meth:`encode_texts`."""
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        out = []
        for text, (s_ids, s_off), (t_ids, t_off) in zip(texts, student_enc, teacher_enc,
                                                        strict=True):
            s, t = self._text_sides(text, s_ids, t_ids)
            if method == "offsets" and _spells(s, t, text):
                chunks = align_offsets(s, s_off, t, t_off)
            else:
                chunks = align_sides(s, t, **self.dp_options)
            out.append(Alignment(s_ids, t_ids, chunks))
        return out

    def align_texts(self, texts: Sequence[str | bytes], method: str = "offsets") -> list[Alignment]:
        """Tokenise each text with both tokenizers and align them.

        ``method="offsets"`` (default) uses character offsets where both tokenisations spell the
        text byte for byte, and the DP elsewhere; ``"dp"`` aligns the same ids from canonical
        bytes only. Both give the same chunks. Texts are validated first (str, or bytes that
        are valid UTF-8): a bad one fails the whole call before any work, naming its index.
        """
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        return self.align_encoded(*self.encode_texts(texts), method=method)

    def align_text(self, text: str | bytes, method: str = "offsets") -> Alignment:
        """Tokenise one text with both tokenizers and align them (see :meth:`align_texts`)."""
        return self.align_texts([text], method)[0]

    def align_ids(self, student_ids: Sequence[int] | np.ndarray,
                  teacher_ids: Sequence[int] | np.ndarray, *,
                  student_prefix_space: bool | None = None,
                  teacher_prefix_space: bool | None = None) -> Alignment:
        """Align two id lists with no text (e.g. generated ids): the DP path.

        Control ids (BOS/EOS/pad...) belong to no chunk; unknown / out-of-range ids make their
        chunk inexact. ``*_prefix_space``: drop the leading space of the first token of a
        prefix-space tokenizer (SentencePiece ``▁`` at the very start), as ``decode`` does;
        ``None`` means "if the tokenizer adds one".
        """
        s_ids = _as_ids(student_ids, "student_ids")
        t_ids = _as_ids(teacher_ids, "teacher_ids")
        sp = self.student_table.prefix_space if student_prefix_space is None else student_prefix_space
        tp = self.teacher_table.prefix_space if teacher_prefix_space is None else teacher_prefix_space
        s = make_side(s_ids, self.student_table, None, sp)
        t = make_side(t_ids, self.teacher_table, None, tp)
        return Alignment(s_ids, t_ids, align_sides(s, t, **self.dp_options))


def _spells(s: Side, t: Side, text: str) -> bool:
    """Whether both sides' canonical bytes are the text's bytes (so their offsets can be trusted).

    Otherwise (unknown or dropped bytes, a normaliser, special tokens written in the text) the
    tokenizer's offsets may not match its tokens' bytes, and the DP path aligns the sample.
    """
    if s.opaque.any() or t.opaque.any():
        return False
    raw = text.encode("utf-8")
    return s.stream.tobytes() == raw and t.stream.tobytes() == raw


def _as_ids(ids: Sequence[int] | np.ndarray, what: str) -> np.ndarray:
    arr = np.asarray(ids)
    if arr.ndim != 1:
        raise ValueError(f"{what} must be a 1-D sequence of token ids, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{what} must hold integer token ids, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def align_text(text: str | bytes, student_tokenizer: Any, teacher_tokenizer: Any,
               method: str = "offsets") -> Alignment:
    """Student ids, teacher ids and chunks for one text (offset path by default)."""
    return TokenAligner(student_tokenizer, teacher_tokenizer).align_text(text, method)


def align_texts(texts: Sequence[str | bytes], student_tokenizer: Any, teacher_tokenizer: Any,
                method: str = "offsets") -> list[Alignment]:
    """:func:`align_text` for a batch (tokenised in one Rust call per tokenizer)."""
    return TokenAligner(student_tokenizer, teacher_tokenizer).align_texts(texts, method)


def align_ids(student_ids: Sequence[int] | np.ndarray, teacher_ids: Sequence[int] | np.ndarray,
              student_tokenizer: Any, teacher_tokenizer: Any, **options: Any) -> Alignment:
    """DP alignment of two id lists (no text needed); options as :meth:`TokenAligner.align_ids`."""
    return TokenAligner(student_tokenizer, teacher_tokenizer).align_ids(
        student_ids, teacher_ids, **options
    )
