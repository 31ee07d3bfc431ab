"""The trainer against an independent reference: HF transformers models and dense losses.

For the first global batch of a ``pretrain_xdistill`` run, the reported KD and CE equal
``loss.reference`` evaluated on HF transformers logits of the same models (the HF folders the
Megatron checkpoints were converted from) over the same samples and alignment, for every payload
form and loss mode, reverse KL and temperature != 1. After one plain-SGD step (no Adam: Adam hides a
constant gradient scale) the student exported back to HF equals the HF student after
``loss.backward()`` and ``p -= lr * grad``, in several student/teacher layouts (TP, CP, PP, DP with
the distributed optimizer) and with dynamic scaling. This checks the trainer's correctness, not
only its invariance across layouts (test_e2e).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from shared_assets import TOKENIZERS, needs_shared_assets
from test_e2e import _argv, _losses, _run_main

from megatron_xdistill.testing.multirank import RankPool

pytestmark = needs_shared_assets
SEQ, TEACHER_SEQ, GBS, SEED = 32, 40, 4, 1234
RTOL = 1e-5  # fp32 on CPU: Megatron's kernels against HF's
LR = 100.0   # SGD: the parameter change is the gradient itself (large against fp32 rounding)


def _one_step_argv(root: Path, s_tok: Path, t_tok: Path, name: str, extra: list[str]) -> list[str]:
    argv = _argv(root, s_tok, t_tok, name, ["--data-cache-path", str(root / f"{name}_cache"),
                                            *extra])
    argv[argv.index("--train-iters") + 1] = "1"
    return argv


def _first_global_batch(root: Path, s_tok: Path, t_tok: Path) -> dict[str, torch.Tensor]:
    """The samples of step 1 (plan indices 0..GBS-1), packed as the run packs them."""
    from megatron_xdistill.align import load_tokenizer
    from megatron_xdistill.data.dataset import DistillationDataset, collate_samples, teacher_view
    from megatron_xdistill.data.packing import build_plan, load_documents
    from megatron_xdistill.data.sources import parse_data_path
    from megatron_xdistill.data.tokenizations import SampleTokenizers

    tokenizers = SampleTokenizers(load_tokenizer(str(s_tok)), [load_tokenizer(str(t_tok))])
    sources = parse_data_path([str(root / "train.jsonl")])
    documents, counts = load_documents(sources, "text")
    plan = build_plan(documents, sources, counts, tokenizers, SEQ, [TEACHER_SEQ], SEED, GBS,
                      log=lambda _: None)
    dataset = DistillationDataset(documents, plan, tokenizers, SEQ, [TEACHER_SEQ])
    return teacher_view(collate_samples([dataset[i] for i in range(GBS)]), 0)


def _hf(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32,
                                                attn_implementation="eager")


def _sparse_projection(path: Path) -> tuple[torch.Tensor, object]:
    from megatron_xdistill.projection import load_projection

    matrix = load_projection(str(path))
    return matrix.to_sparse(), matrix


def _padded(logits: torch.Tensor) -> torch.Tensor:
    """One zero row after the last position: the reference takes the full (unshifted) chunk ids,
    whose shifted last position predicts nothing."""
    return torch.cat([logits, logits.new_zeros(logits.shape[0], 1, logits.shape[2])], 1)


def reference_step(root: Path, batch: dict, student, kd: dict, *, ce_weight: float,
                   dynamic_group: int | None = None, sample_weights: list[float] | None = None
                   ) -> tuple[torch.Tensor, float, float]:
    """(loss with autograd into ``student``, KD, CE) of the global batch, densely.

    ``kd``: keyword arguments of ``loss.definitions.reference.kd_loss_details`` (mode, temperature, reverse,
    payload form). Each sample is its own teacher microbatch (as in the run, micro-batch size 1),
    which matters for the microbatch-global top-k. ``dynamic_group``: dynamic scaling over groups
    of that many consecutive samples (one microbatch over DP), else kd weight 1 and ``ce_weight``.
    ``sample_weights``: each sample's chunks count that many times (reward weighting).
    """
    from megatron_xdistill.loss.definitions.reference import kd_loss_details

    w, matrix = _sparse_projection(root / "proj.safetensors")
    kd = dict(kd)
    skip_split = kd.pop("skip_student_split", False)
    first_token = kd.pop("first_token", False)
    if first_token:
        kd["teacher_heads"] = _first_token_heads()
    mode = kd.get("mode", "pkl")
    if mode != "pkl":
        kd = {**kd, "common": matrix.common_vocab("strict" if mode == "gold" else "xtoken")}
    teacher = _hf(root / "teacher_hf")
    with torch.no_grad():
        t_logits = teacher(batch["teacher_tokens"][:, :-1]).logits.float()
    s_logits = student(batch["tokens"][:, :-1]).logits.float()
    labels = batch["tokens"][:, 1:].clone()
    labels[batch["loss_mask"] <= 0] = -100
    ce_per_sample = F.cross_entropy(s_logits.transpose(1, 2), labels, ignore_index=-100,
                                    reduction="none").sum(1)
    tokens_per_sample = (labels != -100).sum(1).double()
    kd_sums, counts = [], []
    for b in range(GBS):
        one = slice(b, b + 1)
        valid = batch["chunk_valid"][one]
        s_ids = batch["student_chunk_id"][one]
        if skip_split:
            valid = valid & ~_student_split_dense(batch, b)[None]
        if first_token:
            valid = valid & _one_teacher_token_dense(batch, b)[None]
            s_ids = _chunk_starts_dense(batch, b)[None]
        details = kd_loss_details(
            _padded(s_logits[one]), _padded(t_logits[one]), s_ids,
            batch["teacher_chunk_id"][one], valid, batch["chunk_exact"][one], w, **kd)
        kd_sums.append(details.per_chunk.sum() * (1.0 if sample_weights is None
                                                    else sample_weights[b]))
        counts.append(details.counted.sum().double())
    kd_sum, ce_sum = torch.stack(kd_sums), ce_per_sample
    n_chunks, n_tokens = float(sum(counts)), max(float(tokens_per_sample.sum()), 1.0)
    if dynamic_group is None:
        loss = kd_sum.sum() / n_chunks + ce_weight * ce_sum.sum() / n_tokens
    else:  # sg(CE / KD) per microbatch (its means over DP), global denominators
        loss = ce_sum.sum() / n_tokens
        for g in range(0, GBS, dynamic_group):
            part = slice(g, g + dynamic_group)
            kd_mean = kd_sum[part].sum() / sum(counts[part])
            ce_mean = ce_sum[part].sum() / tokens_per_sample[part].sum()
            loss = loss + (ce_mean / kd_mean).detach() * kd_sum[part].sum() / n_chunks
    return loss, kd_sum.sum().item() / n_chunks, ce_sum.sum().item() / n_tokens


def _student_split_dense(batch: dict, b: int) -> torch.Tensor:
    """[C] sample b's chunks with more student than teacher tokens, chunk by chunk."""
    s_ids, t_ids = batch["student_chunk_id"][b], batch["teacher_chunk_id"][b]
    return torch.tensor([int((s_ids == c).sum()) > int((t_ids == c).sum())
                         for c in range(batch["chunk_valid"].shape[1])])


def _one_teacher_token_dense(batch: dict, b: int) -> torch.Tensor:
    """[C] sample b's chunks of exactly one teacher token, chunk by chunk."""
    t_ids = batch["teacher_chunk_id"][b]
    return torch.tensor([int((t_ids == c).sum()) == 1
                         for c in range(batch["chunk_valid"].shape[1])])


def _chunk_starts_dense(batch: dict, b: int) -> torch.Tensor:
    """Sample b's student chunk ids with only each chunk's lowest position kept."""
    s_ids = batch["student_chunk_id"][b]
    out = torch.full_like(s_ids, -1)
    for c in range(batch["chunk_valid"].shape[1]):
        where = torch.nonzero(s_ids == c).flatten()
        if len(where):
            out[where.min()] = c
    return out


@functools.cache
def _first_token_heads() -> torch.Tensor:
    from megatron_xdistill.projection.first_token import first_token_heads
    from megatron_xdistill.projection.vocab import load_tokenizer

    return torch.from_numpy(first_token_heads(load_tokenizer(str(TOKENIZERS / "smollm2")),
                                              load_tokenizer(str(TOKENIZERS / "qwen2")), 151936))


@pytest.fixture(scope="module")
def pools():
    """``pools(world)``: one RankPool per world size for the whole module (runs release their
    process groups, so a pool serves every run; a pool that lost a rank is replaced)."""
    started: dict[int, RankPool] = {}

    def pool(world: int) -> RankPool:
        if world not in started or not started[world].alive:
            started[world] = RankPool(world)
        return started[world]

    yield pool
    for ranks in started.values():
        ranks.close()


@pytest.fixture(scope="module")
def first_batch(e2e_setup):
    return _first_global_batch(*e2e_setup)


# The payload forms and loss modes: ranks, the run's flags and the reference's arguments. gold
# and H-KL run in parallel layouts (student TP2 x CP2, teacher TP2 / PP2 x CP2): the reference
# checks their layouts too.
TP2_CP2 = ["--tensor-model-parallel-size", "2", "--context-parallel-size", "2"]
FORMS = {
    "pkl_full": (1, ["--kd-topk", "0"], {}),
    "pkl_global_top16": (1, ["--kd-topk-mode", "global"], {"vocab_topk": 16}),
    "pkl_chunk_top16_reverse_t2": (1, ["--kd-reverse", "--kd-temperature", "2"],
                                   {"chunk_topk": 16, "reverse": True, "temperature": 2.0}),
    "pkl_chunk_top16_gkd_jsd": (1, ["--gkd-beta", "0.5"], {"chunk_topk": 16, "jsd_beta": 0.5}),
    "pkl_chunk_top16_skip_student_split": (
        2, ["--kd-skip-student-split-chunks", "--context-parallel-size", "2"],
        {"chunk_topk": 16, "skip_student_split": True}),
    "pkl_chunk_top16_first_token": (
        2, ["--kd-first-token", "--context-parallel-size", "2"],
        {"chunk_topk": 16, "first_token": True}),
    # the full gold payload (--kd-gold-topk 0 --kd-gold-uncommon-topk 0)
    "gold_student_tp2_cp2_teacher_tp2": (
        4, ["--kd-loss", "gold", "--kd-gold-topk", "0", "--kd-gold-uncommon-topk", "0",
            *TP2_CP2, "--teacher-tensor-model-parallel-size", "2"],
        {"mode": "gold"}),
    # H-KL from the compact payload it ships by default (64 pairs, 256 uncommon ranks)
    "hkl_t2_student_tp2_cp2_teacher_pp2_cp2": (
        4, ["--kd-loss", "hkl", "--kd-temperature", "2", *TP2_CP2,
            "--teacher-pipeline-model-parallel-size", "2", "--teacher-context-parallel-size", "2"],
        {"mode": "hkl", "temperature": 2.0, "gold_topk": (64, 256)}),
}


# gold at student TP2 x CP2 (39 s) is in `make test-slow`; H-KL runs the compact gold form at
# TP2 x CP2.
@pytest.mark.parametrize("name", [
    pytest.param(name, marks=pytest.mark.slow) if name == "gold_student_tp2_cp2_teacher_tp2"
    else name for name in FORMS])
def test_first_step_losses_equal_the_dense_reference_on_hf_logits(e2e_setup, first_batch, pools,
                                                                   name):
    root, s_tok, t_tok = e2e_setup
    world, flags, kd = FORMS[name]
    pools(world).run(_run_main, _one_step_argv(root, s_tok, t_tok, f"ref_{name}", flags))
    [(got_kd, got_ce)] = _losses(root, f"ref_{name}")
    with torch.no_grad():
        _, want_kd, want_ce = reference_step(root, first_batch, _hf(root / "student_hf"), kd,
                                             ce_weight=0.5)
    # a value not ~0, so the relative tolerance means something (gold's KL on the common pairs
    # compares sub-distributions: it may be negative, the compact form's more so)
    assert abs(want_kd) > 0.02
    assert got_kd == pytest.approx(want_kd, rel=RTOL), name
    assert got_ce == pytest.approx(want_ce, rel=RTOL), name


def test_student_split_chunks_are_those_the_student_spells_in_more_tokens(first_batch):
    """The chunks --kd-skip-student-split-chunks leaves out: the reference's chunk-by-chunk
    count, and the first batch holds some (so the run above leaves something out)."""
    from megatron_xdistill.loss import student_split_chunks

    got = student_split_chunks(first_batch["student_chunk_id"], first_batch["teacher_chunk_id"],
                               first_batch["chunk_valid"].shape[1])
    want = torch.stack([_student_split_dense(first_batch, b) for b in range(GBS)])
    assert torch.equal(got, want)
    assert int((got & first_batch["chunk_valid"].bool()).sum()) > 0


def test_bf16_run_trains_near_the_fp32_reference(e2e_setup, first_batch, pools):
    """--bf16 (weights and activations in bf16, softmax/KL in fp32): the first step's losses
    are the fp32 reference's within bf16 resolution, and the step moves the parameters."""
    root, s_tok, t_tok = e2e_setup
    pools(2).run(_run_main, _one_step_argv(root, s_tok, t_tok, "ref_bf16",
                                           ["--bf16", "--tensor-model-parallel-size", "2"]))
    [(got_kd, got_ce)] = _losses(root, "ref_bf16")
    with torch.no_grad():
        _, want_kd, want_ce = reference_step(root, first_batch, _hf(root / "student_hf"),
                                             {"chunk_topk": 16}, ce_weight=0.5)
    assert got_kd == pytest.approx(want_kd, rel=3e-2) and got_ce == pytest.approx(want_ce, rel=1e-2)
    assert got_kd != pytest.approx(want_kd, rel=1e-6)  # it did run in bf16


PLAIN = ["--weight-decay", "0", "--clip-grad", "0", "--lr-decay-style", "constant",
         "--save-interval", "1"]
SGD = ["--optimizer", "sgd", "--sgd-momentum", "0", "--lr", str(LR)]
ADAM_LR = 1e-3
ADAM_EPS = 1e-4
# Megatron-Core's distributed optimizer shards Adam only: its first step, lr * g / (|g| + eps),
# is compared with torch's Adam on the reference gradients. An eps near the gradients' size keeps
# the step sensitive to the gradient's scale and bounds the effect of a gradient error d by
# lr * d / eps (with eps 1e-8, rounding noise in near-zero gradients would dominate).
ADAM = ["--optimizer", "adam", "--lr", str(ADAM_LR), "--adam-eps", str(ADAM_EPS)]
LAYOUTS = {  # (world, flags, dynamic-scaling group: micro-batch size x student DP)
    "single_rank_sgd": (1, SGD, None),
    "student_tp2_cp2_teacher_pp2_sgd": (4, [*SGD, "--tensor-model-parallel-size", "2",
                                            "--context-parallel-size", "2",
                                            "--teacher-pipeline-model-parallel-size", "2"], None),
    "student_pp2_dp2_sgd_teacher_tp2_dynamic": (
        4, [*SGD, "--pipeline-model-parallel-size", "2",
            "--teacher-tensor-model-parallel-size", "2", "--kd-dynamic-scaling"], 2),
    "student_dp2_tp2_distopt_adam": (
        4, [*ADAM, "--tensor-model-parallel-size", "2", "--use-distributed-optimizer"], None),
}


def _export(run_dir: Path, out: Path) -> None:
    from conversion import convert_mcore_to_hf

    convert_mcore_to_hf(str(run_dir), str(out), dtype="fp32")


def _reference_update(student, adam: bool) -> dict[str, torch.Tensor]:
    """What one optimizer step subtracts from each parameter, from the HF student's .grad."""
    if not adam:
        return {k: LR * p.grad for k, p in student.named_parameters()}
    before = {k: p.detach().clone() for k, p in student.named_parameters()}
    torch.optim.Adam(student.parameters(), lr=ADAM_LR, eps=ADAM_EPS, weight_decay=0.0).step()
    return {k: before[k] - p.detach() for k, p in student.named_parameters()}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_one_optimizer_step_equals_the_dense_reference_step(e2e_setup, first_batch, tmp_path,
                                                            pools, name):
    root, s_tok, t_tok = e2e_setup
    world, flags, dynamic_group = LAYOUTS[name]
    adam = "adam" in flags
    run_dir = tmp_path / "run"
    pools(world).run(_run_main, _one_step_argv(root, s_tok, t_tok, f"step_{name}",
                                               [*PLAIN, "--save", str(run_dir), *flags]))
    pools(1).run(_export, run_dir, tmp_path / "hf")
    [(got_kd, got_ce)] = _losses(root, f"step_{name}")
    record = json.loads((root / f"step_{name}.jsonl").read_text().splitlines()[-1])
    assert record["lr"] == (ADAM_LR if adam else LR) and record["skipped"] == 0

    student = _hf(root / "student_hf")
    before = {k: v.detach().clone() for k, v in student.state_dict().items()}
    loss, want_kd, want_ce = reference_step(root, first_batch, student, {"chunk_topk": 16},
                                            ce_weight=0.5, dynamic_group=dynamic_group)
    loss.backward()
    assert got_kd == pytest.approx(want_kd, rel=RTOL) and got_ce == pytest.approx(want_ce, rel=RTOL)

    after = _hf(tmp_path / "hf").state_dict()
    want = _reference_update(student, adam)
    assert set(want) <= set(after)
    for key, update in want.items():
        applied = before[key] - after[key]  # what the run subtracted
        scale = update.abs().max().item()
        assert scale > 0, key
        err = (applied - update).abs().max().item()
        rounding = 2 * torch.finfo(torch.float32).eps * before[key].abs().max().item()
        assert err <= 1e-4 * scale + rounding, (
            f"{name}: {key} step differs by {err:.3g} (max |step| {scale:.3g})")
