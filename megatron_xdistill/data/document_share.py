"""Each rank holds only the documents its own samples are cut from.

Rank 0 reads the whole corpus once, to plan the packing (and derive the teacher's length); the
plan says which document every sample's pieces come from. A rank's samples over the rest of the
run (its DP share of every global batch) therefore name the documents it needs, about 1 / DP of
them, and it reads just those, through each file's own random access
(:func:`sources.read_documents_at`): memory and decoding scale with the share, not the corpus.

Document ids are those of the planned list: the sources one after another, each cut to its
``--split`` part. :class:`DocumentNumbering` maps them back to (file, document in the file).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from megatron_xdistill.data.packing import PackingPlan
from megatron_xdistill.data.sources import DataSource, read_documents_at


@dataclass(frozen=True)
class DocumentNumbering:
    """The planned document list: source ``i`` contributes its documents
    ``[ranges[i][0], ranges[i][1])`` (file-local), in order."""

    sources: Sequence[DataSource]
    ranges: Sequence[tuple[int, int]]

    @classmethod
    def whole(cls, sources: Sequence[DataSource], counts: Sequence[int]) -> DocumentNumbering:
        """Every document of every source."""
        return cls(list(sources), [(0, int(c)) for c in counts])

    @property
    def counts(self) -> list[int]:
        return [end - begin for begin, end in self.ranges]

    def __len__(self) -> int:
        return sum(self.counts)

    def by_source(self, doc_ids: np.ndarray) -> Iterator[tuple[DataSource, np.ndarray,
                                                                 np.ndarray]]:
        """For each source holding some of ``doc_ids`` (ascending): (source, those ids,
        their indices within the source's file)."""
        first = np.concatenate([[0], np.cumsum(self.counts)])
        if len(doc_ids) and (doc_ids[0] < 0 or doc_ids[-1] >= first[-1]):
            raise IndexError(f"document ids {int(doc_ids[0])}..{int(doc_ids[-1])} outside the "
                             f"{int(first[-1])} planned documents")
        which = np.searchsorted(first, doc_ids, side="right") - 1
        for s in np.unique(which):
            ids = doc_ids[which == s]
            yield self.sources[s], ids, ids - first[s] + self.ranges[s][0]


def documents_of_samples(plan: PackingPlan, samples: np.ndarray) -> np.ndarray:
    """The ascending ids of the documents the pieces of ``samples`` (plan indices) cut from."""
    samples = np.unique(np.asarray(samples, dtype=np.int64))
    if not len(samples):
        return np.zeros(0, dtype=np.int64)
    offsets = plan.sample_offsets
    lengths = offsets[samples + 1] - offsets[samples]
    rows = np.repeat(offsets[samples] - np.cumsum(lengths) + lengths, lengths) + np.arange(
        int(lengths.sum()))
    return np.unique(plan.pieces[rows, 0])


def step_samples(local: Sequence[int], first_step: int, last_step: int,
                 global_batch_size: int, num_samples: int) -> np.ndarray:
    """The plan indices a rank reads at steps [first_step, last_step): its positions ``local``
    in each global batch (wrapping around the plan, as ``loader.StepSampler`` does)."""
    steps = np.arange(first_step, max(first_step, last_step), dtype=np.int64)
    ids = steps[:, None] * global_batch_size + np.asarray(local, dtype=np.int64)[None, :]
    return np.unique(ids % max(num_samples, 1))


class DocumentShare(Mapping):
    """Documents by planned id, for the ids read (a mapping: ``share[doc]`` is its text)."""

    def __init__(self, texts: dict[int, str], total: int) -> None:
        self._texts, self.total = texts, total

    @classmethod
    def read(cls, numbering: DocumentNumbering, doc_ids: np.ndarray, text_field: str,
             data_tokenizer: str | None = None) -> DocumentShare:
        """Read documents ``doc_ids`` (ascending planned ids) from their files."""
        texts: dict[int, str] = {}
        for source, ids, local in numbering.by_source(np.asarray(doc_ids, dtype=np.int64)):
            for doc, text in zip(ids.tolist(), read_documents_at(
                    source.path, local.tolist(), text_field, data_tokenizer)):
                texts[doc] = text
        return cls(texts, len(numbering))

    @classmethod
    def take(cls, documents: Sequence[str], doc_ids: np.ndarray) -> DocumentShare:
        """Documents ``doc_ids`` of a list already in memory (rank 0 after planning)."""
        return cls({int(d): documents[int(d)] for d in doc_ids}, len(documents))

    def __getitem__(self, doc: int) -> str:
        try:
            return self._texts[int(doc)]
        except KeyError:
            raise KeyError(f"document {doc} is not in this rank's share ({len(self._texts)} of "
                           f"{self.total} documents): the sampler asked for a sample that the "
                           f"share was not read for") from None

    def __len__(self) -> int:
        return len(self._texts)

    def __iter__(self) -> Iterator[int]:
        return iter(self._texts)


__all__ = ["DocumentNumbering", "DocumentShare", "documents_of_samples", "step_samples"]
