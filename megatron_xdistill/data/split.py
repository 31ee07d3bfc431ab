"""``--split``: Megatron-LM's train / valid / test split of the documents of ``--data-path``.

Each source is split on its own, by document, exactly as Megatron-Core splits each dataset of a
blend: the split string is parsed and normalised by Megatron-Core's own functions
(``"969,30,1"`` -> 0.969 / 0.030 / 0.001), and part ``i`` of a source with ``n`` documents is
``[round(begin_i * n), round(end_i * n))``. Train keeps the first part, validation (evaluated in
the loop, instead of ``--valid-data-path``) the second; the test part is left untouched.
"""

from __future__ import annotations

from collections.abc import Sequence

from megatron_xdistill.data.sources import DataSource

#: ``(sources, documents, documents per source)``, as ``packing.load_documents`` gives them
Loaded = tuple[list[DataSource], list[str], list[int]]


def split_ranges(split: str, count: int) -> list[tuple[int, int] | None]:
    """Document ranges ``[begin, end)`` of the train, valid and test parts of ``count``
    documents (None: an empty part), by Megatron-Core's rule."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    return [None if part is None else (int(round(part[0] * count)), int(round(part[1] * count)))
            for part in matrix]


def check_split(split: str) -> None:
    """Refuse a split string that Megatron would not parse or that trains on nothing."""
    import numpy as np

    try:
        with np.errstate(invalid="ignore", divide="ignore"):  # all-zero shares: NaN, refused
            ranges = split_ranges(split, 10**9)
    except (AssertionError, ValueError, ZeroDivisionError):
        raise ValueError(f"--split {split!r}: expected up to three non-negative shares "
                         f"train,valid,test such as 969,30,1") from None
    if ranges[0] is None or ranges[0][1] == ranges[0][0]:
        raise ValueError(f"--split {split!r} gives training no documents")


def split_loaded(loaded: Loaded, split: str) -> tuple[Loaded, Loaded]:
    """The training and the validation part of every source of ``loaded``."""
    sources, documents, counts = loaded
    parts: list[tuple[list[str], list[int]]] = [([], []), ([], [])]
    start = 0
    for count in counts:
        docs = documents[start : start + count]
        start += count
        for part, (kept, kept_counts) in zip(split_ranges(split, count)[:2], parts):
            begin, end = part if part is not None else (0, 0)
            kept.extend(docs[begin:end])
            kept_counts.append(end - begin)
    _check_parts(sources, parts, split)
    (train, train_counts), (valid, valid_counts) = parts
    return (sources, train, train_counts), (sources, valid, valid_counts)


def _check_parts(sources: Sequence[DataSource], parts, split: str) -> None:
    for name, (docs, counts) in zip(("training", "validation"), parts):
        if name == "validation" and not docs:
            raise ValueError(f"--split {split} leaves no validation documents in "
                             f"{[s.path for s in sources]}; give validation a larger share or "
                             f"use --valid-data-path")
        for source, count in zip(sources, counts):
            if source.weight is not None and count == 0 and docs:
                raise ValueError(f"--split {split} leaves {source.path} no {name} documents to "
                                 f"draw its weight {source.weight} from; give {name} a larger "
                                 f"share or drop the file's weight")
