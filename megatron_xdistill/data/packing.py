"""Packing documents into samples in *text space*, so both tokenizations fit their lengths.

A sample is a list of text pieces (document id, character span). Pieces end only at aligned chunk
boundaries (both tokenizers have a token boundary there), so the student's tokens and the
teacher's tokens of a sample cover exactly the same text: a student sample of ``seq_length + 1``
tokens (inputs + shifted labels) and a teacher sample of ``teacher_seq_length + 1`` tokens.
Documents start with BOS where the tokenizer uses one and end with EOS; a document longer than a
sample continues in the next one.

The plan (which pieces form which sample) is built once from a seeded document order and cached;
the DataLoader workers then tokenise and align only the text of the samples they serve.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from megatron_xdistill.data.sources import DataSource, read_documents, source_fingerprint
from megatron_xdistill.storage import atomic_file

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


def _boundaries(alignment, s_offsets: np.ndarray, t_offsets: np.ndarray, text_len: int):
    """Cut points of one document: char position, student and teacher tokens before it."""
    chunks = alignment.chunks_array
    n, m = len(alignment.student_ids), len(alignment.teacher_ids)
    chars, s_before, t_before = [0], [0], [0]
    for a, _b, p, _q, _e in chunks[1:] if len(chunks) else []:
        # Cut right after the previous tokens end (trimmed offsets leave spaces to the next piece).
        ends = []
        if a > 0:
            ends.append(int(s_offsets[a - 1][1]))
        if p > 0:
            ends.append(int(t_offsets[p - 1][1]))
        char = min(ends) if ends else 0
        if char > chars[-1] and a >= s_before[-1] and p >= t_before[-1]:
            chars.append(char)
            s_before.append(int(a))
            t_before.append(int(p))
    chars.append(text_len)
    s_before.append(n)
    t_before.append(m)
    return np.asarray(chars), np.asarray(s_before), np.asarray(t_before)


class _Packer:
    """Greedy text-space packer over a stream of documents."""

    def __init__(self, student_budget: int, teacher_budget: int, s_special: SpecialTokens,
                 t_special: SpecialTokens) -> None:
        self.budget = (student_budget, teacher_budget)
        self.special = (s_special, t_special)
        self.pieces: list[tuple[int, int, int, int, int]] = []
        self.offsets = [0]
        self.used = [0, 0]

    def _close(self) -> None:
        if len(self.pieces) > self.offsets[-1]:
            self.offsets.append(len(self.pieces))
        self.used = [0, 0]

    def add_document(self, doc: int, chars: np.ndarray, s_before: np.ndarray,
                     t_before: np.ndarray) -> None:
        k0, last = 0, len(chars) - 1
        while k0 < last:
            starts_doc = k0 == 0
            fits = -1
            for k in range(last, k0, -1):  # largest cut that fits
                ends_doc = k == last
                need = []
                for side, before in enumerate((s_before, t_before)):
                    sp = self.special[side]
                    extra = (starts_doc and sp.bos is not None) + ends_doc
                    need.append(self.used[side] + before[k] - before[k0] + extra)
                if need[0] <= self.budget[0] and need[1] <= self.budget[1]:
                    fits = k
                    self.pending_need = need
                    break
            if fits < 0:
                if self.used == [0, 0]:
                    # One aligned chunk longer than a whole sample: cut it anyway (the dataset
                    # truncates it at a token boundary); rare with real text and sane lengths.
                    fits = k0 + 1
                    self.pending_need = list(self.budget)
                else:
                    self._close()
                    continue
            self.pieces.append((doc, int(chars[k0]), int(chars[fits]), int(starts_doc),
                                int(fits == last)))
            self.used = self.pending_need
            if fits < last:
                self._close()
            k0 = fits

    def finish(self) -> tuple[np.ndarray, np.ndarray]:
        self._close()
        pieces = np.asarray(self.pieces, dtype=np.int64).reshape(-1, 5)
        return pieces, np.asarray(self.offsets, dtype=np.int64)


def plan_key(sources: Sequence[DataSource], text_field: str, student_name: str,
             teacher_name: str, seq_length: int, teacher_seq_length: int, seed: int,
             num_samples: int, data_tokenizer: str | None = None,
             split: str | None = None) -> str:
    """Cache key of a plan: inputs, tokenizers, lengths, seed and size (and, where they apply,
    the tokenizer that decodes Megatron indexed datasets and the --split of the documents)."""
    parts = [PLAN_VERSION, source_fingerprint(sources), text_field, student_name, teacher_name,
             seq_length, teacher_seq_length, seed, num_samples]
    if data_tokenizer is not None:
        parts.append(data_tokenizer)
    if split is not None:
        parts.append(["split", split])
    blob = json.dumps(parts)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def build_plan(documents: Sequence[str], sources: Sequence[DataSource], doc_counts: Sequence[int],
               aligner, seq_length: int, teacher_seq_length: int, seed: int, num_samples: int,
               key: str = "", log=print, batch_docs: int = 64) -> PackingPlan:
    """Pack documents (in seeded, weighted order, more passes as needed) into ``num_samples``."""
    s_special = SpecialTokens.of(aligner.student_tokenizer)
    t_special = SpecialTokens.of(aligner.teacher_tokenizer)
    packer = _Packer(seq_length + 1, teacher_seq_length + 1, s_special, t_special)
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
                texts, s_enc, t_enc = aligner.encode_texts([documents[d] for d in todo])
                alignments = aligner.align_encoded(texts, s_enc, t_enc)
                for d, text, al, se, te in zip(todo, texts, alignments, s_enc, t_enc):
                    boundaries[d] = _boundaries(al, se[1], te[1], len(text))
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
