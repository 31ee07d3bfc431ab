"""GPU: CUDA IPC transport between processes, the NCCL group guard, GPU memory after a dead rank,
the loss on CUDA against the CPU reference, and training on the GPU against the CPU run.

All marked ``gpu`` (skipped without CUDA). Written for a one-GPU machine: the IPC tests put two
processes on one GPU with a gloo control group (NCCL refuses two ranks on one GPU, which the guard
test checks is reported as such).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch
from test_disaggregated import check_stream_steps, stream_steps
from test_transport import check_slot_steps, slot_steps

from megatron_xdistill.testing.multirank import RankError, RankPool

pytestmark = pytest.mark.gpu


# ---------------------------------------------------------------------------- CUDA IPC
@pytest.fixture(scope="module")
def pool():
    with RankPool(2) as ranks:
        yield ranks


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_ipc_between_two_processes_on_one_gpu(pool, dtype):
    check_slot_steps(pool.run(slot_steps, 4, dtype, "cuda"), dtype)


def test_disaggregated_stream_over_cuda_ipc_on_one_gpu():
    """Two teacher and two student processes on one GPU: the teachers write two steps ahead into
    CUDA IPC slots, the students read them in place (zero-copy), signals over gloo."""
    with RankPool(4) as ranks:
        results = ranks.run(stream_steps, 2.0, 4, 60.0, [0, 0, 0, 0], "cuda", timeout=300)
    check_stream_steps(results, 2.0, 4, "one_node")
    assert [r["kind"] for r in results] == ["CUDA IPC"] * 4


def _routed() -> dict:
    """RoutedTransport on the GPU: 2 ranks, rank 0 sends 2 samples to rank 1."""
    import torch.distributed as dist

    from megatron_xdistill.transport.routed import RoutedTransport
    from megatron_xdistill.transport.routing import Route

    torch.cuda.set_device(0)
    rank = dist.get_rank()
    transport = RoutedTransport([Route(0, 0, 1), Route(1, 0, 1), Route(2, 1, 1)], numel=8,
                                device="cuda:0")
    out = {0: torch.full((8,), 1.0, device="cuda"), 1: torch.full((8,), 2.0, device="cuda")} \
        if rank == 0 else {2: torch.full((8,), 3.0, device="cuda")}
    got = transport.exchange(out)
    result = {"kind": transport.same_node_kind,
              "got": {s: v.tolist() for s, v in sorted(got.items())}}
    transport.close()
    return result


def test_routed_transport_uses_cuda_ipc_within_a_node(pool):
    out = pool.run(_routed)
    assert out[1]["kind"] == "CUDA IPC"
    assert out[1]["got"] == {0: [1.0] * 8, 1: [2.0] * 8, 2: [3.0] * 8}
    assert out[0]["got"] == {}


def test_nccl_route_between_two_ranks_on_one_gpu_is_refused():
    """Two torchrun "nodes" on one GPU: the cross-node route would need NCCL between two
    ranks on one GPU; both ranks refuse with an error naming them (no hang)."""
    env = [{"GROUP_RANK": str(r), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"} for r in range(2)]
    with RankPool(2, rank_env=env) as ranks, pytest.raises(RankError, match="both use GPU"):
        ranks.run(_routed, timeout=120)


def _hold_ipc_then_die(nbytes: int, who_dies: int) -> None:
    import torch.distributed as dist

    from megatron_xdistill.transport.cuda_ipc import CudaIpcTransport
    from megatron_xdistill.transport.routing import Route

    torch.cuda.set_device(0)
    transport = CudaIpcTransport([Route(0, 0, 1)], nbytes // 4)
    out = {0: torch.ones(nbytes // 4, device="cuda")} if dist.get_rank() == 0 else {}
    transport.exchange(out)
    dist.barrier()
    if dist.get_rank() == who_dies:
        os._exit(3)  # no close, no finalizers: as if killed
    time.sleep(60)


@pytest.mark.parametrize("who_dies", [0, 1], ids=["sender-dies", "receiver-dies"])
def test_dead_rank_leaks_no_gpu_memory(who_dies):
    nbytes = 1 << 30  # 2 slots = 2 GiB on the GPU, plus the 1 GiB payload
    torch.cuda.init()
    free_before = torch.cuda.mem_get_info(0)[0]
    with RankPool(2) as ranks, pytest.raises(RankError):
        ranks.run(_hold_ipc_then_die, nbytes, who_dies, timeout=120)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        free = torch.cuda.mem_get_info(0)[0]
        if free >= free_before - (256 << 20):
            break
        time.sleep(1)
    assert free >= free_before - (256 << 20), \
        f"{(free_before - free) / 2**30:.2f} GiB still held after the ranks ended"


# ---------------------------------------------------------------------------- loss numerics
@pytest.mark.parametrize("mode,form,topk", [("pkl", "full", None), ("pkl", "image", None),
                                            ("pkl", "topk", 12), ("pkl", "chunk_topk", 6),
                                            ("gold", "gold", None), ("hkl", "gold", None)])
def test_parallel_loss_on_gpu_matches_reference(mode, form, topk):
    """fp32 on CUDA vs the float64 CPU reference: loss and gradient, rel 1e-5."""
    from megatron_xdistill.loss import parallel_kd_loss, teacher_image
    from megatron_xdistill.loss.definitions import reference
    from megatron_xdistill.loss.definitions.common import (
        common_vocab_from_dense,
        predicting_chunk_id,
    )
    from megatron_xdistill.loss.teacher import payload_spec, teacher_payload
    from megatron_xdistill.testing.synthetic_kd import make_case

    case = make_case(batch=3, ts=40, tt=32, vs=300, vt=250, vs_padded=320, vt_padded=256,
                     seed=4, realistic=True, normalised_rows=True)
    common = (None, None) if mode == "pkl" else common_vocab_from_dense(case.projection, mode)
    image = (teacher_image(*case.projection_rows(case.student_logits.shape[-1]), case.vs)
             if form == "image" else None)
    spec = payload_spec(form, case.chunk_valid.shape[1], case.vt, topk=topk,
                        num_common=None if common[0] is None else common[0].numel(),
                        num_image=None if image is None else image.numel())
    dev = torch.device(os.environ.get("XDISTILL_TEST_DEVICE", "cuda"))
    payload = teacher_payload(case.teacher_logits.to(dev), predicting_chunk_id(case.teacher_chunk_id),
                              spec, vocab_size=case.vt, temperature=1.5,
                              common_teacher_ids=None if common[1] is None else common[1].to(dev),
                              image_teacher_ids=image)
    logits = case.student_logits.to(dev).requires_grad_(True)
    terms = parallel_kd_loss(
        logits, payload, predicting_chunk_id(case.student_chunk_id), case.chunk_valid,
        case.chunk_exact, case.projection_rows(case.student_logits.shape[-1]),
        student_vocab_size=case.vs, mode=mode, temperature=1.5,
        common_student_ids=None if common[0] is None else common[0].to(dev),
        labels=case.labels, block_bytes=4 * 320 * 16)  # ~16 positions a block: several blocks
    loss = terms.kd_sum / terms.kd_count + terms.ce_sum / terms.ce_count
    loss.backward()

    z = case.real_student_logits.detach().double().requires_grad_(True)
    kw = {"vocab_topk": topk} if form == "topk" else {"chunk_topk": topk} if topk else {}
    ref = reference.kd_loss(z, case.real_teacher_logits.double(), case.student_chunk_id,
                            case.teacher_chunk_id, case.chunk_valid, case.chunk_exact,
                            case.projection.double(), mode, 1.5, **kw)
    mask = case.labels >= 0
    ref = ref + torch.nn.functional.cross_entropy(z[mask], case.labels[mask])
    ref.backward()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5)
    grad = logits.grad.cpu().double()
    scale = z.grad.abs().max().item()
    torch.testing.assert_close(grad[..., : case.vs], z.grad, rtol=1e-5, atol=1e-5 * scale)
    assert torch.count_nonzero(grad[..., case.vs:]) == 0


def _synchronisations(fn) -> int:
    """How many times ``fn()`` made the host wait on the GPU (torch's sync debug mode)."""
    import warnings

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in seen)


@pytest.mark.parametrize("form,topk", [("topk", 12), ("chunk_topk", 6), ("full", None),
                                       ("image", None), ("gold", None)])
def test_column_loss_waits_on_the_gpu_a_fixed_number_of_times(form, topk):
    """The column P-KL (the default payload) expands its W entries once per call: its forward
    and backward wait on the GPU no more often with 40 blocks than with 2 (per-block waits were
    a large part of the loss's time on an H100). The exact and gold forms finish their rows
    per block; their row selection is found on the CPU with the blocks, so they too."""
    from megatron_xdistill.loss import parallel_kd_loss, teacher_image
    from megatron_xdistill.loss.definitions.common import (
        common_vocab_from_dense,
        predicting_chunk_id,
    )
    from megatron_xdistill.loss.teacher import payload_spec, teacher_payload
    from megatron_xdistill.testing.synthetic_kd import make_case

    case = make_case(batch=3, ts=40, tt=32, vs=300, vt=250, vs_padded=320, vt_padded=256,
                     seed=4, realistic=True, normalised_rows=True)
    mode = "gold" if form == "gold" else "pkl"
    common = (None, None) if mode == "pkl" else common_vocab_from_dense(case.projection, mode)
    image = (teacher_image(*case.projection_rows(case.student_logits.shape[-1]), case.vs)
             if form == "image" else None)
    spec = payload_spec(form, case.chunk_valid.shape[1], case.vt, topk=topk,
                        num_common=None if common[0] is None else common[0].numel(),
                        num_image=None if image is None else image.numel())
    dev = torch.device("cuda")
    payload = teacher_payload(case.teacher_logits.to(dev),
                              predicting_chunk_id(case.teacher_chunk_id), spec, vocab_size=case.vt,
                              common_teacher_ids=None if common[1] is None else common[1].to(dev),
                              image_teacher_ids=image)
    chunk_id = predicting_chunk_id(case.student_chunk_id)
    projection = case.projection_rows(case.student_logits.shape[-1])
    labels = case.labels.to(dev)
    counts = {}
    for positions in (64, 3):  # 120 positions: 2 blocks, then 40
        logits = case.student_logits.to(dev).requires_grad_(True)

        def step(logits=logits, positions=positions):
            terms = parallel_kd_loss(logits, payload, chunk_id, case.chunk_valid,
                                     case.chunk_exact, projection, student_vocab_size=case.vs,
                                     mode=mode, labels=labels,
                                     common_student_ids=None if common[0] is None
                                     else common[0].to(dev),
                                     block_bytes=4 * 320 * positions * (4 if topk is None else 1))
            (terms.kd_sum + terms.ce_sum).backward()

        step()  # warm-up: first-call setup is not what is counted
        logits.grad = None
        counts[positions] = _synchronisations(step)
    # H200, 2026-11-26: 36 waits with 2 blocks, 35 with 40 (topk); 39 and 39 (chunk_topk). A
    # bound per call, whatever the blocks and chunks: one wait more a block would add 40 with
    # 40 blocks, one a chunk 41 (the case's valid chunks), one a position 120 (75 or more in
    # all); 56 leaves the forms not measured then 17 waits above the most seen.
    most = 56
    assert max(counts.values()) <= most, f"host waits a loss call (positions a block): {counts}"
    assert counts[3] <= counts[64], f"host waits by block size (positions per block): {counts}"


# ---------------------------------------------------------------------------- training
def test_training_on_gpu_matches_cpu_run(tmp_path):
    """pretrain_xdistill on one GPU gives the CPU run's first losses (fp32, rel 2e-4: GPU and
    CPU kernels round differently, and three Adam steps carry the differences)."""
    import test_e2e

    if not (test_e2e.ASSETS / "tokenizers").is_dir():
        pytest.skip("shared assets not found")
    root, s_tok, t_tok = test_e2e.make_setup(tmp_path)
    script = test_e2e.Path(__file__).resolve().parents[1] / "pretrain_xdistill.py"

    def run(name: str, env: dict) -> list:
        argv = test_e2e._argv(root, s_tok, t_tok, name, [])
        done = subprocess.run([sys.executable, str(script), *argv], capture_output=True,
                              text=True, env={**os.environ, **env}, timeout=900)
        assert done.returncode == 0, done.stderr[-4000:]
        return test_e2e._losses(root, name)

    cpu = run("cpu", {"CUDA_VISIBLE_DEVICES": ""})
    gpu = run("gpu", {})
    assert len(gpu) == len(cpu) == test_e2e.STEPS
    for step, ((kd, ce), (kd_ref, ce_ref)) in enumerate(zip(gpu, cpu), 1):
        assert kd == pytest.approx(kd_ref, rel=2e-4), f"step {step} kd"
        assert ce == pytest.approx(ce_ref, rel=2e-4), f"step {step} ce"


# ---------------------------------------------------------------------------- generation
def _greedy_on_gpu(ckpt: str, prompts: list[list[int]], new_tokens: int) -> dict:
    """Rank function: the checkpoint's model on the GPU decodes ``prompts`` greedily."""
    from conversion.launch import layout_groups
    from megatron_xdistill.generation import SamplingParams, generate
    from megatron_xdistill.models import build_model_for_layout, load_megatron_checkpoint
    from megatron_xdistill.models.model_checkpoint import load_model_info

    torch.cuda.set_device(0)
    info = load_model_info(ckpt)
    groups = layout_groups(1, 1, who="generate")
    model, _ = build_model_for_layout(info, groups, torch.float32, 0, use_te=False,
                                      perform_initialization=False)
    load_megatron_checkpoint(model, ckpt, groups.pg_collection)
    model.cuda()
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0)
    out = generate(model, groups, prompts, params, eos_token_ids=[], vocab_size=info.vocab_size,
                   device=torch.device("cuda"))
    torch.cuda.synchronize()
    start = time.perf_counter()
    generate(model, groups, prompts * 8, params, eos_token_ids=[], vocab_size=info.vocab_size,
             device=torch.device("cuda"))
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return {"responses": [out.response(i) for i in range(len(prompts))],
            "tokens_per_s": len(prompts) * 8 * new_tokens / seconds}


def test_greedy_generation_on_gpu_equals_hf_generate(tmp_path):
    """KV-cached generation on CUDA (fp32) gives transformers' greedy ids; prints tokens/s."""
    from transformers import AutoModelForCausalLM

    from conversion.hf_to_mcore import convert_hf_to_mcore
    from megatron_xdistill.testing.tiny_models import make_tiny_model

    hf_dir = make_tiny_model("smollm2", str(tmp_path / "hf"), seed=11)
    prompts = [[5, 17, 300, 41, 9], [77, 8, 1200, 3, 64, 901, 12, 45, 2], [1, 999, 31]]
    with RankPool(1) as ranks:
        ranks.run(convert_hf_to_mcore, hf_dir, str(tmp_path / "ckpt"), 1, 1)
        [got] = ranks.run(_greedy_on_gpu, str(tmp_path / "ckpt"), prompts, 16)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).cuda().eval()
    for prompt, response in zip(prompts, got["responses"]):
        ids = hf.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=16,
                          do_sample=False, pad_token_id=0, top_k=None, top_p=None,
                          temperature=None)
        assert response == ids[0, len(prompt):].tolist()
    print(f"greedy generation on the GPU: {got['tokens_per_s']:.0f} tokens/s (batch 24)")
