"""The distillation dataset: dual tokenisation and alignment of packed samples, in workers.

Each item is one packed sample (see :mod:`megatron_xdistill.data.packing`): the student's and the
teacher's token ids of the same text, and the aligned chunks between them. Batches carry the
packed chunk tensors of DESIGN.md (``student_chunk_id``, ``teacher_chunk_id``, ``chunk_valid``,
``chunk_exact``), the student's loss mask and the UTF-8 bytes its labels spell (bits per byte).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from megatron_xdistill.data.packing import PackingPlan, SpecialTokens


class DistillationDataset(torch.utils.data.Dataset):
    """Map-style dataset over a packing plan; ``__getitem__`` tokenises and aligns one sample."""

    def __init__(self, documents: Sequence[str], plan: PackingPlan, aligner, seq_length: int,
                 teacher_seq_length: int) -> None:
        self.documents = documents
        self.plan = plan
        self.aligner = aligner
        self.width = (seq_length + 1, teacher_seq_length + 1)
        self.special = (SpecialTokens.of(aligner.student_tokenizer),
                        SpecialTokens.of(aligner.teacher_tokenizer))

    def __len__(self) -> int:
        return len(self.plan)

    def _token_bytes(self, ids: np.ndarray) -> int:
        from megatron_xdistill.align import token_bytes_table

        table = token_bytes_table(self.aligner.student_tokenizer)
        return sum(len(table[i]) for i in ids.tolist() if 0 <= i < len(table) and table[i])

    def __getitem__(self, index: int) -> dict:
        pieces = self.plan.sample_pieces(index)
        texts = [self.documents[d][c0:c1] for d, c0, c1, _, _ in pieces.tolist()]
        clean, s_enc, t_enc = self.aligner.encode_texts(texts)
        alignments = self.aligner.align_encoded(clean, s_enc, t_enc)
        sides: list[list[int]] = [[], []]
        chunks = []
        for (_, _, _, starts_doc, ends_doc), al in zip(pieces.tolist(), alignments):
            starts = []
            for side, ids in enumerate((al.student_ids, al.teacher_ids)):
                sp = self.special[side]
                if starts_doc and sp.bos is not None:
                    sides[side].append(sp.bos)
                starts.append(len(sides[side]))
                sides[side].extend(ids.tolist())
                if ends_doc:
                    sides[side].append(sp.eos)
            if len(al.chunks_array):
                shift = np.array([starts[0], starts[0], starts[1], starts[1], 0], np.int64)
                chunks.append(al.chunks_array + shift)
        chunk_array = np.concatenate(chunks) if chunks else np.zeros((0, 5), np.int64)
        n_s, n_t = len(sides[0]), len(sides[1])
        if n_s > self.width[0] or n_t > self.width[1]:
            # Re-tokenising a piece can differ from the whole document by a token at a cut
            # (e.g. SentencePiece's prefix space): cut at the last chunk that still fits.
            fits = (chunk_array[:, 1] <= self.width[0]) & (chunk_array[:, 3] <= self.width[1])
            keep = int(np.argmin(fits)) if not fits.all() else len(fits)
            chunk_array = chunk_array[:keep]
            n_s = int(chunk_array[-1, 1]) if keep else 0
            n_t = int(chunk_array[-1, 3]) if keep else 0
            sides = [sides[0][:n_s], sides[1][:n_t]]
        tokens = np.full(self.width[0], self.special[0].pad, np.int64)
        teacher_tokens = np.full(self.width[1], self.special[1].pad, np.int64)
        tokens[:n_s] = sides[0]
        teacher_tokens[:n_t] = sides[1]
        loss_mask = np.zeros(self.width[0] - 1, np.float32)
        loss_mask[: max(n_s - 1, 0)] = 1.0
        return {
            "index": index,  # the plan's sample id (the teacher cache keys payloads by it)
            "tokens": tokens,
            "teacher_tokens": teacher_tokens,
            "student_length": n_s,
            "teacher_length": n_t,
            "chunks": chunk_array,
            "loss_mask": loss_mask,
            "num_bytes": self._token_bytes(tokens[1:n_s]),
        }


def collate_samples(samples: Sequence[dict]) -> dict[str, torch.Tensor]:
    """Stack samples and pack their chunks; chunk slots = student width (an upper bound)."""
    from megatron_xdistill.align import pack_alignments

    width = len(samples[0]["tokens"])
    teacher_width = len(samples[0]["teacher_tokens"])
    packed = pack_alignments(
        [s["chunks"] for s in samples],
        [s["student_length"] for s in samples],
        [s["teacher_length"] for s in samples],
        student_width=width,
        teacher_width=teacher_width,
        max_chunks=width,
    )
    batch = {
        "tokens": torch.from_numpy(np.stack([s["tokens"] for s in samples])),
        "teacher_tokens": torch.from_numpy(np.stack([s["teacher_tokens"] for s in samples])),
        "loss_mask": torch.from_numpy(np.stack([s["loss_mask"] for s in samples])),
        "num_bytes": torch.tensor([s["num_bytes"] for s in samples], dtype=torch.int64),
    }
    for key in ("student_chunk_id", "teacher_chunk_id", "chunk_valid", "chunk_exact"):
        batch[key] = packed[key]
    return batch
