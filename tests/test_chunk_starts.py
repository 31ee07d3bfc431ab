"""--kd-first-token's pieces: chunk starts, chunks of one teacher token, the teacher mass moved
onto first-token heads (against a dense scatter), and the heads of the real tokenizer pair.
The whole form is checked against the dense reference on HF logits in test_trainer_reference."""

from __future__ import annotations

import math

import pytest
import torch
from shared_assets import TOKENIZERS, needs_shared_assets

from megatron_xdistill.loss.definitions.chunk_starts import (
    chunk_start_ids,
    merge_into_heads,
    single_teacher_token_chunks,
)
from megatron_xdistill.loss.definitions.common import TINY
from megatron_xdistill.loss.definitions.payload import PayloadSpec, TeacherPayload


def test_chunk_starts_keep_each_chunks_first_token():
    ids = torch.tensor([[0, 1, 1, 2, 2, 2, -1, 3],
                        [-1, -1, 0, 0, 1, 2, 3, 3]])
    want = torch.tensor([[0, 1, -1, 2, -1, -1, -1, 3],
                         [-1, -1, 0, -1, 1, 2, 3, -1]])
    assert torch.equal(chunk_start_ids(ids), want)
    # a side whose first chunk is empty starts at chunk 1 (or any other id)
    assert chunk_start_ids(torch.tensor([[1, 1, 2], [5, 6, 6]])).tolist() == [[1, -1, 2],
                                                                             [5, 6, -1]]


def test_single_teacher_token_chunks_count_tokens_per_chunk():
    teacher = torch.tensor([[0, 1, 1, 2, -1, 4],
                            [0, 0, 1, 2, 2, -1]])
    want = torch.tensor([[True, False, True, False, True],
                         [False, True, False, False, False]])
    assert torch.equal(single_teacher_token_chunks(teacher, 5), want)


def _dense(columns: torch.Tensor, logprobs: torch.Tensor, width: int) -> torch.Tensor:
    return torch.zeros(*columns.shape[:-1], width, dtype=torch.float64).scatter_add(
        -1, columns, logprobs.double().exp())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_merged_payload_holds_the_top_k_mass_on_the_heads(seed):
    """Each row's mass on head h equals the summed probability of its entries whose column
    has head h; a row's columns are unique apart from the unreached id, which holds ~0; the
    tail is untouched."""
    gen = torch.Generator().manual_seed(seed)
    b, c, k, vt = 2, 5, 6, 12
    heads = torch.tensor([0, 1, 1, 3, 3, 3, 6, 7, 6, 9, 10, 11])  # idempotent; 11 unreached
    columns = torch.stack([torch.randperm(11, generator=gen)[:k] for _ in range(b * c)])
    logprobs = torch.randn(b * c, k, generator=gen).log_softmax(-1) - 0.3
    spec = PayloadSpec("chunk_topk", c, k)
    payload = TeacherPayload(spec, logprobs.reshape(b, c, k), torch.ones(b, c, dtype=torch.bool),
                             columns.reshape(b, c, k), torch.full((b, c), math.log(0.1)))
    merged = merge_into_heads(payload, heads, unreached=11)
    keep = merged.columns != 11
    want = _dense(heads[payload.columns], payload.logprobs, vt)
    got = _dense(merged.columns.clamp(max=vt - 1),
                 torch.where(keep, merged.logprobs, torch.full_like(merged.logprobs, -1e4)), vt)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    for row_cols, row_keep in zip(merged.columns.reshape(-1, k), keep.reshape(-1, k)):
        kept = row_cols[row_keep]
        assert len(kept.unique()) == len(kept)
    assert torch.all(merged.logprobs[~keep] == math.log(TINY))
    assert torch.equal(merged.tail_logprob, payload.tail_logprob)
    assert bool((~keep).any()), "the example should merge some entries"


def test_only_chunk_top_k_payloads_are_moved():
    spec = PayloadSpec("full", 2, 4)
    payload = TeacherPayload(spec, torch.zeros(1, 2, 4), torch.ones(1, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="chunk top-k payloads only"):
        merge_into_heads(payload, torch.arange(4), 3)


@needs_shared_assets
def test_heads_of_the_real_pair_are_the_twins_of_the_first_student_token():
    """SmolLM2 (student) and Qwen2 (teacher): a teacher token the student spells in pieces
    moves to the teacher token spelling its first piece; one the student spells whole, and
    byte pieces, stay; heads are their own heads."""
    from megatron_xdistill.align.canonical import token_bytes_table
    from megatron_xdistill.projection.first_token import first_token_heads
    from megatron_xdistill.projection.reencode import Reencoder
    from megatron_xdistill.projection.vocab import load_tokenizer

    student = load_tokenizer(str(TOKENIZERS / "smollm2"))
    teacher = load_tokenizer(str(TOKENIZERS / "qwen2"))
    heads = first_token_heads(student, teacher, 151936)
    assert len(heads) == 151936 and (heads[heads] == heads).all()
    table = token_bytes_table(teacher)
    ids = {b: i for i, b in reversed(list(enumerate(table))) if b}
    s_table = token_bytes_table(student)
    checked = 0
    for text in (b");\n", b";\n", b" {\n", b" return", b"(self"):
        t = ids.get(text)
        if t is None:
            continue
        first = s_table[Reencoder(student).encode([text.decode()])[0][0]]
        assert table[heads[t]] == (first if first in ids else text), text
        checked += 1
    assert checked >= 3
    assert table[heads[ids[b");\n"]]] == b");"  # the student spells it ');' + '\n'
    byte_pieces = [i for i, b in enumerate(table) if b and len(b) == 1 and b[0] >= 0x80]
    assert byte_pieces and all(heads[i] == i for i in byte_pieces)
