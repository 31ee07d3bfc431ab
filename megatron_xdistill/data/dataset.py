"""The distillation dataset: tokenisation and alignment of packed samples, in workers.

Each item is one packed sample (see :mod:`megatron_xdistill.data.packing`): the student's token
ids of a text and, per teacher, that teacher's token ids of the same text and the aligned chunks
between the two (a teacher with the student's tokenizer has the student's ids and one exact chunk
per token). Batches carry, per teacher, the packed chunk tensors of DESIGN.md
(``student_chunk_id``, ``teacher_chunk_id``, ``chunk_valid``, ``chunk_exact``), and the student's
loss mask and the UTF-8 bytes its labels spell (bits per byte). :func:`teacher_view` gives code
written for one teacher its keys at the top level.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from megatron_xdistill.data.packing import PackingPlan, SpecialTokens

if TYPE_CHECKING:
    from megatron_xdistill.data.tokenizations import SampleTokenizers


def _side_tokens(flags: Sequence[tuple[int, int]], ids: Sequence[np.ndarray],
                 special: SpecialTokens) -> tuple[list[int], list[int]]:
    """One side's tokens of a sample (each piece's ids, BOS before a document's first piece
    where the side uses one, EOS after its last) and where each piece's ids start."""
    tokens: list[int] = []
    starts = []
    for (starts_doc, ends_doc), piece in zip(flags, ids, strict=True):
        if starts_doc and special.bos is not None:
            tokens.append(special.bos)
        starts.append(len(tokens))
        tokens.extend(piece.tolist())
        if ends_doc:
            tokens.append(special.eos)
    return tokens, starts


def _sample_chunks(alignments: Sequence, s_starts: Sequence[int],
                   t_starts: Sequence[int]) -> np.ndarray:
    """The pieces' chunks, shifted to the sample's token positions: int64 [C, 5]."""
    chunks = [al.chunks_array + np.array([s0, s0, t0, t0, 0], np.int64)
              for al, s0, t0 in zip(alignments, s_starts, t_starts, strict=True)
              if len(al.chunks_array)]
    return np.concatenate(chunks) if chunks else np.zeros((0, 5), np.int64)


def _fitting(chunks: np.ndarray, width: int, teacher_width: int) -> int:
    """How many leading chunks fit both widths (up to the first that does not)."""
    fits = (chunks[:, 1] <= width) & (chunks[:, 3] <= teacher_width)
    return len(fits) if fits.all() else int(np.argmin(fits))


def _student_cut(width: int, cross: Sequence[tuple[np.ndarray, int]]) -> int:
    """Student tokens kept from an overlong sample: the longest prefix that ends at a chunk end
    of every cross teacher ``(chunks, width)`` whose chunks up to there all fit; with no cross
    teacher, the student width."""
    if not cross:
        return width
    allowed: set[int] | None = None
    for chunks, teacher_width in cross:
        ends = {0, *chunks[: _fitting(chunks, width, teacher_width), 1].tolist()}
        allowed = ends if allowed is None else allowed & ends
    return max(allowed)


def _kept_chunks(chunks: np.ndarray, width: int, teacher_width: int, cut: int) -> np.ndarray:
    """A cross teacher's chunks that fit and end at or before the student cut."""
    keep = min(_fitting(chunks, width, teacher_width),
               int(np.searchsorted(chunks[:, 1], cut, side="right")))
    return chunks[:keep]


def _identity_chunks(length: int) -> np.ndarray:
    """One exact chunk per token, ``[i, i + 1, i, i + 1, 1]``: a same-tokenizer teacher's."""
    i = np.arange(length, dtype=np.int64)
    return np.stack([i, i + 1, i, i + 1, np.ones_like(i)], axis=1)


def _padded(tokens: Sequence[int], width: int, pad: int) -> np.ndarray:
    out = np.full(width, pad, np.int64)
    out[: len(tokens)] = tokens
    return out


class DistillationDataset(torch.utils.data.Dataset):
    """Map-style dataset over a packing plan; ``__getitem__`` tokenises and aligns one sample."""

    def __init__(self, documents: Sequence[str], plan: PackingPlan, tokenizers: SampleTokenizers,
                 seq_length: int, teacher_seq_lengths: Sequence[int]) -> None:
        lengths = tokenizers.check_lengths(seq_length, teacher_seq_lengths)
        self.documents = documents
        self.plan = plan
        self.tokenizers = tokenizers
        self.width = seq_length + 1
        self.teacher_widths = [n + 1 for n in lengths]
        self.special = SpecialTokens.of(tokenizers.student_tokenizer)
        self.teacher_special = [SpecialTokens.of(t) for t in tokenizers.teacher_tokenizers]

    def __len__(self) -> int:
        return len(self.plan)

    def _token_bytes(self, ids: np.ndarray) -> int:
        from megatron_xdistill.align import ids_bytes

        return len(ids_bytes(self.tokenizers.student_tokenizer, ids.tolist()))

    def __getitem__(self, index: int) -> dict:
        pieces = self.plan.sample_pieces(index).tolist()
        texts = [self.documents[d][c0:c1] for d, c0, c1, _, _ in pieces]
        flags = [(starts_doc, ends_doc) for _, _, _, starts_doc, ends_doc in pieces]
        _, student, alignments = self.tokenizers.encode_align(texts)
        s_tokens, s_starts = _side_tokens(flags, [ids for ids, _ in student], self.special)
        cross = {}  # teacher -> (tokens, chunks)
        for k, als in enumerate(alignments):
            if als is not None:
                t_tokens, t_starts = _side_tokens(flags, [al.teacher_ids for al in als],
                                                  self.teacher_special[k])
                cross[k] = (t_tokens, _sample_chunks(als, s_starts, t_starts))
        if len(s_tokens) > self.width or any(
                len(t) > self.teacher_widths[k] for k, (t, _) in cross.items()):
            # Re-tokenising a piece can differ from the whole document by a token at a cut
            # (e.g. SentencePiece's prefix space): cut where every teacher's chunks still fit.
            cut = _student_cut(self.width, [(c, self.teacher_widths[k])
                                            for k, (_, c) in cross.items()])
            s_tokens = s_tokens[:cut]
            for k, (t_tokens, chunks) in cross.items():
                kept = _kept_chunks(chunks, self.width, self.teacher_widths[k], cut)
                cross[k] = (t_tokens[: int(kept[-1, 3]) if len(kept) else 0], kept)
        n_s = len(s_tokens)
        tokens = _padded(s_tokens, self.width, self.special.pad)
        loss_mask = np.zeros(self.width - 1, np.float32)
        loss_mask[: max(n_s - 1, 0)] = 1.0
        teachers = []
        for k in range(self.tokenizers.num_teachers):
            if k in cross:
                t_tokens, chunks = cross[k]
                teachers.append({"teacher_tokens": _padded(t_tokens, self.teacher_widths[k],
                                                           self.teacher_special[k].pad),
                                 "teacher_length": len(t_tokens), "chunks": chunks})
            else:
                teachers.append({"teacher_tokens": tokens.copy(), "teacher_length": n_s,
                                 "chunks": _identity_chunks(n_s)})
        return {
            "index": index,  # the plan's sample id (the teacher cache keys payloads by it)
            "tokens": tokens,
            "student_length": n_s,
            "loss_mask": loss_mask,
            "num_bytes": self._token_bytes(tokens[1:n_s]),
            "teachers": teachers,
        }


def _collate_teacher(samples: Sequence[dict], k: int, width: int) -> dict[str, torch.Tensor]:
    """Teacher ``k``'s tokens, lengths and packed chunks of a batch (chunk slots = the student
    width, an upper bound)."""
    from megatron_xdistill.align import pack_alignments

    views = [s["teachers"][k] for s in samples]
    teacher_width = len(views[0]["teacher_tokens"])
    packed = pack_alignments(
        [v["chunks"] for v in views],
        [s["student_length"] for s in samples],
        [v["teacher_length"] for v in views],
        student_width=width,
        teacher_width=teacher_width,
        max_chunks=width,
    )
    out = {
        "teacher_tokens": torch.from_numpy(np.stack([v["teacher_tokens"] for v in views])),
        "teacher_length": torch.tensor([v["teacher_length"] for v in views], dtype=torch.int64),
    }
    for key in ("student_chunk_id", "teacher_chunk_id", "chunk_valid", "chunk_exact"):
        out[key] = packed[key]
    return out


def collate_samples(samples: Sequence[dict]) -> dict:
    """Stack samples: the student's keys, and under ``"teachers"`` one dict per teacher
    (``sample_weight`` [B] when the samples carry reward weights)."""
    width = len(samples[0]["tokens"])
    weights = {} if "weight" not in samples[0] else {  # reward weighting (on-policy)
        "sample_weight": torch.tensor([s["weight"] for s in samples], dtype=torch.float32)}
    return {
        **weights,
        "tokens": torch.from_numpy(np.stack([s["tokens"] for s in samples])),
        "loss_mask": torch.from_numpy(np.stack([s["loss_mask"] for s in samples])),
        "num_bytes": torch.tensor([s["num_bytes"] for s in samples], dtype=torch.int64),
        "teachers": [_collate_teacher(samples, k, width)
                     for k in range(len(samples[0]["teachers"]))],
    }


def teacher_view(item: dict, k: int) -> dict:
    """A sample or batch as one teacher's code sees it: the common keys and teacher ``k``'s
    keys at the top level (no ``"teachers"``). Shallow: the values are the item's own."""
    view = {key: value for key, value in item.items() if key != "teachers"}
    view.update(item["teachers"][k])
    return view
