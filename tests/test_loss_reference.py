"""The dense reference against a per-chunk loop written from DESIGN.md; gradcheck of the autograd
Function in float64; the compressed teacher form's deviation from the exact loss.

The loop below shares nothing with :mod:`megatron_xdistill.loss` but the common-vocabulary pairs
(the projection package's rule, tested there): it walks every sample and chunk, gathers the
predicting positions by hand and evaluates the formulas one chunk at a time.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from megatron_xdistill.loss.definitions import reference
from megatron_xdistill.loss.definitions.common import (
    EPS,
    common_vocab_from_dense,
    predicting_chunk_id,
)
from megatron_xdistill.loss.teacher import payload_spec, teacher_payload
from megatron_xdistill.testing.synthetic_kd import make_case


def _positions(chunk_id: torch.Tensor, c: int) -> list[int]:
    """Predicting positions of chunk c: position i predicts token i + 1."""
    ids = chunk_id.tolist()
    return [i for i in range(len(ids) - 1) if ids[i + 1] == c]


def _jsd(log_p: torch.Tensor, log_q: torch.Tensor, beta: float) -> float:
    """GKD's generalized JSD as TRL writes it: the mixture in log space, KL by ``F.kl_div``."""
    import torch.nn.functional as F

    log_m = torch.logsumexp(torch.stack([log_p + math.log(beta), log_q + math.log(1 - beta)]), 0)
    return float(beta * F.kl_div(log_m, log_p, log_target=True, reduction="sum")
                 + (1 - beta) * F.kl_div(log_m, log_q, log_target=True, reduction="sum"))


def _loop_chunk_kl(z, u, w, s_pos, t_pos, mode, temp, reverse, vocab_cols, chunk_topk, pairs,
                   unc_cap, beta=None):
    """KL_c of one chunk from the DESIGN.md formulas (z [T_s, V_s], u [T_t, V_t] of one sample);
    ``beta``: the generalized JSD instead."""
    log_p_s = [torch.log_softmax(z[i].double() / temp, 0) for i in s_pos]
    if mode == "pkl":
        q = sum(lp.exp() @ w.double() for lp in log_p_s) / len(s_pos)
        if vocab_cols is not None:
            log_p = sum(torch.log_softmax(u[j, vocab_cols].double() / temp, 0) for j in t_pos)
            log_p = log_p / len(t_pos)
            q_k = q[vocab_cols] / q[vocab_cols].sum()
        else:
            log_p = sum(torch.log_softmax(u[j].double() / temp, 0) for j in t_pos) / len(t_pos)
            if chunk_topk is None:
                q_k = q / q.sum()
            else:
                order = sorted(range(log_p.numel()), key=lambda t: -float(log_p[t]))[:chunk_topk]
                rest = [t for t in range(log_p.numel()) if t not in set(order)]
                tail = math.log(sum(math.exp(float(log_p[t])) for t in rest))
                total = q.sum()
                q_k = torch.cat([q[order] / total, ((total - q[order].sum()) / total)[None]])
                log_p = torch.cat([log_p[order], torch.tensor([tail], dtype=torch.float64)])
        p = log_p.exp()
        log_q = torch.log(q_k + EPS)
        if beta is not None:
            return _jsd(log_p, log_q, beta)
        if reverse:
            return float((q_k * (log_q - log_p)).sum())
        return float((p * (log_p - log_q)).sum())
    a = (sum(log_p_s) / len(s_pos)).tolist()
    b = (sum(torch.log_softmax(u[j].double() / temp, 0) for j in t_pos) / len(t_pos)).tolist()
    kl = 0.0
    if beta is not None and pairs:
        kl = _jsd(torch.tensor([b[t] for _, t in pairs], dtype=torch.float64),
                  torch.tensor([a[s] for s, _ in pairs], dtype=torch.float64), beta)
    for s, t in pairs if beta is None else []:
        if reverse:
            kl += math.exp(a[s]) * (a[s] - b[t])
        else:
            kl += math.exp(b[t]) * (b[t] - a[s])
    common_s = {s for s, _ in pairs}
    common_t = {t for _, t in pairs}
    s_rest = sorted((math.exp(a[s]) for s in range(len(a)) if s not in common_s), reverse=True)
    t_rest = sorted((math.exp(b[t]) for t in range(len(b)) if t not in common_t), reverse=True)
    n = min(len(s_rest), len(t_rest), unc_cap)
    return kl + sum(abs(x - y) for x, y in zip(s_rest[:n], t_rest[:n]))


def _loop_loss(case, mode, temp=1.0, reverse=False, exact_only=False, vocab_topk=None,
               chunk_topk=None, unc_cap=8192, beta=None):
    z, u = case.real_student_logits, case.real_teacher_logits
    vocab_cols = None
    if vocab_topk is not None:
        predicting = predicting_chunk_id(case.teacher_chunk_id) >= 0  # padding chooses nothing
        best = u[predicting].amax(0)
        vocab_cols = sorted(range(best.numel()), key=lambda t: -float(best[t]))[:vocab_topk]
        vocab_cols = torch.tensor(sorted(vocab_cols))
    pairs = None
    if mode != "pkl":
        cs, ct = common_vocab_from_dense(case.projection, mode)
        pairs = list(zip(cs.tolist(), ct.tolist()))
    total, count = 0.0, 0
    for b in range(z.shape[0]):
        for c in range(case.chunk_valid.shape[1]):
            if not case.chunk_valid[b, c] or (exact_only and not case.chunk_exact[b, c]):
                continue
            s_pos = _positions(case.student_chunk_id[b], c)
            t_pos = _positions(case.teacher_chunk_id[b], c)
            if not s_pos or not t_pos:
                continue
            total += temp * temp * _loop_chunk_kl(
                z[b], u[b], case.projection, s_pos, t_pos, mode, temp, reverse, vocab_cols,
                chunk_topk, pairs, unc_cap, beta)
            count += 1
    return total / count


LOOP_CASES = [
    dict(mode="pkl"),
    dict(mode="pkl", temp=2.0, reverse=True),
    dict(mode="pkl", vocab_topk=9),
    dict(mode="pkl", chunk_topk=5, reverse=True, temp=1.5),
    dict(mode="pkl", chunk_topk=3, exact_only=True),
    dict(mode="gold"),
    dict(mode="gold", reverse=True, temp=2.0, unc_cap=4),
    dict(mode="hkl"),
    dict(mode="hkl", reverse=True, exact_only=True),
    # GKD's generalized JSD (beta strictly between the two KLs)
    dict(mode="pkl", beta=0.5),
    dict(mode="pkl", vocab_topk=9, beta=0.9, temp=2.0),
    dict(mode="pkl", chunk_topk=5, beta=0.3, temp=1.5),
    dict(mode="gold", beta=0.5, unc_cap=4),
]


@pytest.mark.parametrize("kw", LOOP_CASES, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_reference_equals_per_chunk_loop(kw):
    case = make_case(batch=2, ts=14, tt=12, vs=23, vt=19, seed=3)
    expected = _loop_loss(case, **kw)
    args = dict(kw)
    mode, temp = args.pop("mode"), args.pop("temp", 1.0)
    reverse, exact_only = args.pop("reverse", False), args.pop("exact_only", False)
    unc = args.pop("unc_cap", 8192)
    if "beta" in args:
        args["jsd_beta"] = args.pop("beta")
    got = reference.kd_loss(
        case.real_student_logits.double(), case.real_teacher_logits.double(),
        case.student_chunk_id, case.teacher_chunk_id, case.chunk_valid, case.chunk_exact,
        case.projection.double(), mode, temp, reverse, exact_only, uncommon_topk=unc, **args)
    assert float(got) == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("mode,exact_only", [("pkl", False), ("gold", True)])
def test_a_batch_without_counted_chunks_has_loss_zero(mode, exact_only):
    """No chunk counts (none valid, or none exact with ``exact_only``): the loss is 0, not the
    0 / 0 of an average over no chunks, and no chunk is reported counted."""
    case = make_case(batch=2, ts=14, tt=12, vs=23, vt=19, seed=3)
    valid = case.chunk_valid if exact_only else torch.zeros_like(case.chunk_valid)
    exact = torch.zeros_like(case.chunk_exact)
    details = reference.kd_loss_details(
        case.real_student_logits.double(), case.real_teacher_logits.double(),
        case.student_chunk_id, case.teacher_chunk_id, valid, exact, case.projection.double(),
        mode, 1.0, False, exact_only)
    assert not details.counted.any() and not details.top1.any()
    assert float(details.loss) == 0.0


@pytest.mark.parametrize("kw", [{}, {"vocab_topk": 9}, {"chunk_topk": 5, "jsd_beta": 0.3}],
                         ids=["full", "vocab_topk", "chunk_topk-jsd"])
def test_sparse_projection_gives_the_dense_loss_and_gradient(kw):
    """W as sparse COO (real vocabularies) gives the dense W's loss and student gradient; the
    student's gradient is finite although chunk slots without predicting positions (averages
    over no position) are part of the dense computation."""
    case = make_case(batch=2, ts=14, tt=12, vs=23, vt=19, seed=3)
    results = []
    for projection in (case.projection.double(), case.projection.double().to_sparse()):
        z = case.real_student_logits.double().requires_grad_(True)
        loss = reference.kd_loss(z, case.real_teacher_logits.double(), case.student_chunk_id,
                                 case.teacher_chunk_id, case.chunk_valid, case.chunk_exact,
                                 projection, "pkl", 1.5, **kw)
        loss.backward()
        results.append((loss.detach(), z.grad))
    (dense, dense_grad), (sparse, sparse_grad) = results
    assert torch.isfinite(dense_grad).all() and dense_grad.abs().sum() > 0
    torch.testing.assert_close(sparse, dense, rtol=1e-12, atol=0)
    torch.testing.assert_close(sparse_grad, dense_grad, rtol=1e-10, atol=1e-14)


def test_reference_refuses_an_unknown_mode_and_a_headed_reverse_kl():
    case = make_case(batch=2, ts=14, tt=12, vs=23, vt=19, seed=3)
    args = (case.real_student_logits, case.real_teacher_logits, case.student_chunk_id,
            case.teacher_chunk_id, case.chunk_valid, case.chunk_exact, case.projection)
    with pytest.raises(ValueError, match="loss mode must be one of .* got 'pkI'"):
        reference.kd_loss(*args, "pkI")
    # the defaults: forward P-KL at temperature 1 over every valid chunk
    torch.testing.assert_close(reference.kd_loss(*args),
                               reference.kd_loss(*args, "pkl", 1.0, False, False), rtol=0, atol=0)
    assert reference.kd_loss(*args) != reference.kd_loss(*args, "pkl", 1.0, False, True)
    heads = torch.arange(case.projection.shape[1])
    reference.kd_loss_details(*args, "pkl", chunk_topk=3, teacher_heads=heads)
    with pytest.raises(ValueError, match="forward KL only"):
        reference.kd_loss_details(*args, "pkl", 1.0, True, chunk_topk=3, teacher_heads=heads)


def test_chunks_without_a_predicting_position_on_one_side_do_not_count():
    """A valid chunk whose only token on one side is its sample's first token (nothing predicts
    it) is not counted; the rest is the loop's loss."""
    case = make_case(batch=2, ts=14, tt=12, vs=23, vt=19, seed=3)
    s_ids, t_ids = case.student_chunk_id.clone(), case.teacher_chunk_id.clone()
    t_ids[0, 1:][t_ids[0, 1:] == 0] = -1  # teacher chunk 0 of sample 0: its first token only
    s_ids[1, 1:][s_ids[1, 1:] == 0] = -1  # student chunk 0 of sample 1: the same
    assert case.chunk_valid[0, 0] and case.chunk_valid[1, 0]
    case = dataclasses.replace(case, student_chunk_id=s_ids, teacher_chunk_id=t_ids)
    details = reference.kd_loss_details(
        case.real_student_logits.double(), case.real_teacher_logits.double(), s_ids, t_ids,
        case.chunk_valid, case.chunk_exact, case.projection.double())
    assert not details.counted[0, 0] and not details.counted[1, 0]
    assert details.counted.sum() == case.chunk_valid.sum() - 2
    assert float(details.loss) == pytest.approx(_loop_loss(case, "pkl"), rel=1e-6)


def _headed_loop(case, k: int, heads: torch.Tensor, temp: float) -> tuple[float, torch.Tensor]:
    """Forward KL per chunk, from DESIGN.md's first-token form: the chunk's k most probable
    teacher tokens (chunk-mean log-probs) put their probability on their heads, the rest stays
    one bucket; the student's projected chunk mass normalised over V_t, its bucket the mass off
    the heads that got teacher mass. Also whether each chunk's most probable head is the
    student's most probable among those heads ([B, C], False where not counted)."""
    z, u, w = case.real_student_logits.double(), case.real_teacher_logits.double(), \
        case.projection.double()
    total, count = 0.0, 0
    top1 = torch.zeros_like(case.chunk_valid, dtype=torch.bool)
    for b in range(z.shape[0]):
        for c in range(case.chunk_valid.shape[1]):
            s_pos = _positions(case.student_chunk_id[b], c)
            t_pos = _positions(case.teacher_chunk_id[b], c)
            if not case.chunk_valid[b, c] or not s_pos or not t_pos:
                continue
            q = sum(torch.softmax(z[b, i] / temp, 0) @ w for i in s_pos) / len(s_pos)
            log_p = sum(torch.log_softmax(u[b, j] / temp, 0) for j in t_pos) / len(t_pos)
            top = sorted(range(log_p.numel()), key=lambda t: -float(log_p[t]))[:k]
            p = {}
            for col in top:
                head = int(heads[col])
                p[head] = p.get(head, 0.0) + math.exp(float(log_p[col]))
            p_tail = sum(math.exp(float(log_p[t])) for t in range(log_p.numel()) if t not in top)
            q_all = float(q.sum())
            q_tail = (q_all - sum(float(q[h]) for h in p)) / q_all
            kl = sum(v * (math.log(v) - math.log(float(q[h]) / q_all + EPS)) for h, v in p.items())
            kl += p_tail * (math.log(p_tail) - math.log(q_tail + EPS))
            total += temp * temp * kl
            count += 1
            top1[b, c] = max(p, key=p.get) == max(p, key=lambda h: float(q[h]))
    return total / count, top1


@pytest.mark.parametrize("temp", [1.0, 2.0])
def test_first_token_heads_form_equals_its_loop(temp):
    """``teacher_heads`` (``--kd-first-token``): the headed forward KL of every counted chunk."""
    case = make_case(batch=2, ts=14, tt=12, vs=23, vt=19, seed=3)
    vt = case.projection.shape[1]
    heads = torch.arange(vt) // 3 * 3  # three teacher columns share each head
    details = reference.kd_loss_details(
        case.real_student_logits.double(), case.real_teacher_logits.double(),
        case.student_chunk_id, case.teacher_chunk_id, case.chunk_valid, case.chunk_exact,
        case.projection.double(), "pkl", temp, chunk_topk=5, teacher_heads=heads)
    loss, top1 = _headed_loop(case, 5, heads, temp)
    assert float(details.loss) == pytest.approx(loss, rel=1e-6)
    assert details.top1.tolist() == top1.tolist() and 0 < top1.sum() < details.counted.sum()


def test_first_token_heads_of_every_column_onto_itself_is_the_exact_form():
    """Every teacher column its own head and all of them in the top k: the headed form is the
    exact forward P-KL (its tail is empty, and so is the student's mass off the heads)."""
    case = make_case(batch=2, ts=14, tt=12, vs=23, vt=19, seed=3)
    vt = case.projection.shape[1]
    args = (case.real_student_logits.double(), case.real_teacher_logits.double(),
            case.student_chunk_id, case.teacher_chunk_id, case.chunk_valid, case.chunk_exact,
            case.projection.double(), "pkl", 1.5)
    headed = reference.kd_loss_details(*args, chunk_topk=vt, teacher_heads=torch.arange(vt))
    exact = reference.kd_loss_details(*args)
    torch.testing.assert_close(headed.per_chunk, exact.per_chunk, rtol=1e-9, atol=1e-12)
    assert headed.top1.tolist() == exact.top1.tolist()


@pytest.mark.parametrize("mode", ["pkl", "gold"])
def test_top1_agreement_equals_the_loop(mode):
    """Per counted chunk: the student's and the teacher's most probable token agree (P-KL: on
    the teacher vocabulary, the student's projected mass; gold: over the common pairs)."""
    case = make_case(batch=2, ts=14, tt=12, vs=23, vt=19, seed=3)
    z, u, w = case.real_student_logits.double(), case.real_teacher_logits.double(), \
        case.projection.double()
    details = reference.kd_loss_details(z, u, case.student_chunk_id, case.teacher_chunk_id,
                                        case.chunk_valid, case.chunk_exact, w, mode)
    cs, ct = common_vocab_from_dense(case.projection, mode) if mode != "pkl" else (None, None)
    want = torch.zeros_like(case.chunk_valid, dtype=torch.bool)
    for b in range(z.shape[0]):
        for c in range(case.chunk_valid.shape[1]):
            s_pos = _positions(case.student_chunk_id[b], c)
            t_pos = _positions(case.teacher_chunk_id[b], c)
            if not case.chunk_valid[b, c] or not s_pos or not t_pos:
                continue
            a = sum(torch.log_softmax(z[b, i], 0) for i in s_pos) / len(s_pos)
            t = sum(torch.log_softmax(u[b, j], 0) for j in t_pos) / len(t_pos)
            if mode == "pkl":
                q = sum(torch.softmax(z[b, i], 0) for i in s_pos) @ w
                want[b, c] = int(q.argmax()) == int(t.argmax())
            else:
                want[b, c] = int(a[cs].argmax()) == int(t[ct].argmax())
    assert details.top1.tolist() == want.tolist()
    assert want.sum() < details.counted.sum()  # a flipped comparison would show


# (mode, form, topk, temperature, reverse, with_ce)
GRADCHECK = [
    ("pkl", "full", None, 1.0, False, True),
    ("pkl", "full", None, 2.0, True, False),
    ("pkl", "topk", 7, 1.0, True, False),
    ("pkl", "chunk_topk", 4, 1.5, False, True),
    ("gold", "gold", None, 1.0, False, False),
    ("hkl", "gold", None, 2.0, True, True),
    # the reverse slot holding a float: GKD's JSD beta
    ("pkl", "full", None, 1.0, 0.5, False),
    ("pkl", "chunk_topk", 4, 1.5, 0.3, True),
    ("gold", "gold", None, 1.0, 0.7, False),
]


def _gradcheck_fast(fn, x: torch.Tensor, directions: int = 3) -> None:
    """torch's gradcheck in its fast mode along ``directions`` random directions (seeded): the
    gradient's product with each against the central difference along it, at rtol 1e-7 /
    atol 1e-9 (float64 differences at eps 1e-6 hold that over 30 seeds of every case here; at
    the full mode's 1e-5 one direction missed errors the full Jacobian caught)."""
    for seed in range(directions):
        torch.manual_seed(seed)
        assert torch.autograd.gradcheck(fn, (x,), eps=1e-6, atol=1e-9, rtol=1e-7,
                                        fast_mode=True), f"direction {seed}"


@pytest.mark.parametrize("config", GRADCHECK + [GRADCHECK[3] + ("normalised",)],
                         ids=lambda c: f"{c[0]}-{c[1]}-T{c[3]}-rev{c[4]}" + "".join(c[6:]))
def test_gradcheck_float64(config):
    """Backward (recomputed softmaxes, blockwise) equals finite differences in float64, along
    three random directions (:func:`_gradcheck_fast`; the full Jacobian's 512 evaluations took
    7 s a case for the exact and gold forms; a 0.1% error in gold's log-partition term or in a
    column form's <p, dKL/dp> fails these as it failed that)."""
    from megatron_xdistill.loss import parallel_kd_loss

    mode, form, topk, temp, reverse, with_ce = config[:6]
    case = make_case(batch=2, ts=8, tt=8, vs=11, vt=9, vs_padded=16, vt_padded=12, seed=5,
                     normalised_rows="normalised" in config)
    common = (None, None) if mode == "pkl" else common_vocab_from_dense(case.projection, mode)
    spec = payload_spec(form, case.chunk_valid.shape[1], case.vt, topk=topk,
                        num_common=None if common[0] is None else common[0].numel())
    payload = teacher_payload(case.teacher_logits.double(), predicting_chunk_id(case.teacher_chunk_id),
                              spec, vocab_size=case.vt, temperature=temp,
                              common_teacher_ids=common[1])
    rows = case.projection_rows(case.student_logits.shape[-1])
    ids = predicting_chunk_id(case.student_chunk_id)

    def loss(logits):
        terms = parallel_kd_loss(
            logits, payload, ids, case.chunk_valid, case.chunk_exact, rows,
            student_vocab_size=case.vs, mode=mode, temperature=temp, reverse=reverse is True,
            jsd_beta=None if isinstance(reverse, bool) else reverse,
            common_student_ids=common[0], labels=case.labels if with_ce else None,
            block_bytes=8 * 16 * 3)  # several blocks of whole chunks
        return terms.kd_sum + terms.ce_sum

    x = (0.5 * case.student_logits.double()).requires_grad_(True)
    _gradcheck_fast(loss, x)


def _compressed_losses(case, ks) -> tuple[float, dict[int, float]]:
    args = (case.real_student_logits, case.real_teacher_logits, case.student_chunk_id,
            case.teacher_chunk_id, case.chunk_valid, case.chunk_exact, case.projection)
    exact = float(reference.kd_loss(*args))
    return exact, {k: float(reference.kd_loss(*args, chunk_topk=k)) for k in ks}


@pytest.mark.parametrize("realistic", [True, False], ids=["peaked", "gaussian"])
def test_compressed_form_is_a_bound_that_tightens_with_k(realistic):
    """Per-chunk top-k + tail merges the teacher's tail columns into one bucket, which can only
    lose divergence (coarse-graining), so the compressed loss is a lower bound of the exact one,
    grows with k and reaches it when only one column is left in the tail. The deviation is
    printed; on these synthetic logits (student unrelated to the teacher) it is large; on real
    model pairs benchmarks/bench_loss_compression.py measures it (numbers in its docstring)."""
    case = make_case(batch=4, ts=48, tt=40, vs=400, vt=500, seed=7, realistic=realistic)
    ks = (1, 4, 16, 64, 256, case.vt - 1)
    exact, by_k = _compressed_losses(case, ks)
    print(f"exact P-KL {exact:.4f}; compressed relative deviation by k:",
          {k: f"{(exact - v) / exact:.2e}" for k, v in by_k.items()})
    values = [by_k[k] for k in ks]
    assert all(a <= b * (1 + 1e-6) for a, b in zip(values, values[1:]))
    assert values[-2] <= exact * (1 + 1e-6)
    assert values[-1] == pytest.approx(exact, rel=1e-5)


@pytest.mark.parametrize("rows", ["normalised", "varied", "all-equal", "empty"])
def test_tail_row_sums_match_dense_products(rows):
    """The tail's p.r and p * (b + a r) equal the dense products, whether the row sums are
    split into a constant plus exceptions (normalised rows, fp32 rounding included) or not."""
    from megatron_xdistill.loss.kernels.pkl import TailRowSums

    gen = torch.Generator().manual_seed(3)
    v = 0 if rows == "empty" else 400
    w = torch.rand(v, 3, generator=gen)
    if rows != "varied":
        w /= w.sum(1, keepdim=True)  # sums 1 within a few ulps
        w[torch.randperm(v, generator=gen)[: v // 50] if rows == "normalised" else []] = 0.0
    r = w.sum(1)
    split = TailRowSums(r)
    assert split.sparse == (rows != "varied")
    p = torch.softmax(3 * torch.randn(5, v, generator=gen), 1)
    dense_r = torch.where((r - 1).abs() < 1e-6, torch.ones_like(r), r) if split.sparse else r
    torch.testing.assert_close(split.mass(p), p @ dense_r, rtol=1e-5, atol=1e-6)
    base, a = torch.randn(5, generator=gen), torch.randn(5, generator=gen)
    out = p.clone()
    split.scale_(out, base, a)
    torch.testing.assert_close(out, p * (base[:, None] + a[:, None] * dense_r), rtol=1e-5,
                               atol=1e-7)


def test_payload_rows_of_several_samples_are_gathered_not_copied_whole():
    """Routed payloads of several samples are a strided view into the flat rows; the loss
    gathers chunk rows from it without materialising the whole part (and gets the same rows
    as from a contiguous copy)."""
    from megatron_xdistill.loss.blocks.block_data import rows_of
    from megatron_xdistill.loss.definitions.payload import PayloadSpec, TeacherPayload

    spec = PayloadSpec("full", 5, 7)
    flat = torch.randn(3, spec.numel)
    part = TeacherPayload.from_flat(flat, spec).logprobs  # [3, 5, 7], a view into ``flat``
    assert not part.is_contiguous() and part.data_ptr() == flat.data_ptr()
    keys = torch.tensor([0, 4, 7, 14, 9])
    torch.testing.assert_close(rows_of(part, keys),
                               part.contiguous().reshape(-1, 7).index_select(0, keys))


@pytest.mark.parametrize("form,mode,topk,beta", [
    ("chunk_topk", "pkl", 4, 0.4), ("full", "pkl", None, 0.4), ("gold", "gold", None, 0.4),
    ("gold", "gold", None, None)])  # forward KL: gold's directly written gradient
def test_sample_weights_scale_each_samples_chunks(form, mode, topk, beta):
    """Reward weighting: KD sum = sum_b w_b * sum_c KL_bc (the reference's per-chunk values),
    the chunk count unweighted, and the gradient is that sum's (float64 gradcheck)."""
    from megatron_xdistill.loss import parallel_kd_loss

    case = make_case(batch=3, ts=8, tt=8, vs=11, vt=9, vs_padded=16, vt_padded=12, seed=9)
    common = (None, None) if mode == "pkl" else common_vocab_from_dense(case.projection, mode)
    spec = payload_spec(form, case.chunk_valid.shape[1], case.vt, topk=topk,
                        num_common=None if common[0] is None else common[0].numel())
    payload = teacher_payload(case.teacher_logits.double(),
                              predicting_chunk_id(case.teacher_chunk_id), spec,
                              vocab_size=case.vt, common_teacher_ids=common[1])
    rows = case.projection_rows(case.student_logits.shape[-1])
    ids = predicting_chunk_id(case.student_chunk_id)
    weights = torch.tensor([0.5, 2.0, 0.0], dtype=torch.float64)

    def terms(logits, w):
        return parallel_kd_loss(logits, payload, ids, case.chunk_valid, case.chunk_exact, rows,
                                student_vocab_size=case.vs, mode=mode, jsd_beta=beta,
                                common_student_ids=common[0], sample_weights=w,
                                block_bytes=8 * 16 * 3)

    x = case.student_logits.double()
    kw = {"chunk_topk": topk} if form == "chunk_topk" else {}
    details = reference.kd_loss_details(
        case.real_student_logits.double(), case.real_teacher_logits.double(),
        case.student_chunk_id, case.teacher_chunk_id, case.chunk_valid, case.chunk_exact,
        case.projection.double(), mode, jsd_beta=beta,
        common=None if mode == "pkl" else common, **kw)
    expected = float((details.per_chunk.sum(1) * weights).sum())
    got = terms(x, weights)
    assert float(got.kd_sum) == pytest.approx(expected, rel=1e-6)  # fp32 payload rows
    assert float(got.kd_count) == float(terms(x, None).kd_count) == float(details.counted.sum())
    if form != "chunk_topk" and beta is not None:
        return  # the weights enter every form through the same kl wrapper, or gold's gradient
    x = (0.5 * x).requires_grad_(True)
    _gradcheck_fast(lambda z: terms(z, weights).kd_sum, x)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0], ids=["forward", "jsd", "reverse"])
def test_exact_form_teacher_terms_do_not_depend_on_the_slice(monkeypatch, beta):
    """The exact form's per-row teacher terms (outside W's image, and the teacher's argmax) are
    read in slices of rows: one row a slice, the CPU's 32, and the whole payload at once (a
    GPU's few large slices) give the reference's KD sum and top-1 count."""
    from megatron_xdistill.loss import parallel_kd_loss
    from megatron_xdistill.loss.kernels.pkl import DenseKernel

    case = make_case(batch=3, ts=96, tt=88, vs=50, vt=70, seed=11)
    spec = payload_spec("full", case.chunk_valid.shape[1], case.vt)
    payload = teacher_payload(case.teacher_logits.double(),
                              predicting_chunk_id(case.teacher_chunk_id), spec,
                              vocab_size=case.vt)
    details = reference.kd_loss_details(
        case.real_student_logits.double(), case.real_teacher_logits.double(),
        case.student_chunk_id, case.teacher_chunk_id, case.chunk_valid, case.chunk_exact,
        case.projection.double(), "pkl", jsd_beta=beta)
    assert int(details.counted.sum()) > 64  # more rows than one slice of 32
    expected = float(details.per_chunk.sum())
    results = []
    for rows_per_slice in (1, 32, 10_000):
        monkeypatch.setattr(DenseKernel, "TEACHER_ROWS", rows_per_slice)
        terms = parallel_kd_loss(
            case.student_logits.double(), payload, predicting_chunk_id(case.student_chunk_id),
            case.chunk_valid, case.chunk_exact,
            case.projection_rows(case.student_logits.shape[-1]), student_vocab_size=case.vs,
            jsd_beta=beta)
        assert float(terms.kd_sum) == pytest.approx(expected, rel=1e-6)  # fp32 payload rows
        results.append((float(terms.kd_sum), float(terms.top1)))
    assert results[0] == pytest.approx(results[1], rel=1e-12)
    assert results[0] == pytest.approx(results[2], rel=1e-12)


def test_a_gpu_reads_the_teacher_terms_in_a_few_slices():
    """CPU: 32-row slices; elsewhere at most TEACHER_STEPS slices, never under 32 rows."""
    from megatron_xdistill.loss.kernels.pkl import DenseKernel

    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert DenseKernel.teacher_rows_per_step(11_000, cpu) == 32
    rows = DenseKernel.teacher_rows_per_step(11_000, gpu)
    assert -(-11_000 // rows) <= DenseKernel.TEACHER_STEPS and rows >= 32
    assert DenseKernel.teacher_rows_per_step(100, gpu) == 32


@pytest.mark.parametrize("form,topk", [("topk", 5), ("chunk_topk", 4), ("full", None)])
def test_padding_positions_leave_the_payload_unchanged(form, topk):
    """Positions that predict no chunk (padding, or a forward cut short of it) never change a
    payload: eight more of them, with the largest logit of all at one column each, give the
    same payload as the positions alone. (A column set chosen over every position, padding
    included, would take those columns in the micro-batch top-k form.)"""
    case = make_case(batch=2, ts=8, tt=10, vs=11, vt=30, seed=3)
    pred = predicting_chunk_id(case.teacher_chunk_id)
    spec = payload_spec(form, case.chunk_valid.shape[1], case.vt, topk=topk)
    want = teacher_payload(case.teacher_logits.double(), pred, spec, vocab_size=case.vt)
    pad = torch.zeros(2, 8, case.teacher_logits.shape[-1], dtype=torch.float64)
    pad[:, torch.arange(8), torch.arange(8) * 3] = 1e3
    logits = torch.cat([case.teacher_logits.double(), pad], dim=1)
    pred_padded = torch.cat([pred, torch.full((2, 8), -1, dtype=pred.dtype)], dim=1)
    got = teacher_payload(logits, pred_padded, spec, vocab_size=case.vt)
    assert torch.equal(got.to_flat(), want.to_flat())
