"""Human-readable views of W: coverage counts and sample rows as text.

``"201" -> "2" 0.909, "01" 0.091`` reads: student token "201" spreads its probability over teacher
tokens "2" and "01" with those weights. Token texts are canonical bytes (``align.canonical``) shown
as double-quoted strings with Python-style escapes; bytes that are not valid UTF-8 show as ``\\xNN``;
special tokens show as their token string without quotes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .fileio import RowKind
from .runtime import ProjectionMatrix

# Share of the sample given to each row kind (the rest of the budget goes to multi-token rows).
_SAMPLE_SHARE = {
    RowKind.MULTI_TOKEN: 0.45,
    RowKind.BYTES: 0.15,
    RowKind.REVERSE: 0.1,
    RowKind.EXACT: 0.15,
    RowKind.SPECIAL: 0.05,
    RowKind.EXACT_ALIAS: 0.05,
    RowKind.EMPTY: 0.05,
    RowKind.UNKNOWN: 1.0,
}


def quote_bytes(data: bytes) -> str:
    """Double-quoted display of token bytes: escapes for controls, quotes, and invalid UTF-8."""
    out = ['"']
    for ch in data.decode("utf-8", "surrogateescape"):
        code = ord(ch)
        if 0xDC80 <= code <= 0xDCFF:
            out.append(f"\\x{code - 0xDC00:02x}")
        elif ch in '"\\':
            out.append("\\" + ch)
        elif not ch.isprintable():
            out.append(repr(ch)[1:-1])
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


class TokenNames:
    """Display strings for the ids of one vocabulary (text, special string, or the bare id)."""

    def __init__(self, tokenizer: Any = None, table: Sequence[bytes | None] | None = None) -> None:
        self.tokenizer = tokenizer
        self.table = table

    def __call__(self, token_id: int) -> str:
        if self.table is None or not 0 <= token_id < len(self.table):
            return str(token_id)
        b = self.table[token_id]
        if b is not None:
            return quote_bytes(b)
        if self.tokenizer is not None:
            s = self.tokenizer.convert_ids_to_tokens(token_id)
            if s is not None:
                return s
        return f"<id {token_id}>"


def format_row(matrix: ProjectionMatrix, row: int, student: TokenNames, teacher: TokenNames) -> str:
    """``"201" -> "2" 0.909, "01" 0.091`` for one student row (``-> (empty)`` when empty)."""
    idx, w = matrix.indices[row], matrix.weights[row]
    entries = [f"{teacher(int(t))} {float(x):.3f}" for t, x in zip(idx, w) if int(t) >= 0]
    return f"{student(row)} -> " + (", ".join(entries) if entries else "(empty)")


def classify_rows(
    matrix: ProjectionMatrix,
    student_table: Sequence[bytes | None],
    teacher_table: Sequence[bytes | None],
) -> torch.Tensor:
    """Row kinds for a W without them (e.g. a NeMo-RL file): EXACT = one-hot on the same text,
    SPECIAL = student special token with an entry, MULTI_TOKEN = any other non-empty row."""
    kind = np.full(matrix.student_vocab_size, int(RowKind.MULTI_TOKEN), dtype=np.uint8)
    idx = matrix.indices.numpy()
    w = matrix.weights.numpy()
    nnz = (idx >= 0).sum(axis=1)
    for s in range(matrix.student_vocab_size):
        sb = student_table[s] if s < len(student_table) else None
        if nnz[s] == 0:
            kind[s] = int(RowKind.EMPTY)
        elif sb is None:
            kind[s] = int(RowKind.SPECIAL)
        elif nnz[s] == 1 and abs(float(w[s, 0]) - 1.0) <= 1e-6:
            t = int(idx[s, 0])
            if t < len(teacher_table) and teacher_table[t] == sb:
                kind[s] = int(RowKind.EXACT)
    return torch.from_numpy(kind)


def coverage_lines(matrix: ProjectionMatrix, kinds: torch.Tensor | None = None) -> list[str]:
    """Coverage summary: rows per kind with percentages, entries per row."""
    kinds = matrix.row_kind if kinds is None else kinds
    n = max(1, matrix.student_vocab_size)
    nnz = (matrix.indices >= 0).sum(dim=1)
    lines = [
        f"student rows: {matrix.student_vocab_size}  teacher columns: "
        f"{matrix.teacher_vocab_size}  top_k: {matrix.top_k}",
        f"entries: {int(nnz.sum())} (mean {float(nnz.float().mean()):.2f} per row)",
    ]
    if kinds is None:
        cov = matrix.coverage()
        for key in ("one_hot", "multi_entry", "empty"):
            lines.append(f"  {key:<12} {cov[key]:>8}  {100 * cov[key] / n:6.2f}%")
        return lines
    counts = torch.bincount(kinds.to(torch.int64), minlength=256)
    for kind in RowKind:
        c = int(counts[int(kind)])
        if c or kind in (RowKind.EXACT, RowKind.MULTI_TOKEN, RowKind.EMPTY):
            lines.append(f"  {kind.name.lower():<12} {c:>8}  {100 * c / n:6.2f}%")
    return lines


def sample_rows(
    matrix: ProjectionMatrix, n: int, kinds: torch.Tensor | None = None, seed: int = 0
) -> list[int]:
    """Up to ``n`` row ids spread over the row kinds (mostly multi-token), deterministic."""
    rng = np.random.default_rng(seed)
    kinds = matrix.row_kind if kinds is None else kinds
    if kinds is None:
        kinds = torch.full((matrix.student_vocab_size,), int(RowKind.UNKNOWN), dtype=torch.uint8)
    kind_np = kinds.numpy()
    chosen: list[int] = []
    present = [k for k in _SAMPLE_SHARE if (kind_np == int(k)).any()]
    for k in present:
        pool = np.flatnonzero(kind_np == int(k))
        take = min(pool.size, max(1, int(round(n * _SAMPLE_SHARE[k]))))
        chosen.extend(rng.choice(pool, size=take, replace=False).tolist())
    if len(chosen) < n:
        rest = np.setdiff1d(np.flatnonzero(kind_np != int(RowKind.EMPTY)), chosen)
        take = min(rest.size, n - len(chosen))
        chosen.extend(rng.choice(rest, size=take, replace=False).tolist())
    return sorted(chosen[:n])
