"""Megatron indexed datasets as text documents.

``--data-path`` may name the prefix of a dataset that Megatron-LM's ``preprocess_data.py`` made
(``PREFIX.bin`` + ``PREFIX.idx``). Distillation tokenises every document twice, once per model,
so the token ids are turned back into text: read with Megatron-Core's own ``IndexedDataset`` and
decoded with the tokenizer that made them (``--data-tokenizer-model``, default
``--tokenizer-model`` as in Megatron-LM). Special tokens (the EOD that ``--append-eod`` adds, a
BOS) are dropped: the packing adds its own. Ids beyond that tokenizer's vocabulary stop the read
with the document and the tokenizer named (the data was made with another tokenizer).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from functools import lru_cache

import numpy as np

_DECODE_BATCH = 512  # documents per batch_decode call


def is_indexed_prefix(path: str) -> bool:
    """Whether ``path`` is the prefix of a Megatron indexed dataset (``.bin`` and ``.idx``)."""
    return os.path.isfile(path + ".bin") and os.path.isfile(path + ".idx")


def indexed_files(prefix: str) -> list[str]:
    """The two files behind a prefix (for fingerprints)."""
    return [prefix + ".idx", prefix + ".bin"]


@lru_cache(maxsize=4)
def _tokenizer(path: str):
    from megatron_xdistill.align import load_tokenizer

    return load_tokenizer(path)


def read_indexed_documents(prefix: str, tokenizer_path: str | None,
                           flag: str = "--data-tokenizer-model",
                           only: Sequence[int] | None = None) -> list[str]:
    """The documents of the indexed dataset at ``prefix``, decoded to text with the tokenizer
    at ``tokenizer_path`` (``only``: just these documents, in that order; the dataset is
    memory-mapped, so the others are never read)."""
    if tokenizer_path is None:
        raise ValueError(f"{prefix} is a Megatron indexed dataset (.bin/.idx): its token ids are "
                         f"decoded with the tokenizer that made them; pass {flag}")
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    tokenizer = _tokenizer(tokenizer_path)
    vocab = len(tokenizer)
    try:
        dataset = IndexedDataset(prefix)
    except Exception as exc:  # noqa: BLE001 - Megatron raises assertion and value errors alike
        raise ValueError(f"{prefix}: not a readable Megatron indexed dataset ({exc}); are "
                         f"{prefix}.bin and {prefix}.idx from the same preprocess_data.py run?"
                         ) from exc
    bounds = np.asarray(dataset.document_indices)
    wanted = list(range(len(bounds) - 1)) if only is None else [int(d) for d in only]
    documents: list[str] = []
    for first in range(0, len(wanted), _DECODE_BATCH):
        batch = []
        for doc in wanted[first: first + _DECODE_BATCH]:
            parts = [dataset[i] for i in range(int(bounds[doc]), int(bounds[doc + 1]))]
            ids = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
            if ids.size and int(ids.max()) >= vocab:
                raise ValueError(
                    f"{prefix}: document {doc} holds token id {int(ids.max())} but the tokenizer "
                    f"{tokenizer_path} has {vocab} tokens: the data was made with another "
                    f"tokenizer; pass the one that made it with {flag}")
            batch.append(ids.tolist())
        documents.extend(tokenizer.batch_decode(batch, skip_special_tokens=True,
                                                clean_up_tokenization_spaces=False))
    return documents
