"""Generation with a converted Megatron model in its training layout against Hugging Face.

Tiny random HF models (every parameter random; the real vocabulary sizes) are converted and
decoded with :func:`megatron_xdistill.generation.generate` at several TP x PP x CP layouts (with
sequence parallelism where TP > 1), in one batch of prompts of different lengths. References:

* greedy decoding: the token ids of ``transformers``' ``generate`` (greedy, each prompt alone),
  stopping on an EOS token, and the log-probability of each generated token from HF's logits
  (fp32, 1e-4) -- so the KV-cached steps compute what a full forward computes;
* sampling: every drawn token lies in HF's own top-k / top-p set of that step, the recorded
  log-probabilities equal a full HF forward over the sampled sequence, a seed reproduces the
  draws, and the model is left in training mode with its parallel settings restored.
"""

from __future__ import annotations

import pytest
import torch
from scratch import scratch_dir

from megatron_xdistill.generation import SamplingParams, filter_logits, sample_next
from megatron_xdistill.testing.multirank import RankPool
from megatron_xdistill.testing.tiny_models import TINY_FAMILIES, make_tiny_model

WORLD = 4
PROMPTS = [[5, 17, 300, 41, 9], [77, 8, 1200, 3, 64, 901, 12, 45, 2], [1, 999, 31, 7, 15, 16, 23]]
MAX_NEW = 8
ATOL = 1e-4


@pytest.fixture(scope="module")
def pool():
    with RankPool(WORLD) as ranks:
        yield ranks


@pytest.fixture(scope="module")
def tiny(request, tmp_path_factory, pool):
    """{family: (hf_dir, Megatron checkpoint)} for the families the tests decode."""
    from conversion.hf_to_mcore import convert_hf_to_mcore

    root = scratch_dir(request, tmp_path_factory, "generation")
    out = {}
    for family in ("smollm2", "gemma3", "qwen2"):
        hf_dir = make_tiny_model(family, str(root / family), seed=11)
        ckpt = str(root / f"{family}_mcore")
        pool.run(convert_hf_to_mcore, hf_dir, ckpt, 1, 1)
        out[family] = (hf_dir, ckpt)
    return out


def _decode_on_layout(ckpt: str, tp: int, pp: int, cp: int, prompts, params: SamplingParams,
                      eos: list[int], seed: int, sequence_parallel: bool) -> dict:
    """Rank function: build the checkpoint's model at the layout and decode ``prompts``."""
    from conversion.launch import layout_groups
    from megatron_xdistill.generation import generate
    from megatron_xdistill.models import build_model_for_layout, load_megatron_checkpoint
    from megatron_xdistill.models.model_checkpoint import load_model_info

    info = load_model_info(ckpt)
    groups = layout_groups(tp, pp, who="generate", cp=cp)
    model, _ = build_model_for_layout(info, groups, torch.float32, 0, use_te=False,
                                      perform_initialization=False, use_cpu_initialization=True,
                                      sequence_parallel=sequence_parallel)
    load_megatron_checkpoint(model, ckpt, groups.pg_collection)
    model.train()
    generator = torch.Generator().manual_seed(seed)
    out = generate(model, groups, prompts, params, eos_token_ids=eos,
                   vocab_size=info.vocab_size, device=torch.device("cpu"), generator=generator)
    return {"tokens": out.tokens, "lengths": out.lengths, "prompt_lengths": out.prompt_lengths,
            "logprobs": out.logprobs, "finished": out.finished,
            "responses": [out.response(i) for i in range(len(prompts))],
            "restored": (model.training, model.config.sequence_parallel,
                         model.decoder.layers[0].self_attention.linear_qkv.sequence_parallel)}


def _hf_greedy(hf_dir: str, prompt: list[int], eos: list[int]) -> tuple[list[int], list[float]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False,
                         eos_token_id=eos or None, pad_token_id=0, output_logits=True,
                         return_dict_in_generate=True, top_k=None, top_p=None, temperature=None)
    ids = out.sequences[0, len(prompt):].tolist()
    logprobs = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, ids)]
    return ids, logprobs


def _hf_logits(hf_dir: str, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits.float()


LAYOUTS = [  # (tp, pp, cp, sequence_parallel); DP = the rest of the 4 ranks
    (1, 1, 1, False), (2, 1, 1, True), (1, 2, 1, False), (2, 2, 1, True), (1, 1, 2, False),
    (2, 1, 2, True)]


@pytest.mark.parametrize("family", ["smollm2", "gemma3", "qwen2"])
def test_greedy_equals_hf_generate_at_every_layout(pool, tiny, family):
    hf_dir, ckpt = tiny[family]
    reference = [_hf_greedy(hf_dir, p, []) for p in PROMPTS]
    # An EOS that greedy decoding of some prompt first reaches at its k-th new token (k >= 3)
    # ends that response there; the others run to MAX_NEW unless they meet it too.
    i, k = next((i, k) for i, (ids, _) in enumerate(reference) for k in range(2, MAX_NEW)
                if ids[k] not in ids[:k])
    eos = reference[i][0][k]
    reference = [_hf_greedy(hf_dir, p, [eos]) for p in PROMPTS]
    assert len(reference[i][0]) == k + 1 < MAX_NEW
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0)
    layouts = LAYOUTS if family == "smollm2" else [LAYOUTS[0], LAYOUTS[3], LAYOUTS[5]]
    for tp, pp, cp, sp in layouts:
        ranks = pool.run(_decode_on_layout, ckpt, tp, pp, cp, PROMPTS, params, [eos], 0, sp)
        where = f"{family} TP{tp} PP{pp} CP{cp} SP{sp}"
        for rank, got in enumerate(ranks):
            assert got["restored"] == (True, sp, sp), f"{where} rank {rank}: state not restored"
            for i, (ids, logprobs) in enumerate(reference):
                assert got["responses"][i] == ids, f"{where} rank {rank} prompt {i}"
                mask = slice(len(PROMPTS[i]), len(PROMPTS[i]) + len(ids))
                torch.testing.assert_close(got["logprobs"][i, mask], torch.tensor(logprobs),
                                           atol=ATOL, rtol=0, msg=f"{where} prompt {i}")
            assert got["finished"].tolist() == [eos in ids for ids, _ in reference], where
            assert got["tokens"][:, :5].tolist() == [p[:5] for p in PROMPTS]


def test_sampling_draws_from_hf_nucleus_and_a_seed_reproduces_it(pool, tiny):
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    hf_dir, ckpt = tiny["smollm2"]
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.7, top_p=0.8, top_k=50)
    first = pool.run(_decode_on_layout, ckpt, 2, 2, 1, PROMPTS, params, [], 7, True)
    again = pool.run(_decode_on_layout, ckpt, 1, 1, 1, PROMPTS, params, [], 7, False)
    other = pool.run(_decode_on_layout, ckpt, 1, 1, 1, PROMPTS, params, [], 8, False)
    got = first[0]
    assert all(r["responses"] == got["responses"] for r in first)
    assert again[0]["responses"] == got["responses"], "the same seed drew other tokens"
    assert other[0]["responses"] != got["responses"], "another seed drew the same tokens"
    for i, prompt in enumerate(PROMPTS):
        tokens = got["tokens"][i:i + 1, :int(got["lengths"][i])]
        logits = _hf_logits(hf_dir, tokens)[0]
        start = len(prompt)
        for pos in range(start, tokens.size(1)):
            step = logits[pos - 1:pos] / params.temperature
            allowed = TopPLogitsWarper(params.top_p)(tokens[:, :pos],
                                                     TopKLogitsWarper(params.top_k)(tokens, step))
            token = int(tokens[0, pos])
            assert torch.isfinite(allowed[0, token]), f"prompt {i} step {pos}: outside top-k/p"
            want = torch.log_softmax(logits[pos - 1], -1)[token]
            assert abs(float(got["logprobs"][i, pos]) - float(want)) < ATOL


@pytest.mark.parametrize("top_k,top_p", [(0, 0.5), (0, 0.9), (5, 1.0), (20, 0.7)])
def test_filters_equal_hf_warpers(top_k, top_p):
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(top_k + 10)) * 3
    expected = logits.clone()
    if top_k:
        expected = TopKLogitsWarper(top_k)(None, expected)
    if top_p < 1:
        expected = TopPLogitsWarper(top_p)(None, expected)
    got = filter_logits(logits, top_k, top_p)
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    assert torch.equal(got[torch.isfinite(got)], logits[torch.isfinite(got)])


def test_sample_next_follows_the_filtered_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, -3.0]])
    params = SamplingParams(max_new_tokens=1, temperature=0.5, top_p=0.9)
    generator = torch.Generator().manual_seed(0)
    draws = torch.stack([sample_next(logits, params, generator)[0] for _ in range(4000)])
    probs = torch.softmax(filter_logits(logits / 0.5, 0, 0.9), -1)[0]
    freq = torch.bincount(draws.flatten(), minlength=5).float() / draws.numel()
    assert torch.allclose(freq, probs, atol=0.03), (freq, probs)
    ids, logprobs = sample_next(logits, SamplingParams(max_new_tokens=1, temperature=0.0))
    assert ids.tolist() == [0]
    assert logprobs.item() == pytest.approx(torch.log_softmax(logits, -1)[0, 0].item())


@pytest.mark.parametrize("bad,needle", [
    (dict(max_new_tokens=0), "max_new_tokens"), (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_k=-2), "top_k")])
def test_bad_sampling_params_are_named(bad, needle):
    with pytest.raises(ValueError, match=needle):
        SamplingParams(**{"max_new_tokens": 4, **bad})


def test_empty_prompt_is_refused():
    from megatron_xdistill.generation import generate

    with pytest.raises(ValueError, match="at least one token"):
        generate(None, None, [[1, 2], []], SamplingParams(max_new_tokens=2), eos_token_ids=[],
                 vocab_size=10, device=torch.device("cpu"))


assert set(TINY_FAMILIES) >= {"smollm2", "gemma3", "qwen2"}
