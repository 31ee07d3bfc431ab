"""Mixture-of-experts models in ``pretrain_xdistill``, against HF transformers references.

Teacher: a tiny random Qwen3-MoE model (the Qwen2 tokenizer's vocabulary) teaches test_e2e's
student. Its runs at --teacher-expert-model-parallel-size 1 and 2 (2 ranks) give the same
losses, and the first step's KD and CE equal the dense reference on the HF MoE model's logits.

Student: a tiny random Mixtral student (SmolLM2's vocabulary, router_aux_loss_coef 0.02) at
--expert-model-parallel-size 2 learns from test_e2e's teacher. Its first step's KD and CE equal
the reference, its logged ``load_balancing_loss`` equals Megatron's Switch load-balancing loss
computed densely from the HF model's router logits (per MoE layer and sample, averaged), and one
plain-SGD step equals the HF student's step on CE + KD + coefficient x the per-layer sum of that
loss (the auxiliary loss enters the gradients as in Megatron-LM).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from shared_assets import needs_shared_assets
from test_e2e import _argv, _convert, _losses, _run_main, refusal
from test_trainer_reference import (
    LR,
    PLAIN,
    RTOL,
    SGD,
    _export,
    _first_global_batch,
    _hf,
    _one_step_argv,
    reference_step,
)

from megatron_xdistill.testing.multirank import RankPool
from megatron_xdistill.testing.tiny_models import make_tiny_model

pytestmark = needs_shared_assets
WORLD = 2
AUX_COEF = 0.02


@pytest.fixture(scope="module")
def first_batch(e2e_setup):
    return _first_global_batch(*e2e_setup)


@pytest.fixture(scope="module")
def pool():
    with RankPool(WORLD) as ranks:
        yield ranks


def _root_with(e2e_root: Path, root: Path, replace: str, family: str, vocab: int,
               **overrides) -> Path:
    """``root``: test_e2e's student, teacher, projection and text, with ``replace`` ("student"
    or "teacher") a tiny random model of ``family`` (HF folder ``<replace>_hf``, converted)."""
    for name in ("student", "student_hf", "teacher", "teacher_hf", "proj.safetensors",
                 "train.jsonl"):
        if not name.startswith(replace):
            (root / name).symlink_to(e2e_root / name)
    hf = make_tiny_model(family, str(root / f"{replace}_hf"), seed=7, vocab_size=vocab,
                         num_hidden_layers=2, **overrides)
    with RankPool(1) as one:
        one.run(_convert, hf, str(root / replace))
    return root


def test_moe_teacher_at_ep1_and_ep2_matches_hf(e2e_setup, first_batch, pool, tmp_path):
    e2e_root, s_tok, t_tok = e2e_setup
    root = _root_with(e2e_root, tmp_path, "teacher", "qwen3_moe", 151936)
    runs = {}
    for ep in (1, 2):
        name = f"moe_teacher_ep{ep}"
        argv = _one_step_argv(root, s_tok, t_tok, name,
                              ["--teacher-expert-model-parallel-size", str(ep)])
        argv[argv.index("--train-iters") + 1] = "3"
        pool.run(_run_main, argv)
        runs[ep] = _losses(root, name)
    assert len(runs[1]) == len(runs[2]) == 3
    for (kd1, ce1), (kd2, ce2) in zip(runs[1], runs[2]):
        assert kd2 == pytest.approx(kd1, rel=RTOL) and ce2 == pytest.approx(ce1, rel=RTOL)
    with torch.no_grad():
        _, want_kd, want_ce = reference_step(root, first_batch, _hf(root / "student_hf"),
                                             {"chunk_topk": 16}, ce_weight=0.5)
    assert want_kd > 0.01  # a KL that is not ~0: the relative tolerance means something
    kd, ce = runs[2][0]
    assert kd == pytest.approx(want_kd, rel=RTOL) and ce == pytest.approx(want_ce, rel=RTOL)
    # An EP size that the ranks allow but the experts do not is refused before anything runs.
    argv = _argv(root, s_tok, t_tok, "bad_ep", ["--teacher-expert-model-parallel-size", "3"])
    argv[argv.index("--global-batch-size") + 1] = "3"
    message = refusal(argv, world=3)
    assert "--teacher-expert-model-parallel-size 3" in message and "4 experts" in message


def _switch_loss_per_layer(student, tokens: torch.Tensor, topk: int) -> torch.Tensor:
    """[layers, samples] Megatron's Switch load-balancing loss (without its coefficient) of each
    MoE layer on each sample (one micro-batch each): E / (k T^2) sum_e count_e sum_t p_te, from
    the HF model's router logits."""
    out = student(tokens, output_router_logits=True)
    per_layer = []
    for logits in out.router_logits:
        logits = logits.float().view(tokens.shape[0], tokens.shape[1], -1)
        probs = torch.softmax(logits, dim=-1)
        experts = probs.shape[-1]
        chosen = torch.topk(logits, topk, dim=-1).indices
        counts = torch.nn.functional.one_hot(chosen, experts).sum(2).float()  # [b, T, E]
        t = tokens.shape[1]
        per_layer.append(experts / (topk * t * t) * (counts.sum(1) * probs.sum(1)).sum(-1))
    return torch.stack(per_layer)


def test_moe_student_aux_loss_is_logged_and_trained_as_megatron_lm(e2e_setup, first_batch, pool,
                                                                    tmp_path):
    e2e_root, s_tok, t_tok = e2e_setup
    root = _root_with(e2e_root, tmp_path, "student", "mixtral", 49152,
                      router_aux_loss_coef=AUX_COEF)
    run_dir = tmp_path / "run"
    pool.run(_run_main, _one_step_argv(root, s_tok, t_tok, "moe_student",
                                       [*PLAIN, *SGD, "--save", str(run_dir),
                                        "--expert-model-parallel-size", "2"]))
    with RankPool(1) as one:
        one.run(_export, run_dir, tmp_path / "hf")
    record = [json.loads(x) for x in (root / "moe_student.jsonl").read_text().splitlines()
              if "kd" in json.loads(x)][-1]
    [(got_kd, got_ce)] = _losses(root, "moe_student")

    student = _hf(root / "student_hf")
    before = {k: v.detach().clone() for k, v in student.state_dict().items()}
    loss, want_kd, want_ce = reference_step(root, first_batch, student, {"chunk_topk": 16},
                                            ce_weight=0.5)
    aux = _switch_loss_per_layer(student, first_batch["tokens"][:, :-1], topk=2)
    assert got_kd == pytest.approx(want_kd, rel=RTOL) and got_ce == pytest.approx(want_ce, rel=RTOL)
    # Logged: mean over MoE layers and samples; trained: coefficient x sum over layers.
    assert record["load_balancing_loss"] == pytest.approx(aux.mean().item(), rel=RTOL)
    (loss + AUX_COEF * aux.mean(1).sum()).backward()
    after = _hf(tmp_path / "hf").state_dict()
    router = "model.layers.0.mlp.gate.weight"
    for key, param in student.named_parameters():
        update = LR * param.grad
        applied = before[key] - after[key]
        scale = update.abs().max().item()
        err = (applied - update).abs().max().item()
        rounding = 2 * torch.finfo(torch.float32).eps * before[key].abs().max().item()
        assert err <= 1e-4 * scale + rounding, f"{key}: step differs by {err:.3g} (max {scale:.3g})"
    # The auxiliary loss's share of the router's step is far above that tolerance.
    student.zero_grad()
    loss2, _, _ = reference_step(root, first_batch, student, {"chunk_topk": 16}, ce_weight=0.5)
    loss2.backward()
    without = LR * dict(student.named_parameters())[router].grad
    applied = before[router] - after[router]
    assert (applied - without).abs().max() > 1e-2 * applied.abs().max()
