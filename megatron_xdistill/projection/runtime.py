"""W at run time: the form the losses use, and loading/saving it.

``ProjectionMatrix`` holds W student-major as fixed-width rows (``indices``/``weights`` [V_s, k]).
The vocab-parallel loss takes the rows of its TP vocab partition (``local_shard``; Megatron's padded
rows are empty), gathers projected probabilities at chosen teacher columns through the transpose
(``teacher_major_csr``), and the gold loss splits the vocabularies with ``common_vocab``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import common_vocab as _common
from .fileio import (
    FORMAT_NAME,
    FORMAT_VERSION,
    RowKind,
    is_safetensors_file,
    read_projection_file,
    write_projection_file,
)
from .nemo_rl import read_nemo_rl
from .vocab import load_tokenizer, tokenizer_name, vocab_hash


class ProjectionMismatchError(ValueError):
    """The projection file was built for other tokenizers than the ones in use."""


@dataclass(eq=False)
class ProjectionMatrix:
    """Sparse W [V_s, V_t], at most ``k`` entries per student row.

    ``indices`` int64 [V_s, k] (teacher ids, -1 = empty), ``weights`` float32 [V_s, k] (0 where
    empty); each row is ordered by weight, largest first. ``metadata`` holds the file's string
    metadata (tokenizer names and hashes, builder options). ``row_kind`` uint8 [V_s] says which
    builder filled each row (``RowKind``), or is None when unknown (e.g. NeMo-RL files).
    """

    indices: torch.Tensor
    weights: torch.Tensor
    student_vocab_size: int
    teacher_vocab_size: int
    metadata: dict[str, str] = field(default_factory=dict)
    row_kind: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.indices = torch.as_tensor(self.indices).to(torch.int64)
        self.weights = torch.as_tensor(self.weights).to(torch.float32)
        if self.indices.dim() != 2 or self.weights.shape != self.indices.shape:
            raise ValueError(
                f"indices/weights must both be [V_s, k]; got {tuple(self.indices.shape)} and "
                f"{tuple(self.weights.shape)}"
            )
        if self.indices.shape[0] != self.student_vocab_size:
            raise ValueError(
                f"W has {self.indices.shape[0]} rows but student_vocab_size is "
                f"{self.student_vocab_size}"
            )
        if self.indices.numel():
            hi, lo = int(self.indices.max()), int(self.indices.min())
            if hi >= self.teacher_vocab_size or lo < -1:
                raise ValueError(
                    f"W indices span [{lo}, {hi}], outside [-1, {self.teacher_vocab_size}) "
                    f"(teacher_vocab_size {self.teacher_vocab_size})"
                )
        if not torch.isfinite(self.weights).all() or (self.weights < 0).any():
            raise ValueError("W weights must be finite and >= 0")
        empty = (self.indices < 0) | (self.weights <= 0)
        self.indices = self.indices.masked_fill(empty, -1)
        self.weights = self.weights.masked_fill(empty, 0.0)
        if self.row_kind is not None:
            self.row_kind = torch.as_tensor(self.row_kind).to(torch.uint8)
            if self.row_kind.shape != (self.student_vocab_size,):
                raise ValueError(
                    f"row_kind must have shape ({self.student_vocab_size},), "
                    f"got {tuple(self.row_kind.shape)}"
                )

    @property
    def top_k(self) -> int:
        """Row width k."""
        return int(self.indices.shape[1])

    def local_shard(self, vocab_start: int, vocab_end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [vocab_start, vocab_end) of W over Megatron's padded student vocabulary.

        Rows at or past the real ``student_vocab_size`` (padding) are empty: index -1, weight 0.
        Returns ``(indices int64 [n, k], weights float32 [n, k])``, n = vocab_end - vocab_start.
        """
        if not 0 <= vocab_start <= vocab_end:
            raise ValueError(
                f"need 0 <= vocab_start <= vocab_end, got [{vocab_start}, {vocab_end})"
            )
        n = vocab_end - vocab_start
        indices = torch.full((n, self.top_k), -1, dtype=torch.int64)
        weights = torch.zeros((n, self.top_k), dtype=torch.float32)
        stop = min(vocab_end, self.student_vocab_size)
        if stop > vocab_start:
            indices[: stop - vocab_start] = self.indices[vocab_start:stop]
            weights[: stop - vocab_start] = self.weights[vocab_start:stop]
        return indices, weights

    def to_dense(
        self, padded_student_vocab: int | None = None, padded_teacher_vocab: int | None = None
    ) -> torch.Tensor:
        """Dense float32 W [V_s', V_t'] (V' = padded size, >= the real one; padding is zero).

        For references and tests on small vocabularies: 151k x 262k would be 160 GB.
        """
        vs = self.student_vocab_size if padded_student_vocab is None else padded_student_vocab
        vt = self.teacher_vocab_size if padded_teacher_vocab is None else padded_teacher_vocab
        if vs < self.student_vocab_size or vt < self.teacher_vocab_size:
            raise ValueError(
                f"padded sizes ({vs}, {vt}) must be >= the real vocab sizes "
                f"({self.student_vocab_size}, {self.teacher_vocab_size})"
            )
        dense = torch.zeros((vs, vt), dtype=torch.float32)
        rows, cols, vals = self._coo()
        dense.index_put_((rows, cols), vals, accumulate=True)
        return dense

    def to_sparse(self) -> torch.Tensor:
        """W as a coalesced sparse COO float32 tensor [V_s, V_t] (duplicates summed, as
        :meth:`to_dense`): for dense references on real vocabularies."""
        rows, cols, vals = self._coo()
        return torch.sparse_coo_tensor(
            torch.stack([rows, cols.long()]), vals.float(),
            (self.student_vocab_size, self.teacher_vocab_size), check_invariants=True).coalesce()

    def teacher_major_csr(
        self, padded_teacher_vocab: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """W transposed as CSR over teacher rows: ``(crow [V_t'+1], student_col [nnz], weight [nnz])``.

        Row t lists the student tokens with weight on teacher token t, by ascending student id:
        student_col[crow[t]:crow[t+1]]. int64 / int64 / float32. ``padded_teacher_vocab`` extends
        crow with empty rows for Megatron's padded teacher columns.
        """
        vt = self.teacher_vocab_size if padded_teacher_vocab is None else padded_teacher_vocab
        if vt < self.teacher_vocab_size:
            raise ValueError(f"padded_teacher_vocab {vt} < teacher_vocab_size")
        rows, cols, vals = self._coo()
        order = torch.argsort(cols * self.student_vocab_size + rows)
        counts = torch.bincount(cols, minlength=vt)
        crow = torch.zeros(vt + 1, dtype=torch.int64)
        crow[1:] = torch.cumsum(counts, 0)
        return crow, rows[order], vals[order]

    def common_vocab(self, rule: str = "strict") -> tuple[torch.Tensor, torch.Tensor]:
        """One-to-one (student_ids, teacher_ids) pairs for the gold loss; rules in ``common_vocab``."""
        return _common.common_vocab(self.indices, self.weights, rule, self.row_kind)

    def coverage(self) -> dict[str, int]:
        """Row counts per builder kind (``RowKind`` names, lower case); 'unknown' without kinds."""
        empty = ((self.indices < 0).all(dim=1)).sum().item()
        if self.row_kind is None:
            one_hot = ((self.indices >= 0).sum(dim=1) == 1).sum().item()
            return {
                "rows": self.student_vocab_size,
                "one_hot": int(one_hot),
                "multi_entry": int(self.student_vocab_size - one_hot - empty),
                "empty": int(empty),
            }
        counts = torch.bincount(self.row_kind.to(torch.int64), minlength=256)
        out = {"rows": self.student_vocab_size}
        for kind in RowKind:
            out[kind.name.lower()] = int(counts[int(kind)])
        return out

    def _coo(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        valid = self.indices >= 0
        rows = torch.nonzero(valid, as_tuple=True)[0]
        return rows, self.indices[valid], self.weights[valid]


def identity_projection(vocab_size: int) -> ProjectionMatrix:
    """W = I over a vocabulary both models share (a teacher with the student's tokenizer): each
    token projects onto itself, so P-KL over single-token chunks is the token-level KL."""
    ids = torch.arange(vocab_size, dtype=torch.int64).unsqueeze(1)
    return ProjectionMatrix(ids, torch.ones(vocab_size, 1), vocab_size, vocab_size,
                            metadata={"builder": "identity"},
                            row_kind=torch.full((vocab_size,), int(RowKind.EXACT), dtype=torch.uint8))


def tokenizer_metadata(student_tokenizer: Any, teacher_tokenizer: Any) -> dict[str, str]:
    """Metadata fields that tie a file to its two tokenizers (names and vocab hashes)."""
    return {
        "student_tokenizer": tokenizer_name(student_tokenizer),
        "teacher_tokenizer": tokenizer_name(teacher_tokenizer),
        "student_vocab_hash": vocab_hash(student_tokenizer),
        "teacher_vocab_hash": vocab_hash(teacher_tokenizer),
    }


def check_tokenizers(
    matrix: ProjectionMatrix,
    student_tokenizer: Any = None,
    teacher_tokenizer: Any = None,
    source: str = "projection",
) -> None:
    """Refuse W when a given tokenizer is not the one it was built for (hash, else size)."""
    for side, tok, size in (
        ("student", student_tokenizer, matrix.student_vocab_size),
        ("teacher", teacher_tokenizer, matrix.teacher_vocab_size),
    ):
        if tok is None:
            continue
        recorded = matrix.metadata.get(f"{side}_vocab_hash")
        name = matrix.metadata.get(f"{side}_tokenizer", "<unrecorded>")
        in_use = tokenizer_name(tok)
        if recorded is not None:
            actual = vocab_hash(tok)
            if actual != recorded:
                raise ProjectionMismatchError(
                    f"{source}: W was built for {side} tokenizer '{name}' (vocab {size}, "
                    f"{recorded[:23]}...) but the {side} tokenizer in use is '{in_use}' "
                    f"(vocab {len(tok)}, {actual[:23]}...); rebuild it with "
                    "`xdistill-projection build`"
                )
        elif size != len(tok):
            raise ProjectionMismatchError(
                f"{source}: W has {side} vocab size {size} but the {side} tokenizer in use, "
                f"'{in_use}', has {len(tok)} tokens"
            )


def save_projection(matrix: ProjectionMatrix, path: str | os.PathLike) -> None:
    """Write W as a projection safetensors file (atomic: temp file + ``os.replace``)."""
    metadata = dict(matrix.metadata)
    metadata.update(
        format=FORMAT_NAME,
        format_version=FORMAT_VERSION,
        student_vocab_size=str(matrix.student_vocab_size),
        teacher_vocab_size=str(matrix.teacher_vocab_size),
        top_k=str(matrix.top_k),
        coverage=json.dumps(matrix.coverage()),
    )
    tensors = {
        "indices": matrix.indices.to(torch.int32),
        "weights": matrix.weights.to(torch.float32),
    }
    if matrix.row_kind is not None:
        tensors["row_kind"] = matrix.row_kind.to(torch.uint8)
    write_projection_file(path, tensors, metadata)


def load_projection(
    path: str | os.PathLike, student_tokenizer: Any = None, teacher_tokenizer: Any = None
) -> ProjectionMatrix:
    """Load W from our safetensors file or a NeMo-RL ``.pt`` file.

    Tokenizers (objects or paths) are optional; when given, a safetensors file's vocab hashes must
    match them (``ProjectionMismatchError`` otherwise). A NeMo-RL file carries no hashes: its rows
    are padded/checked against the given student tokenizer and its indices against the teacher's.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"projection file {path} does not exist")
    student = None if student_tokenizer is None else load_tokenizer(student_tokenizer)
    teacher = None if teacher_tokenizer is None else load_tokenizer(teacher_tokenizer)
    if is_safetensors_file(path):
        matrix = _from_safetensors(path)
    else:
        matrix = _from_nemo_rl(path, student, teacher)
    check_tokenizers(matrix, student, teacher, source=str(path))
    return matrix


def _from_safetensors(path: Path) -> ProjectionMatrix:
    tensors, metadata = read_projection_file(path)
    indices = tensors["indices"]
    for key in ("student_vocab_size", "teacher_vocab_size"):
        if key not in metadata:
            raise ValueError(f"{path}: metadata lacks '{key}'")
    vs, vt = int(metadata["student_vocab_size"]), int(metadata["teacher_vocab_size"])
    if indices.shape[0] != vs:
        raise ValueError(
            f"{path}: 'indices' has {indices.shape[0]} rows but metadata student_vocab_size is {vs}"
        )
    try:
        return ProjectionMatrix(
            indices, tensors["weights"], vs, vt, metadata, tensors.get("row_kind")
        )
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e


def _from_nemo_rl(path: Path, student: Any, teacher: Any) -> ProjectionMatrix:
    indices, weights, form = read_nemo_rl(path)
    rows = indices.shape[0]
    vs = len(student) if student is not None else rows
    if rows > vs:
        if (indices[vs:] >= 0).any():
            raise ProjectionMismatchError(
                f"{path}: NeMo-RL W has entries in student rows >= {vs}, the size of student "
                f"tokenizer '{tokenizer_name(student)}'"
            )
        indices, weights = indices[:vs], weights[:vs]
    elif rows < vs:
        pad = vs - rows
        indices = np.concatenate([indices, np.full((pad, indices.shape[1]), -1, np.int64)])
        weights = np.concatenate([weights, np.zeros((pad, weights.shape[1]), np.float32)])
    hi = int(indices.max()) if indices.size else -1
    vt = len(teacher) if teacher is not None else hi + 1
    if hi >= vt:
        raise ProjectionMismatchError(
            f"{path}: NeMo-RL W uses teacher id {hi} but teacher tokenizer "
            f"'{tokenizer_name(teacher)}' has {vt} tokens"
        )
    metadata = {"source": f"nemo-rl-{form}:{path.name}"}
    if student is not None:
        metadata["student_tokenizer"] = tokenizer_name(student)
    if teacher is not None:
        metadata["teacher_tokenizer"] = tokenizer_name(teacher)
    return ProjectionMatrix(torch.from_numpy(indices), torch.from_numpy(weights), vs, vt, metadata)
