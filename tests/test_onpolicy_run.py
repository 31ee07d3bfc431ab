"""On-policy distillation end to end (``pretrain_xdistill.py --on-policy``) on CPU ranks.

Tiny converted models with real tokenizers (SmolLM2 student with its chat template, Qwen2
teacher). References:

* greedy rollouts of the first step equal ``transformers``' greedy ``generate`` of the HF student
  on each prompt (the student generates in its training layout, TP 2 here);
* the first step's KD (GKD's JSD) equals the dense reference on HF logits over the logged
  rollouts (prompt masked, response chunks only);
* a run stopped after a checkpoint and resumed draws the same sampled responses and reports the
  same losses as the uninterrupted run (the sampler is seeded by step and replica);
* with ``--gkd-lambda`` the off-policy steps train on the reference answers (CE on them) and
  the draw per step is the one the run logged.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from scratch import scratch_dir
from shared_assets import needs_shared_assets
from test_e2e import _run_main, make_setup
from test_trainer_reference import _hf, reference_step

from megatron_xdistill.testing.multirank import RankPool

pytestmark = needs_shared_assets
RTOL = 1e-5
PROMPTS = [("What is the capital of France?", " Paris."), ("Name a prime number.", " Seven."),
           ("Say hello.", " Hello!"), ("What color is the sky?", " Blue."),
           ("Count to three.", " One, two, three."), ("Spell cat.", " C-A-T.")]


@pytest.fixture(scope="module")
def setup(request, tmp_path_factory):
    root, s_tok, t_tok = make_setup(scratch_dir(request, tmp_path_factory, "onpolicy"))
    (root / "prompts.jsonl").write_text("".join(
        json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in PROMPTS))
    return root, s_tok, t_tok


@pytest.fixture(scope="module")
def pool():
    with RankPool(2) as ranks:
        yield ranks


def length_reward(record, response: str) -> float:
    """A reward that differs between responses (for the weighting test): length mod 3."""
    return float(len(response) % 3)


def _argv(root: Path, s_tok: Path, t_tok: Path, name: str, extra: list[str]) -> list[str]:
    return ["--load", str(root / "student"), "--teacher-load", str(root / "teacher"),
            "--tokenizer-model", str(s_tok), "--teacher-tokenizer-model", str(t_tok),
            "--projection-path", str(root / "proj.safetensors"), "--on-policy",
            "--data-path", str(root / "prompts.jsonl"), "--seq-length", "64",
            "--teacher-seq-length", "112", "--max-new-tokens", "8", "--micro-batch-size", "1",
            "--global-batch-size", "4", "--train-iters", "3", "--lr", "1e-3",
            "--kd-loss", "pkl", "--kd-topk", "16",
            "--ce-weight", "0", "--gkd-beta", "0.5", "--log-interval", "1",
            "--metrics-file", str(root / f"{name}.jsonl"),
            "--generations-file", str(root / f"{name}.gen.jsonl"), *extra]


def _records(root: Path, name: str, suffix: str = ".jsonl") -> list[dict]:
    return [json.loads(x) for x in (root / f"{name}{suffix}").read_text().splitlines()]


def _batch(root: Path, s_tok: Path, t_tok: Path, rollouts: list[dict]) -> dict:
    """The logged rollouts of one step as the run packs them."""
    from megatron_xdistill.align import load_tokenizer
    from megatron_xdistill.data.dataset import collate_samples, teacher_view
    from megatron_xdistill.data.tokenizations import SampleTokenizers
    from megatron_xdistill.onpolicy.prompts import read_prompts
    from megatron_xdistill.onpolicy.samples import Rollout, SampleBuilder

    tokenizers = SampleTokenizers(load_tokenizer(str(s_tok)), [load_tokenizer(str(t_tok))])
    records = read_prompts(str(root / "prompts.jsonl"))
    builder = SampleBuilder(tokenizers, records, 64, [112])
    samples = []
    for r in sorted(rollouts, key=lambda r: r["position"]):
        prompt = builder.student_prompt(records[r["prompt"]])
        samples.append(builder.build(r["position"], Rollout(
            r["prompt"], tuple(prompt), tuple(r["response_ids"]), r["finished"],
            on_policy=r["on_policy"])))
    return teacher_view(collate_samples(samples), 0), builder, records


def test_greedy_rollouts_equal_hf_generate_and_the_kd_equals_the_dense_reference(setup, pool):
    root, s_tok, t_tok = setup
    name = "greedy_tp2"
    pool.run(_run_main, _argv(root, s_tok, t_tok, name, [
        "--sampling-temperature", "0", "--tensor-model-parallel-size", "2",
        "--teacher-tensor-model-parallel-size", "2", "--train-iters", "1"]))
    _check_greedy_first_step(root, s_tok, t_tok, name)


def test_a_disaggregated_teacher_grades_the_rollouts_it_receives(setup, pool):
    """Student on rank 0, teacher on rank 1: the teacher rank generates nothing, receives the
    student's rollouts in the step's exchange and grades them; the same references hold."""
    root, s_tok, t_tok = setup
    name = "greedy_disaggregated"
    greedy = ["--sampling-temperature", "0", "--train-iters", "2"]
    pool.run(_run_main, _argv(root, s_tok, t_tok, name, [
        *greedy, "--teacher-placement", "disaggregated", "--teacher-ranks", "1"]))
    _check_greedy_first_step(root, s_tok, t_tok, name)
    # The second step rolls out with the updated student: as a colocated run (DP 2) does.
    pool.run(_run_main, _argv(root, s_tok, t_tok, "greedy_colocated_dp2", greedy))
    apart = _records(root, name, ".gen.jsonl")
    together = _records(root, "greedy_colocated_dp2", ".gen.jsonl")
    assert [r["response_ids"] for r in apart] == [r["response_ids"] for r in together]
    a = [m["kd"] for m in _records(root, name) if "kd" in m]
    b = [m["kd"] for m in _records(root, "greedy_colocated_dp2") if "kd" in m]
    assert len(a) == 2 and a == pytest.approx(b, rel=RTOL)


def _check_greedy_first_step(root: Path, s_tok: Path, t_tok: Path, name: str) -> None:
    """The first step's greedy rollouts equal HF ``generate``, its KD the dense reference."""
    step1 = [r for r in _records(root, name, ".gen.jsonl") if r["iteration"] == 1]
    assert sorted(r["position"] for r in step1) == [0, 1, 2, 3]
    batch, builder, records = _batch(root, s_tok, t_tok, step1)
    student = _hf(root / "student_hf")
    for r in step1:
        prompt = builder.student_prompt(records[r["prompt"]])
        out = student.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                               eos_token_id=builder.tokenizers.student_tokenizer.eos_token_id,
                               pad_token_id=0, top_k=None, top_p=None, temperature=None)
        assert r["response_ids"] == out[0, len(prompt):].tolist(), r
    got_kd = next(m["kd"] for m in _records(root, name) if "kd" in m)
    with torch.no_grad():
        _, want_kd, _ = reference_step(root, batch, student, {"chunk_topk": 16, "jsd_beta": 0.5},
                                       ce_weight=0.0)
    assert want_kd > 0.01
    assert got_kd == pytest.approx(want_kd, rel=RTOL)
    assert batch["chunk_valid"].sum() > 0
    starts = [len(builder.student_prompt(records[r["prompt"]])) for r in
              sorted(step1, key=lambda r: r["position"])]
    for b, start in enumerate(starts):  # the prompt carries no chunk
        assert (batch["student_chunk_id"][b, :start] < 0).all()


def test_a_resumed_run_samples_the_same_responses(setup, pool):
    root, s_tok, t_tok = setup
    sampled = ["--sampling-temperature", "1.0", "--sampling-top-p", "0.9"]
    pool.run(_run_main, _argv(root, s_tok, t_tok, "straight", sampled))
    ckpt = str(root / "resumed_ckpt")
    pool.run(_run_main, _argv(root, s_tok, t_tok, "resumed", [
        *sampled, "--save", ckpt, "--save-interval", "2", "--exit-interval", "2"]))
    pool.run(_run_main, _argv(root, s_tok, t_tok, "resumed", [*sampled, "--save", ckpt,
                                                              "--save-interval", "2"]))
    straight = _records(root, "straight", ".gen.jsonl")
    resumed = _records(root, "resumed", ".gen.jsonl")
    assert [r["response_ids"] for r in resumed] == [r["response_ids"] for r in straight]
    assert len({tuple(r["response_ids"]) for r in straight}) > 3  # sampled, not all alike
    a = [(m["kd"], m["ce"]) for m in _records(root, "straight") if "kd" in m]
    b = [(m["kd"], m["ce"]) for m in _records(root, "resumed") if "kd" in m]
    assert len(a) == 3 and b[-1] == pytest.approx(a[-1], rel=RTOL)


def test_lambda_mixes_reference_answers_in(setup, pool):
    from megatron_xdistill.onpolicy.rollout import is_on_policy_step

    root, s_tok, t_tok = setup
    name = "lambda"
    argv = _argv(root, s_tok, t_tok, name, ["--gkd-lambda", "0.5", "--ce-weight", "1",
                                            "--train-iters", "6"])
    pool.run(_run_main, argv)
    gen = _records(root, name, ".gen.jsonl")
    flags = {r["iteration"]: r["on_policy"] for r in gen}
    assert flags == {s + 1: is_on_policy_step(1234, 0.5, s) for s in range(6)}  # --seed 1234
    assert set(flags.values()) == {True, False}
    answers = {p: a for p, a in PROMPTS}
    texts = [p for p, _ in PROMPTS]
    for r in gen:
        if not r["on_policy"]:  # the reference answer, ended by EOS
            assert r["response"] == answers[texts[r["prompt"]]] and r["finished"]
    metrics = {m["iteration"]: m for m in _records(root, name) if "kd" in m}
    for step, on in flags.items():
        assert metrics[step]["on_policy"] == float(on)
        assert (metrics[step]["ce"] > 0) != on  # CE only on the reference answers


def test_reward_weights_scale_each_samples_divergence(setup, pool):
    from megatron_xdistill.onpolicy.rewards import reward_weights

    root, s_tok, t_tok = setup
    name = "rewarded"
    pool.run(_run_main, _argv(root, s_tok, t_tok, name, [
        "--sampling-temperature", "1.0", "--train-iters", "1", "--seed", "7",
        "--reward-fn", "test_onpolicy_run:length_reward", "--reward-beta", "0.7"]))
    step1 = sorted(_records(root, name, ".gen.jsonl"), key=lambda r: r["position"])
    rewards = [r["reward"] for r in step1]
    assert rewards == [length_reward(None, r["response"]) for r in step1]
    weights = reward_weights(rewards, 0.7).tolist()
    assert len(set(rewards)) > 1, "the rollouts' rewards are all equal: no weighting to check"
    batch, _, _ = _batch(root, s_tok, t_tok, step1)
    [metrics] = [m for m in _records(root, name) if "kd" in m]
    assert metrics["reward"] == pytest.approx(sum(rewards) / 4)
    with torch.no_grad():
        kw = {"chunk_topk": 16, "jsd_beta": 0.5}
        _, want_kd, _ = reference_step(root, batch, _hf(root / "student_hf"), kw,
                                       ce_weight=0.0, sample_weights=weights)
        _, plain_kd, _ = reference_step(root, batch, _hf(root / "student_hf"), kw,
                                        ce_weight=0.0)
    assert metrics["kd"] == pytest.approx(want_kd, rel=RTOL)
    assert abs(want_kd - plain_kd) > 1e-3 * plain_kd  # the weights changed the loss


def test_several_teachers_grade_the_same_rollouts(setup, pool):
    """On-policy with two teachers: the cross-tokenizer one and the student's own checkpoint as
    a same-tokenizer teacher (token-level KL over the response). Greedy rollouts are the same
    as with one teacher, the cross teacher's KD equals the one-teacher run's, and the student
    graded by itself has zero divergence at the first step (same weights, same distribution)."""
    import yaml

    root, s_tok, t_tok = setup
    config = root / "onpolicy_teachers.yaml"
    config.write_text(yaml.safe_dump({"teachers": [
        {"name": "qwen", "load": str(root / "teacher"), "tokenizer_model": str(t_tok),
         "projection_path": str(root / "proj.safetensors"), "seq_length": 112, "weight": 0.5},
        {"name": "self", "load": str(root / "student"), "tokenizer_model": str(s_tok),
         "seq_length": 64, "weight": 0.5}], "combination": "sum"}))
    greedy = ["--sampling-temperature", "0", "--train-iters", "1"]
    pool.run(_run_main, _argv(root, s_tok, t_tok, "one_teacher", greedy))
    pool.run(_run_main, _argv(root, s_tok, t_tok, "two_teachers",
                              [*greedy, "--teachers-config", str(config)]))
    one = _records(root, "one_teacher", ".gen.jsonl")
    two = _records(root, "two_teachers", ".gen.jsonl")
    assert [r["response_ids"] for r in two] == [r["response_ids"] for r in one]
    [m1] = [m for m in _records(root, "one_teacher") if "kd" in m]
    [m2] = [m for m in _records(root, "two_teachers") if "kd" in m]
    assert m2["kd/qwen"] == pytest.approx(m1["kd"], rel=RTOL)
    assert abs(m2["kd/self"]) < 1e-5 and m2["chunks/self"] > 0
