"""Training samples from rollouts: a prompt and a response (sampled by the student, or a
reference answer), in the packed form the distillation runtime trains on.

The student's tokens are its prompt ids followed by the response ids as generated (never
re-tokenised). Each teacher reads the same conversation as text: its own prompt ids (its chat
template) followed by its tokenisation of the response's text. Only the response is aligned
(the DP aligner, since the student's side has ids but no offsets), so every chunk lies in the
response: the prompt carries no loss. Response tokens that are not the student's own (tool or
environment output inside a multi-turn response, ``Rollout.own``) are context only: a chunk
that covers one is dropped, and they carry no CE. CE (``loss_mask``) covers the response of an
off-policy (reference) sample only; a sample the student wrote itself teaches through the
divergence alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from megatron_xdistill.align import ids_bytes, token_bytes_table
from megatron_xdistill.data.packing import SpecialTokens
from megatron_xdistill.data.tokenizations import SampleTokenizers
from megatron_xdistill.onpolicy.prompts import PromptRecord, prompt_ids


@dataclass(frozen=True)
class Rollout:
    """One sequence of a batch: ``prompt`` (the record's index), the student's prompt and
    response ids, whether the response ended on EOS, whether the student wrote it
    (``on_policy``; False: a reference answer) and which response tokens are its own."""

    prompt: int
    student_prompt: tuple[int, ...]
    response: tuple[int, ...]
    finished: bool
    on_policy: bool = True
    own: tuple[bool, ...] | None = None  # None: every response token
    reward: float | None = None  # the reward function's score of the response (if any)

    def own_mask(self) -> np.ndarray:
        if self.own is None:
            return np.ones(len(self.response), dtype=bool)
        if len(self.own) != len(self.response):
            raise ValueError(f"prompt {self.prompt}: the response mask has {len(self.own)} "
                             f"entries for {len(self.response)} response tokens")
        return np.asarray(self.own, dtype=bool)


def _padded(tokens: Sequence[int], width: int, pad: int) -> np.ndarray:
    out = np.full(width, pad, np.int64)
    out[: len(tokens)] = tokens
    return out


class SampleBuilder:
    """Builds the sample dicts of :class:`~megatron_xdistill.data.dataset.DistillationDataset`'s
    form from rollouts. Each teacher's prompt ids are computed once per prompt record."""

    def __init__(self, tokenizers: SampleTokenizers, records: Sequence[PromptRecord],
                 seq_length: int, teacher_seq_lengths: Sequence[int],
                 chat_template: bool = True) -> None:
        lengths = tokenizers.check_lengths(seq_length, teacher_seq_lengths)
        self.tokenizers = tokenizers
        self.records = records
        self.width = seq_length + 1
        self.teacher_widths = [n + 1 for n in lengths]
        self.chat_template = chat_template
        self.special = SpecialTokens.of(tokenizers.student_tokenizer)
        self.teacher_special = [SpecialTokens.of(t) for t in tokenizers.teacher_tokenizers]
        self._teacher_prompts: dict[tuple[int, int], list[int]] = {}
        #: chunks dropped because a teacher's tokens did not fit its sequence length
        self.truncated_chunks = 0

    def student_prompt(self, record: PromptRecord) -> list[int]:
        return prompt_ids(self.tokenizers.student_tokenizer, record, self.chat_template)

    def _teacher_prompt(self, k: int, record: PromptRecord) -> list[int]:
        key = (k, record.index)
        if key not in self._teacher_prompts:
            self._teacher_prompts[key] = prompt_ids(self.tokenizers.teacher_tokenizers[k], record,
                                                    self.chat_template)
        return self._teacher_prompts[key]

    def response_text(self, response: Sequence[int]) -> str:
        """The text the response ids spell (their canonical bytes: a leading space is kept, as
        the response continues the prompt; special tokens spell nothing)."""
        return ids_bytes(self.tokenizers.student_tokenizer, response).decode("utf-8",
                                                                              errors="replace")

    def build(self, index: int, rollout: Rollout, weight: float | None = None) -> dict:
        """The sample of ``rollout`` (``index``: its id, e.g. step x global batch + position;
        ``weight``: how many times its chunks count in the KD sum, reward weighting)."""
        own = rollout.own_mask()
        s_tokens = [*rollout.student_prompt, *rollout.response]
        start, n_s = len(rollout.student_prompt), len(s_tokens)
        if n_s > self.width:
            raise ValueError(f"prompt {rollout.prompt}: {start} prompt + "
                             f"{len(rollout.response)} response tokens exceed --seq-length + 1 "
                             f"= {self.width}")
        tokens = _padded(s_tokens, self.width, self.special.pad)
        loss_mask = np.zeros(self.width - 1, np.float32)
        if not rollout.on_policy:  # CE on the reference answer's own tokens
            loss_mask[start - 1: n_s - 1] = own
        record = self.records[rollout.prompt]
        text = self.response_text(rollout.response)
        teachers = []
        for k, aligner in enumerate(self.tokenizers.aligners):
            if aligner is None:  # the student's tokenizer: one exact chunk per own token
                pos = np.flatnonzero(own) + start
                chunks = np.stack([pos, pos + 1, pos, pos + 1, np.ones_like(pos)], axis=1)
                teachers.append({"teacher_tokens": tokens.copy(), "teacher_length": n_s,
                                 "chunks": chunks.astype(np.int64).reshape(-1, 5)})
                continue
            t_prompt = self._teacher_prompt(k, record)
            tok = self.tokenizers.teacher_tokenizers[k]
            t_response = [int(i) for i in tok(text, add_special_tokens=False)["input_ids"]]
            # A prefix-space tokenizer (SentencePiece) may add a space before the first word:
            # it is no text of the response unless the response starts with one.
            t_table = token_bytes_table(tok)
            first = t_table[t_response[0]] if t_response and 0 <= t_response[0] < len(
                t_table) else None
            added_space = bool(first) and first[:1] == b" " and not text.startswith(" ")
            alignment = aligner.align_ids(list(rollout.response), t_response,
                                          student_prefix_space=False,
                                          teacher_prefix_space=added_space)
            chunks = alignment.chunks_array + np.array(
                [start, start, len(t_prompt), len(t_prompt), 0], np.int64)
            if len(chunks):
                keep = np.array([own[a - start: b - start].all() for a, b in chunks[:, :2]])
                chunks = chunks[keep]
            t_tokens = [*t_prompt, *t_response]
            width = self.teacher_widths[k]
            if len(t_tokens) > width:
                fits = chunks[:, 3] <= width
                self.truncated_chunks += int((~fits).sum())
                chunks, t_tokens = chunks[fits], t_tokens[:width]
            teachers.append({"teacher_tokens": _padded(t_tokens, width,
                                                       self.teacher_special[k].pad),
                             "teacher_length": len(t_tokens), "chunks": chunks})
        own_ids = [i for i, mine in zip(rollout.response, own) if mine]
        extra = {} if weight is None else {"weight": float(weight)}
        return {
            **extra,
            "index": index,
            "tokens": tokens,
            "student_length": n_s,
            "loss_mask": loss_mask,
            "num_bytes": len(ids_bytes(self.tokenizers.student_tokenizer, own_ids)),
            "teachers": teachers,
            "prompt": rollout.prompt,
            "response_start": start,
        }
