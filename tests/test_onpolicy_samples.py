"""On-policy samples from rollouts, with real tokenizers.

References: the alignment of a response (the DP path over ids, as generated ids have no
offsets) equals the offset-path alignment of the same text tokenised by both tokenizers; the
teacher's tokens spell the response's text; the prompt carries no chunk and no CE; tool tokens
inside a response are context only; a same-tokenizer teacher takes one chunk per own token.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from shared_assets import ASSETS, TOKENIZERS, needs_shared_assets

from megatron_xdistill.align import load_tokenizer
from megatron_xdistill.data.tokenizations import SampleTokenizers
from megatron_xdistill.onpolicy.prompts import (
    PromptFields,
    PromptRecord,
    check_answers,
    prompt_ids,
    read_prompts,
    response_ids,
)
from megatron_xdistill.onpolicy.samples import Rollout, SampleBuilder

pytestmark = needs_shared_assets


@pytest.fixture(scope="module")
def toks():
    return {name: load_tokenizer(TOKENIZERS / name) for name in ("smollm2", "qwen2", "mistral",
                                                                   "gemma3")}


def _texts(n: int) -> list[str]:
    lines = (ASSETS / "corpora" / "enwiki_val.jsonl").read_text().splitlines()
    out = []
    for line in lines:
        text = json.loads(line)["text"]
        out += [text[i: i + 300] for i in range(0, min(len(text), 1500), 300)]
    return out[:n]


RECORDS = [PromptRecord(0, "t:1", text="Tell me about history."),
           PromptRecord(1, "t:2", messages=({"role": "system", "content": "Be brief."},
                                            {"role": "user", "content": "Why is the sky blue?"}),
                        answer=" Rayleigh scattering.")]


@pytest.mark.parametrize("student,teacher", [("smollm2", "qwen2"), ("mistral", "gemma3"),
                                             ("qwen2", "mistral")])
def test_response_chunks_equal_the_offset_alignment_of_its_text(toks, student, teacher):
    tokenizers = SampleTokenizers(toks[student], [toks[teacher]])
    builder = SampleBuilder(tokenizers, RECORDS, seq_length=1024, teacher_seq_lengths=[1024])
    aligner = tokenizers.aligners[0]
    checked = exact = 0
    for text in _texts(12):
        response = " " + text.strip()  # a response continues its prompt after a space
        prompt = builder.student_prompt(RECORDS[0])
        ids = toks[student](response, add_special_tokens=False)["input_ids"]
        eos = toks[student].eos_token_id
        sample = builder.build(7, Rollout(0, tuple(prompt), (*ids, eos), finished=True))
        view = sample["teachers"][0]
        t_prompt = prompt_ids(toks[teacher], RECORDS[0])
        t_ids = view["teacher_tokens"][len(t_prompt): view["teacher_length"]]
        assert toks[teacher].decode(t_ids) == toks[student].decode(ids) or \
            builder.response_text(ids) == response
        reference = aligner.align_text(response)  # both tokenizers' offsets over the text
        if list(reference.student_ids) != list(ids) or \
                list(reference.teacher_ids) != list(t_ids):
            continue  # the teacher re-tokenised differently in context: not comparable
        got = view["chunks"] - np.array([len(prompt), len(prompt), len(t_prompt),
                                         len(t_prompt), 0])
        assert np.array_equal(got, reference.chunks_array), text[:40]
        checked += 1
        exact += int(got[:, 4].sum()) / len(got)
        assert (view["chunks"][:, 0] >= len(prompt)).all()  # the prompt has no chunk
        assert sample["loss_mask"].sum() == 0  # a student's own sample: no CE
        assert sample["student_length"] == len(prompt) + len(ids) + 1
    assert checked >= 8 and exact / checked > 0.9, (checked, exact / checked)


def test_tool_tokens_are_context_only_and_reference_answers_take_ce(toks):
    tokenizers = SampleTokenizers(toks["smollm2"], [toks["qwen2"], toks["smollm2"]])
    builder = SampleBuilder(tokenizers, RECORDS, seq_length=256,
                            teacher_seq_lengths=[256, 256])
    prompt = builder.student_prompt(RECORDS[1])
    first = toks["smollm2"](" The answer", add_special_tokens=False)["input_ids"]
    tool = toks["smollm2"](" [tool: 42]", add_special_tokens=False)["input_ids"]
    last = toks["smollm2"](" is 42.", add_special_tokens=False)["input_ids"]
    response = (*first, *tool, *last)
    own = (True,) * len(first) + (False,) * len(tool) + (True,) * len(last)
    start, n = len(prompt), len(prompt) + len(response)
    tool_span = range(start + len(first), start + len(first) + len(tool))
    sample = builder.build(0, Rollout(1, tuple(prompt), response, finished=False,
                                      on_policy=False, own=own))
    cross, same = sample["teachers"]
    for chunk in cross["chunks"]:
        assert not set(range(chunk[0], chunk[1])) & set(tool_span)
    assert cross["chunks"][:, 0].min() == start and cross["chunks"][:, 1].max() == n
    assert same["chunks"][:, 0].tolist() == [p for p in range(start, n) if p not in tool_span]
    expected = np.zeros(256, np.float32)  # --seq-length positions
    for p in range(start, n):  # position p - 1 predicts token p
        expected[p - 1] = p not in tool_span
    assert np.array_equal(sample["loss_mask"], expected)
    assert sample["num_bytes"] == len(b" The answer is 42.")


def test_each_tokenizer_uses_its_own_chat_template(toks):
    record = RECORDS[1]
    smol = prompt_ids(toks["smollm2"], record)
    text = toks["smollm2"].decode(smol)
    assert "Why is the sky blue?" in text and text.rstrip().endswith("assistant")
    mistral = prompt_ids(toks["mistral"], record)  # no template: the turns as text
    assert mistral == toks["mistral"]("Be brief.\n\nWhy is the sky blue?")["input_ids"]
    assert prompt_ids(toks["smollm2"], record, chat_template=False) == \
        toks["smollm2"]("Be brief.\n\nWhy is the sky blue?")["input_ids"]
    assert response_ids(toks["qwen2"], "ok", 7)[-1] == 7


def test_prompt_files_and_their_errors(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    good = tmp_path / "p.jsonl"
    good.write_text('{"prompt": "2+2=", "answer": "4"}\n\n'
                    '{"messages": [{"role": "user", "content": "hi"}]}\n')
    records = read_prompts(str(good))
    assert [r.where for r in records] == [f"{good}:1", f"{good}:3"]
    assert records[1].conversation() == [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match=rf"{good}:3"):
        check_answers(records, "--gkd-lambda < 1")
    table = pa.table({"question": ["a", "b"], "answer": ["x", None]})
    pq.write_table(table, tmp_path / "p.parquet")
    records = read_prompts(str(tmp_path / "p.parquet"), PromptFields(prompt="question"))
    assert [(r.text, r.answer) for r in records] == [("a", "x"), ("b", None)]
    for text, message in [('{"prompt": 3}\n', "must be a string"),
                          ('{"other": 1}\n', "exactly one of the fields 'prompt'"),
                          ('{"messages": [{"role": "user"}]}\n', "non-empty list"),
                          ("{oops\n", "not valid JSON")]:
        bad = tmp_path / "bad.jsonl"
        bad.write_text(text)
        with pytest.raises(ValueError, match=message):
            read_prompts(str(bad))


def test_a_response_longer_than_the_sequence_is_refused_by_name(toks):
    tokenizers = SampleTokenizers(toks["smollm2"], [toks["qwen2"]])
    builder = SampleBuilder(tokenizers, RECORDS, seq_length=16, teacher_seq_lengths=[16])
    with pytest.raises(ValueError, match="prompt 0: .* exceed --seq-length"):
        builder.build(0, Rollout(0, (1,) * 10, (5,) * 10, finished=False))
