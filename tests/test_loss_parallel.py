"""The vocab-parallel, CP-aware loss equals the dense reference in every layout.

Four CPU ranks run TP x CP in {(1,1), (2,1), (4,1), (1,2), (2,2)} (the rest of the world is DP;
TP4 x CP2 needs eight ranks and runs in the slow test). Every loss configuration goes through the
whole path: teacher payload from the teacher's sharded logits (same layout), student loss from the
student's sharded logits, total loss normalised over DP x CP, backward. The test driver compares
the summed loss shares, the reassembled gradients (padded columns must get none) and the payload
with the single-process reference.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from megatron_xdistill.loss.definitions import reference
from megatron_xdistill.loss.definitions.common import common_vocab_from_dense, predicting_chunk_id
from megatron_xdistill.loss.kernels.image_projection import teacher_image
from megatron_xdistill.loss.teacher import payload_spec, teacher_payload
from megatron_xdistill.parallel.context_parallel import restore_from_cp_parts
from megatron_xdistill.testing.multirank import RankPool
from megatron_xdistill.testing.synthetic_kd import make_case

WORLD = 4
RTOL = 1e-5
# Normalised W rows: the chunk top-k tail takes its sparse row-sum path (the general path is
# covered by test_loss_reference's gradcheck and the TailRowSums test).
CASE = dict(batch=4, ts=32, tt=24, vs=70, vt=62, vs_padded=96, vt_padded=72, seed=11,
            normalised_rows=True)
# (mode, form, topk, temperature, reverse, exact_only, ce_weight, dynamic, uncommon_topk)
CONFIGS = [
    ("pkl", "full", None, 1.0, False, False, 0.5, False, 8192),
    ("pkl", "full", None, 2.0, True, False, 0.0, False, 8192),
    ("pkl", "topk", 12, 1.0, False, False, 0.0, False, 8192),
    ("pkl", "topk", 12, 1.5, True, True, 1.0, False, 8192),
    ("pkl", "chunk_topk", 6, 1.0, False, False, 0.0, False, 8192),
    ("pkl", "chunk_topk", 6, 2.0, True, False, 1.0, True, 8192),
    ("gold", "gold", None, 1.0, False, False, 0.0, False, 8192),
    ("gold", "gold", None, 2.0, True, False, 1.0, False, 5),
    ("hkl", "gold", None, 1.0, False, False, 1.0, True, 8192),
    ("hkl", "gold", None, 1.5, True, True, 0.0, False, 8192),
    # a float in the reverse slot: GKD's generalized JSD beta
    ("pkl", "full", None, 1.0, 0.5, False, 0.0, False, 8192),
    ("pkl", "chunk_topk", 6, 1.5, 0.3, False, 1.0, False, 8192),
    # the exact form from W's image only (the teacher's sums outside it): forward KL with CE,
    # reverse at T 2, JSD
    ("pkl", "image", None, 1.0, False, False, 0.5, False, 8192),
    ("pkl", "image", None, 2.0, True, False, 0.0, False, 8192),
    ("pkl", "image", None, 1.0, 0.5, False, 0.0, False, 8192),
]
_GROUPS: dict = {}


def _groups(tp: int, cp: int):
    """(tp, cp, dp x cp) groups and this rank's coordinates; rank = (dp * cp + c) * tp + t."""
    import torch.distributed as dist

    if (tp, cp) not in _GROUPS:
        world, rank = dist.get_world_size(), dist.get_rank()
        dp = world // (tp * cp)

        def rank_of(d, c, t):
            return (d * cp + c) * tp + t

        mine = {}
        for d in range(dp):
            for c in range(cp):
                g = dist.new_group([rank_of(d, c, t) for t in range(tp)])
                if rank in [rank_of(d, c, t) for t in range(tp)]:
                    mine["tp"] = g
        for d in range(dp):
            for t in range(tp):
                g = dist.new_group([rank_of(d, c, t) for c in range(cp)])
                if rank in [rank_of(d, c, t) for c in range(cp)]:
                    mine["cp"] = g
        for t in range(tp):
            ranks = [rank_of(d, c, t) for d in range(dp) for c in range(cp)]
            g = dist.new_group(ranks)
            if rank in ranks:
                mine["dp_cp"] = g
        coords = {"tp": rank % tp, "cp": (rank // tp) % cp, "dp": rank // (tp * cp), "n_dp": dp}
        _GROUPS[(tp, cp)] = (mine, coords)
    return _GROUPS[(tp, cp)]


def _common(case, mode):
    return common_vocab_from_dense(case.projection, mode) if mode != "pkl" else (None, None)


def _image(case, form):
    """W's image (image form), from the projection's rows as the student shards them."""
    if form != "image":
        return None
    return teacher_image(*case.projection_rows(case.student_logits.shape[-1]), case.vs)


def _spec(case, config):
    """The config's payload spec (form "gold_topk": the topk slot holds (k, k'))."""
    mode, form, topk, *_, unc = config
    common = _common(case, mode)
    if form == "gold_topk":
        return payload_spec(form, case.chunk_valid.shape[1], case.vt,
                            num_common=common[0].numel(), uncommon_topk=unc, gold_topk=topk[0],
                            gold_uncommon_topk=topk[1], student_vocab_size=case.vs)
    image = _image(case, form)
    return payload_spec(form, case.chunk_valid.shape[1], case.vt, topk=topk,
                        num_common=None if common[0] is None else common[0].numel(),
                        uncommon_topk=unc, num_image=None if image is None else image.numel())


def _run_layout(tp: int, cp: int, case_kwargs: dict, configs: list, block_bytes: int,
                weights_ahead: bool = False) -> dict:
    """On every rank: the whole teacher -> student path for every config in layout TP x CP.
    ``weights_ahead``: the global counts first (a no-grad call), then the call with the loss's
    weights (``loss_weights``: the forward writes the gradient where the layout allows)."""
    from megatron_xdistill.loss import parallel_kd_loss, total_loss
    from megatron_xdistill.parallel.context_parallel import slice_for_cp_rank

    groups, at = _groups(tp, cp)
    case = make_case(**case_kwargs)
    samples = torch.arange(case.chunk_valid.shape[0])[at["dp"]:: at["n_dp"]]
    vs_local = case.student_logits.shape[-1] // tp
    vt_local = case.teacher_logits.shape[-1] // tp

    def local(t, width):
        t = slice_for_cp_rank(t[samples], 1, at["cp"], cp)
        return t[..., at["tp"] * width: (at["tp"] + 1) * width].contiguous()

    def ids(t):
        return slice_for_cp_rank(predicting_chunk_id(t)[samples], 1, at["cp"], cp)

    rows = case.projection_rows(case.student_logits.shape[-1])
    shard = tuple(r[at["tp"] * vs_local: (at["tp"] + 1) * vs_local] for r in rows)
    labels = slice_for_cp_rank(case.labels[samples], 1, at["cp"], cp)
    out = []
    for config in configs:
        mode, form, topk, temp, reverse, exact_only, ce_w, dynamic, unc = config
        common = _common(case, mode)
        payload = teacher_payload(
            local(case.teacher_logits, vt_local), ids(case.teacher_chunk_id), _spec(case, config),
            vocab_size=case.vt, temperature=temp, common_teacher_ids=common[1],
            image_teacher_ids=_image(case, form),
            tp_group=groups["tp"], cp_group=groups["cp"], block_bytes=block_bytes)
        logits = local(case.student_logits, vs_local).requires_grad_(True)

        args = (logits, payload, ids(case.student_chunk_id), case.chunk_valid[samples],
                case.chunk_exact[samples], shard)
        kw = dict(student_vocab_size=case.vs, mode=mode, temperature=temp,
                  reverse=reverse is True, jsd_beta=None if isinstance(reverse, bool) else reverse,
                  exact_only=exact_only, common_student_ids=common[0], uncommon_topk=unc,
                  labels=labels if ce_w else None, tp_group=groups["tp"], cp_group=groups["cp"],
                  block_bytes=block_bytes)
        n_kd = n_ce = None
        if weights_ahead:
            with torch.no_grad():
                first = parallel_kd_loss(*args, **kw)
            counts = torch.stack([first.kd_count.double(), first.ce_count.double()])
            torch.distributed.all_reduce(counts, group=groups["dp_cp"])
            n_kd, n_ce = counts.clamp_min(1.0).tolist()
        terms = parallel_kd_loss(*args, **kw, loss_weights=(1.0 / n_kd, ce_w / n_ce)
                                 if weights_ahead else None)
        loss, metrics = total_loss(terms, kd_weight=1.0, ce_weight=ce_w, dynamic_scaling=dynamic,
                                   dp_cp_group=groups["dp_cp"], kd_denominator=n_kd,
                                   ce_denominator=n_ce)
        loss.backward()
        out.append({"loss": loss.item(), "grad": logits.grad, "metrics": metrics,
                    "payload": payload.to_flat(), "samples": samples})
    return {"coords": at, "results": out}


def _reference(case, config, n_dp: int) -> tuple[float, torch.Tensor, dict]:
    """Reference loss, gradient and metrics; each DP replica's samples are one microbatch
    (the microbatch-global top-k columns are per microbatch)."""
    mode, form, topk, temp, reverse, exact_only, ce_w, dynamic, unc = config
    z = case.real_student_logits.clone().requires_grad_(True)
    kw = ({"vocab_topk": topk} if form == "topk" else {"gold_topk": topk}
          if form == "gold_topk" else {"chunk_topk": topk} if topk else {})
    kd_sum, n, top1 = 0.0, 0, 0
    for d in range(n_dp):
        s = torch.arange(case.chunk_valid.shape[0])[d::n_dp]
        details = reference.kd_loss_details(
            z[s], case.real_teacher_logits[s], case.student_chunk_id[s],
            case.teacher_chunk_id[s], case.chunk_valid[s], case.chunk_exact[s], case.projection,
            mode, temp, reverse is True, exact_only, uncommon_topk=unc, **kw,
            jsd_beta=None if isinstance(reverse, bool) else reverse)
        kd_sum = kd_sum + details.per_chunk.sum()
        n += int(details.counted.sum())
        top1 += int(details.top1.sum())
    kd = kd_sum / max(n, 1)
    mask = case.labels >= 0
    ce = torch.nn.functional.cross_entropy(z[mask], case.labels[mask])
    scale = (ce / kd).detach() if dynamic else 1.0
    loss = scale * kd + (1.0 if dynamic else ce_w) * ce
    loss.backward()
    return loss.item(), z.grad, {"valid_chunks": float(n), "top1_agree": top1 / max(n, 1)}


def _assemble(case, outs, tp: int, cp: int, index: int) -> tuple[float, torch.Tensor]:
    """Sum of the loss shares over DP x CP, and the full-batch gradient from every rank's part."""
    grad = torch.zeros_like(case.student_logits)
    total = 0.0
    by_dp: dict = {}
    for out in outs:
        at, res = out["coords"], out["results"][index]
        if at["tp"] == 0:
            total += res["loss"]
        by_dp.setdefault(at["dp"], {}).setdefault(at["cp"], {})[at["tp"]] = res
    for parts in by_dp.values():
        pieces = [torch.cat([parts[c][t]["grad"] for t in range(tp)], dim=-1) for c in range(cp)]
        samples = parts[0][0]["samples"]
        grad[samples] = restore_from_cp_parts(pieces, seq_dim=1)
    return total, grad


@pytest.fixture(scope="module")
def pool():
    with RankPool(WORLD) as ranks:
        yield ranks


@pytest.fixture(scope="module")
def expected():
    case = make_case(**CASE)
    payloads = {}
    refs = {}

    def get(n_dp: int):
        """(case, references, payloads) for a layout with n_dp replicas (cached)."""
        if n_dp not in refs:
            refs[n_dp] = [_reference(case, c, n_dp) for c in CONFIGS]
            payloads[n_dp] = [_payload(case, c, n_dp) for c in CONFIGS]
        return case, refs[n_dp], payloads[n_dp]

    return get


def _payload(case, config, n_dp: int) -> torch.Tensor:
    """Single-process payload of each replica's microbatch, as rows of the whole batch."""
    mode, form, topk, temp, *_ = config
    common = _common(case, mode)
    flat = None
    for d in range(n_dp):
        s = torch.arange(case.chunk_valid.shape[0])[d::n_dp]
        part = teacher_payload(
            case.teacher_logits[s], predicting_chunk_id(case.teacher_chunk_id)[s],
            _spec(case, config), vocab_size=case.vt, temperature=temp,
            common_teacher_ids=common[1], image_teacher_ids=_image(case, form)).to_flat()
        if flat is None:
            flat = part.new_zeros(case.chunk_valid.shape[0], part.shape[1])
        flat[s] = part
    return flat


def references_by_dp(case, configs) -> Callable[[int], tuple]:
    """``get(n_dp)`` -> (case, the float64 references of ``configs``, their single-process
    payloads) for ``n_dp`` data-parallel ranks, each made once (a module fixture's value)."""
    made: dict = {}

    def get(n_dp: int):
        if n_dp not in made:
            made[n_dp] = (case, [_reference(case, c, n_dp) for c in configs],
                          [_payload(case, c, n_dp) for c in configs])
        return made[n_dp]

    return get


def _check_layout(outs, expected, tp: int, cp: int, which: list[int] | None = None,
                  configs: list = CONFIGS) -> None:
    """Every config's results (``which``: the ``configs`` they are, in order) against the
    references."""
    case, refs, payloads = expected(outs[0]["coords"]["n_dp"])
    for at, i in enumerate(range(len(configs)) if which is None else which):
        config = configs[i]
        ref_loss, ref_grad, ref_metrics = refs[i]
        loss, grad = _assemble(case, outs, tp, cp, at)
        where = f"TP{tp} CP{cp} {config}"
        assert loss == pytest.approx(ref_loss, rel=RTOL), where
        scale = ref_grad.abs().max().item()
        torch.testing.assert_close(grad[..., : case.vs], ref_grad, rtol=RTOL, atol=RTOL * scale,
                                   msg=lambda m, w=where: f"{w}: {m}")
        assert torch.count_nonzero(grad[..., case.vs:]) == 0, where
        for out in outs:
            res = out["results"][at]
            assert res["metrics"]["valid_chunks"] == ref_metrics["valid_chunks"], where
            assert res["metrics"]["top1_agree"] == pytest.approx(ref_metrics["top1_agree"]), where
            torch.testing.assert_close(res["payload"], payloads[i][res["samples"]],
                                       rtol=RTOL, atol=1e-6, msg=lambda m, w=where: f"{w}: {m}")


@pytest.mark.parametrize("tp,cp", [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2)])
def test_parallel_loss_matches_reference(pool, expected, tp, cp):
    outs = pool.run(_run_layout, tp, cp, CASE, CONFIGS, 4 * 24 * 5)
    _check_layout(outs, expected, tp, cp)


#: exact P-KL with CE, gold at T 2 (reverse, CE), the chunk top-k with CE, the image form with CE
AHEAD = [0, 7, 11, 12]


@pytest.mark.parametrize("tp,cp", [(2, 1), (2, 2)])
def test_forward_gradient_matches_reference(pool, expected, tp, cp):
    """``loss_weights``: the forward writes the gradient (TP 2: the exact form's KL and its
    gradient from the replicated sums in one pass); with CP 2 the chunks split over CP keep
    the recomputing backward on every rank alike. Against the same references."""
    outs = pool.run(_run_layout, tp, cp, CASE, [CONFIGS[i] for i in AHEAD], 4 * 24 * 5, True)
    _check_layout(outs, expected, tp, cp, AHEAD)


@pytest.mark.slow
def test_parallel_loss_matches_reference_tp4_cp2(expected):
    with RankPool(8) as ranks:
        outs = ranks.run(_run_layout, 4, 2, CASE, CONFIGS, 4 * 24 * 5)
    _check_layout(outs, expected, 4, 2)
