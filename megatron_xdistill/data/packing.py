"""Packing documents into samples in *text space*, so every tokenization fits its length.

A sample is a list of text pieces (document id, character span). Pieces end only at aligned chunk
boundaries (the student and every cross-tokenizer teacher have a token boundary there, aligned at
the same student token), so the student's tokens and each teacher's tokens of a sample cover
exactly the same text: a student sample of ``seq_length + 1`` tokens (inputs + shifted labels)
and, per teacher, a sample of ``teacher_seq_lengths[k] + 1`` tokens. A teacher with the student's
tokenizer has the student's tokens and adds no constraint. Documents start with BOS where the
tokenizer uses one and end with EOS; a document longer than a sample continues in the next one.

The plan (which pieces form which sample) is built once from a seeded document order and cached;
the DataLoader workers then tokenise and align only the text of the samples they serve.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import time
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from megatron_xdistill.data.sources import DataSource, read_documents, source_fingerprint
from megatron_xdistill.storage import atomic_file

if TYPE_CHECKING:
    from megatron_xdistill.data.tokenizations import SampleTokenizers

PLAN_VERSION = 1


@dataclass(frozen=True)
class SpecialTokens:
    """The control tokens a side wraps documents in (None: not used by that tokenizer)."""

    bos: int | None
    eos: int
    pad: int

    @classmethod
    def of(cls, tokenizer) -> SpecialTokens:
        """BOS only if the tokenizer adds one by itself (as its model was trained)."""
        eos = tokenizer.eos_token_id
        if eos is None:
            raise ValueError(f"tokenizer {tokenizer.name_or_path!r} has no EOS token to end documents")
        probe = tokenizer("a", add_special_tokens=True)["input_ids"]
        bos = tokenizer.bos_token_id
        uses_bos = bos is not None and len(probe) > 0 and probe[0] == bos
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
        return cls(bos=bos if uses_bos else None, eos=int(eos), pad=int(pad))


@dataclass
class PackingPlan:
    """Samples as pieces: ``pieces[k] = (doc, char_start, char_end, starts_doc, ends_doc)``,
    sample ``i`` is ``pieces[sample_offsets[i]:sample_offsets[i + 1]]``."""

    pieces: np.ndarray  # int64 [P, 5]
    sample_offsets: np.ndarray  # int64 [N + 1]
    key: str

    def __len__(self) -> int:
        return len(self.sample_offsets) - 1

    def sample_pieces(self, index: int) -> np.ndarray:
        return self.pieces[self.sample_offsets[index] : self.sample_offsets[index + 1]]


def document_order(sources: Sequence[DataSource], doc_counts: Sequence[int], seed: int,
                   epoch: int) -> np.ndarray:
    """Global document ids for one pass: shuffled per source, sources blended by weight.

    Without weights every document appears once per pass. With weights, each source contributes
    documents in proportion to its weight: the pass is as long as needed for every source to be
    drawn at least once in full, and sources that need more documents repeat theirs (reshuffled).
    Sources are interleaved so that every prefix of the pass follows the weights.
    """
    rng = np.random.default_rng([seed, epoch])
    starts = np.concatenate([[0], np.cumsum(doc_counts)[:-1]]).astype(np.int64)
    weights = [s.weight for s in sources]
    if all(w is None for w in weights):
        order = np.concatenate([starts[i] + rng.permutation(n) for i, n in enumerate(doc_counts)])
        return rng.permutation(order) if len(order) else order
    w = np.asarray(weights, dtype=np.float64)
    w = w / w.sum()
    counts = np.asarray(doc_counts, dtype=np.float64)
    total = int(np.ceil((counts / w).max()))  # docs per pass so that each source is used
    wanted = np.maximum(1, np.round(w * total)).astype(np.int64)
    per_source = []
    for i, n in enumerate(doc_counts):
        reps = int(np.ceil(wanted[i] / max(n, 1)))
        ids = np.concatenate([starts[i] + rng.permutation(n) for _ in range(reps)])[: wanted[i]]
        per_source.append(ids)
    # Interleave sources so that every prefix of the pass follows the weights.
    position = np.concatenate([(np.arange(len(ids)) + 0.5) / len(ids) for ids in per_source])
    merged = np.concatenate(per_source)
    return merged[np.argsort(position, kind="stable")]


def _common_starts(starts: Sequence[np.ndarray]) -> list[tuple[int, tuple[int, ...]]]:
    """Candidate cuts of one document over K cross teachers: ``(a, (p_1, .., p_K))`` for each
    student index ``a`` that starts a chunk (after the first) in every teacher's alignment, with
    each teacher's chunk start there. A teacher with several chunks starting at ``a`` (an empty
    student span) gives each combination, in chunk order; for K = 1 the list is the chunks'."""
    if len(starts) == 1:
        return [(a, (p,)) for a, p in starts[0].tolist()]
    groups: list[dict[int, list[int]]] = []
    for rows in starts:
        group: dict[int, list[int]] = {}
        for a, p in rows.tolist():
            group.setdefault(a, []).append(p)
        groups.append(group)
    common = sorted(set(groups[0]).intersection(*groups[1:]))
    return [(a, ps) for a in common for ps in itertools.product(*(g[a] for g in groups))]


def _boundaries(s_offsets: np.ndarray, cross: Sequence[tuple[np.ndarray, np.ndarray]],
                text_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Cut points of one document: char positions ``[n_cuts]`` and, per side (the student, then
    each cross teacher), the tokens before each ``[n_cuts, 1 + K]``.

    ``cross[k] = (chunks, teacher offsets)``. A cut sits where every cross teacher's alignment
    starts a chunk at the same student token; its character is the earliest end of the tokens
    just before it (trimmed offsets leave spaces to the next piece). With no cross teacher,
    every student token boundary where the next token starts after the previous one ends is a cut.
    """
    s_offsets = np.asarray(s_offsets, dtype=np.int64).reshape(-1, 2)
    t_offsets = [np.asarray(off, dtype=np.int64).reshape(-1, 2) for _, off in cross]
    if cross:
        candidates = _common_starts([chunks[1:, [0, 2]] for chunks, _ in cross])
    else:
        apart = np.flatnonzero(s_offsets[1:, 0] >= s_offsets[:-1, 1]) + 1
        candidates = [(a, ()) for a in apart.tolist()]
    chars, before = [0], [(0,) * (1 + len(cross))]
    for a, ps in candidates:
        ends = [int(s_offsets[a - 1][1])] if a > 0 else []
        ends += [int(off[p - 1][1]) for p, off in zip(ps, t_offsets, strict=True) if p > 0]
        char = min(ends) if ends else 0
        row = (a, *ps)
        if char > chars[-1] and all(x >= y for x, y in zip(row, before[-1], strict=True)):
            chars.append(char)
            before.append(row)
    chars.append(text_len)
    before.append((len(s_offsets), *(len(off) for off in t_offsets)))
    return np.asarray(chars, dtype=np.int64), np.asarray(before, dtype=np.int64)


class _Packer:
    """Greedy text-space packer over a stream of documents, for any number of sides (the
    student, then each cross teacher), each with its token budget and control tokens."""

    def __init__(self, budgets: Sequence[int], specials: Sequence[SpecialTokens]) -> None:
        self.budget = np.asarray(budgets, dtype=np.int64)
        self.bos = np.asarray([sp.bos is not None for sp in specials], dtype=np.int64)
        self.pieces: list[tuple[int, int, int, int, int]] = []
        self.offsets = [0]
        self.used = np.zeros(len(budgets), np.int64)

    def _close(self) -> None:
        if len(self.pieces) > self.offsets[-1]:
            self.offsets.append(len(self.pieces))
        self.used = np.zeros_like(self.used)

    def _largest_fit(self, before: np.ndarray, k0: int) -> int:
        """The last cut ``k > k0`` whose piece from cut ``k0`` fits every side's budget, or -1.
        Tokens before a cut only grow with the cut, so the cuts that fit are a prefix."""
        last = len(before) - 1
        room = self.budget - self.used - self.bos * (k0 == 0) + before[k0]
        if (before[last] + 1 <= room).all():  # the rest of the document, and its EOS
            return last
        fits = min(int(np.searchsorted(before[:last, side], room[side], side="right")) - 1
                   for side in range(len(room)))
        return fits if fits > k0 else -1

    def add_document(self, doc: int, chars: np.ndarray, before: np.ndarray) -> None:
        k0, last = 0, len(chars) - 1
        while k0 < last:
            fits = self._largest_fit(before, k0)
            if fits < 0:
                if not self.used.any():
                    # One aligned chunk longer than a whole sample: cut it anyway (the dataset
                    # truncates it at a token boundary); rare with real text and sane lengths.
                    fits = k0 + 1
                    need = self.budget.copy()
                else:
                    self._close()
                    continue
            else:
                need = (self.used + before[fits] - before[k0] + self.bos * (k0 == 0)
                        + (fits == last))
            self.pieces.append((doc, int(chars[k0]), int(chars[fits]), int(k0 == 0),
                                int(fits == last)))
            self.used = need
            if fits < last:
                self._close()
            k0 = fits

    def finish(self) -> tuple[np.ndarray, np.ndarray]:
        self._close()
        pieces = np.asarray(self.pieces, dtype=np.int64).reshape(-1, 5)
        return pieces, np.asarray(self.offsets, dtype=np.int64)


def _per_teacher(values: Sequence, what: str) -> list:
    """``values`` as a list, refusing a bare string or number (one value per teacher)."""
    if isinstance(values, str | bytes) or not isinstance(values, Sequence):
        raise TypeError(f"{what} must be a sequence with one entry per teacher, got {values!r}")
    if not len(values):
        raise ValueError(f"{what}: at least one teacher is needed")
    return list(values)


def plan_key(sources: Sequence[DataSource], text_field: str, student_name: str,
             teacher_names: Sequence[str], seq_length: int, teacher_seq_lengths: Sequence[int],
             seed: int, num_samples: int, data_tokenizer: str | None = None,
             split: str | None = None) -> str:
    """Cache key of a plan: inputs, tokenizers, lengths, seed and size (and, where they apply,
    the tokenizer that decodes Megatron indexed datasets and the --split of the documents).
    One teacher gives the key of the one-teacher plans before (its name and length as scalars)."""
    names = _per_teacher(teacher_names, "teacher_names")
    lengths = [int(n) for n in _per_teacher(teacher_seq_lengths, "teacher_seq_lengths")]
    if len(names) != len(lengths):
        raise ValueError(f"{len(names)} teacher names for {len(lengths)} teacher lengths")
    one = len(names) == 1
    parts = [PLAN_VERSION, source_fingerprint(sources), text_field, student_name,
             names[0] if one else names, seq_length, lengths[0] if one else lengths, seed,
             num_samples]
    if data_tokenizer is not None:
        parts.append(data_tokenizer)
    if split is not None:
        parts.append(["split", split])
    blob = json.dumps(parts)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def _document_cuts(tokenizers: SampleTokenizers, texts: list[str]) -> list[tuple]:
    """:func:`_boundaries` of each text over the cross teachers of ``tokenizers``."""
    clean, student, teachers = tokenizers.encode(texts)
    alignments = tokenizers.align(clean, student, teachers)
    cross = tokenizers.cross_teachers
    out = []
    for j, (text, (_ids, s_offsets)) in enumerate(zip(clean, student, strict=True)):
        sides = [(alignments[k][j].chunks_array, teachers[k][j][1]) for k in cross]
        out.append(_boundaries(s_offsets, sides, len(text)))
    return out


def build_plan(documents: Sequence[str], sources: Sequence[DataSource], doc_counts: Sequence[int],
               tokenizers: SampleTokenizers, seq_length: int, teacher_seq_lengths: Sequence[int],
               seed: int, num_samples: int, key: str = "", log=print,
               batch_docs: int = 64) -> PackingPlan:
    """Pack documents (in seeded, weighted order, more passes as needed) into ``num_samples``.

    Budgets: the student's ``seq_length + 1`` tokens and each cross teacher's
    ``teacher_seq_lengths[k] + 1``; a same-tokenizer teacher's tokens are the student's."""
    lengths = tokenizers.check_lengths(seq_length, teacher_seq_lengths)
    cross = tokenizers.cross_teachers
    specials = [SpecialTokens.of(tokenizers.student_tokenizer)]
    specials += [SpecialTokens.of(tokenizers.teacher_tokenizers[k]) for k in cross]
    packer = _Packer([seq_length + 1] + [lengths[k] + 1 for k in cross], specials)
    boundaries: dict[int, tuple] = {}
    start, last_log, epoch = time.time(), time.time(), 0
    while len(packer.offsets) - 1 < num_samples:
        order = document_order(sources, doc_counts, seed, epoch)
        if not len(order):
            raise ValueError("the data files hold no documents")
        for lo in range(0, len(order), batch_docs):
            ids = [int(d) for d in order[lo : lo + batch_docs]]
            todo = [d for d in dict.fromkeys(ids) if d not in boundaries and documents[d]]
            if todo:
                cuts = _document_cuts(tokenizers, [documents[d] for d in todo])
                boundaries.update(zip(todo, cuts, strict=True))
            for d in ids:
                if documents[d]:
                    packer.add_document(d, *boundaries[d])
            if len(packer.offsets) - 1 >= num_samples:
                break
            if time.time() - last_log > 10:
                log(f"  packing: {len(packer.offsets) - 1}/{num_samples} samples "
                    f"({time.time() - start:.0f} s)")
                last_log = time.time()
        epoch += 1
    pieces, offsets = packer.finish()
    n = min(num_samples, len(offsets) - 1)
    offsets = offsets[: n + 1]
    pieces = pieces[: offsets[-1]]
    log(f"  packed {n} samples from {epoch} pass(es) over {len(documents)} documents "
        f"in {time.time() - start:.1f} s")
    return PackingPlan(pieces=pieces, sample_offsets=offsets, key=key)


def load_documents(sources: Sequence[DataSource], text_field: str,
                   data_tokenizer: str | None = None) -> tuple[list[str], list[int]]:
    """All documents of all sources, concatenated, and the count per source.
    ``data_tokenizer``: decodes Megatron indexed datasets (the tokenizer that made them)."""
    documents: list[str] = []
    counts = []
    for source in sources:
        docs = read_documents(source.path, text_field, data_tokenizer)
        if source.weight is not None and not any(d.strip() for d in docs):
            raise ValueError(f"{source.path}: no text (field {text_field!r}) to draw its weight "
                             f"{source.weight} from; remove it from --data-path or fill it")
        documents.extend(docs)
        counts.append(len(docs))
    if not documents:
        raise ValueError(f"no documents in {[s.path for s in sources]}")
    if not any(d.strip() for d in documents):
        raise ValueError(f"every document in {[s.path for s in sources]} is empty (field "
                         f"{text_field!r}); is --text-field the field that holds the text?")
    return documents, counts


def save_plan(plan: PackingPlan, path: str) -> None:
    """Write as NumPy arrays (``.npz``; no pickle: a cache file from elsewhere can not run code),
    atomically (temp file + rename): an interrupted write leaves no partial plan."""
    with atomic_file(path) as tmp, open(tmp, "wb") as fh:
        np.savez(fh, version=np.int64(PLAN_VERSION), key=np.str_(plan.key),
                 pieces=plan.pieces, sample_offsets=plan.sample_offsets)


def load_plan(path: str, key: str) -> PackingPlan | None:
    """A cached plan with this key, or None (absent, another key or version, or unreadable:
    the plan is then built again, identically)."""
    if not os.path.exists(path):
        return None
    try:
        with np.load(path, allow_pickle=False) as blob:
            if int(blob["version"]) != PLAN_VERSION or str(blob["key"]) != key:
                return None
            return PackingPlan(pieces=blob["pieces"], sample_offsets=blob["sample_offsets"],
                               key=key)
    except (OSError, ValueError, KeyError, zipfile.BadZipFile, EOFError):
        return None
