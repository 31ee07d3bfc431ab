"""The key of a run: what its teacher payloads depend on (compared with a cache's manifest)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence

import torch

from megatron_xdistill.data.sources import source_size


def run_key(*, teacher_checkpoint: str, bf16: bool, student_vocab_hash: str,
            teacher_vocab_hash: str, sources: Sequence, text_field: str, seq_length: int,
            teacher_seq_length: int, seed: int, num_samples: int, form: str, topk: int,
            temperature: float, numel: int, common_teacher_ids=None,
            split: str | None = None, packed_with: Sequence | None = None,
            fp16: bool = False, gold_topk: Sequence[int] | None = None) -> dict:
    """Nested key: ``teacher``, ``tokenizers``, ``data`` (files by name and size: a copied
    corpus keeps its cache; each sample's tokens are checked on read anyway) and ``payload``.
    ``packed_with``: with several teachers, every teacher's (vocabulary hash, sequence length),
    since all of them decide where samples are cut. ``bf16`` / ``fp16``: the teacher's
    precision. ``gold_topk``: the compact gold payload's (k, k', n, M): its common pairs,
    uncommon probabilities, the uncommon ranks its tail sums and the common pairs in all."""
    common = None
    if common_teacher_ids is not None:
        ids = torch.as_tensor(common_teacher_ids, dtype=torch.int64).numpy().tobytes()
        common = "sha256:" + hashlib.sha256(ids).hexdigest()
    return {
        "teacher": {"checkpoint": teacher_checkpoint, "precision": "bf16" if bf16 else
                    "fp16" if fp16 else "fp32"},
        "tokenizers": {"student": student_vocab_hash, "teacher": teacher_vocab_hash},
        "data": {"files": [[os.path.basename(s.path), source_size(s.path), s.weight]
                           for s in sources],
                 "text_field": text_field, "seq_length": seq_length,
                 "teacher_seq_length": teacher_seq_length, "seed": seed,
                 "num_samples": num_samples, **({} if split is None else {"split": split}),
                 **({} if packed_with is None else {"packed_with": [list(p) for p in packed_with]})},
        "payload": {"form": form, "topk": topk, "temperature": temperature,
                    "common_vocab": common, "numel": numel,
                    **({} if gold_topk is None else {"gold_topk": [int(v) for v in gold_topk]})},
    }
