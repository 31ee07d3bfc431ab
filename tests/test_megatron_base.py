"""Megatron-Core on CPU: a tiny GPTModel gives the same loss and gradients in every layout.

The reference is the unsharded model (TP=PP=CP=1) run on the whole batch in one process. Weights
reach each layout through a dist_checkpointing checkpoint saved at TP=1 (so resharding on load is
exercised), and each layout's reduced gradients come back through a checkpoint saved in that
layout and loaded at TP=1 (so saving sharded and loading unsharded is exercised too).
"""

from __future__ import annotations

import os

import pytest
import torch
from scratch import scratch_dir

from megatron_xdistill.testing.multirank import RankPool

WORLD = 4
BATCH, SEQ = 4, 32
RTOL = 1e-5
ADAM_EPS = 1e-4


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 256, (BATCH, SEQ + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


# ----------------------------------------------------------------------------- rank functions
def _reference(ckpt_dir: str, grad_dir: str | None = None) -> dict | None:
    """TP=PP=CP=1 on every rank: save the initial weights, return loss and full gradients."""
    from megatron.core import dist_checkpointing

    from megatron_xdistill.testing.tiny_gpt import build_tiny_gpt, init_model_parallel, tiny_config

    init_model_parallel(1, 1, 1)
    model = build_tiny_gpt(tiny_config())
    dist_checkpointing.save(model.sharded_state_dict(), ckpt_dir)
    tokens, labels = _batch()
    pos = torch.arange(SEQ).expand(BATCH, SEQ)
    loss = model(tokens, pos, None, labels=labels).mean()
    loss.backward()
    if torch.distributed.get_rank() != 0:
        return None
    return {
        "loss": loss.item(),
        "weights": {n: p.detach().clone() for n, p in model.named_parameters()},
        "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
    }


def _load_into(model, ckpt_dir: str) -> None:
    from megatron.core import dist_checkpointing

    state = dist_checkpointing.load(model.sharded_state_dict(), ckpt_dir)
    model.load_state_dict(state)


def _layout_step(
    ckpt_dir: str, out_dir: str, tp: int, pp: int, cp: int, optimizer_step: bool = False,
    sequence_parallel: bool = False,
) -> float:
    """Forward/backward (and optionally one distributed-optimizer step) in a parallel layout.

    Writes the reduced gradients (or, after a step, the new weights) as a checkpoint to out_dir.
    Returns the global mean loss.
    """
    from functools import partial

    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_xdistill.parallel.context_parallel import slice_for_cp_rank
    from megatron_xdistill.testing.tiny_gpt import build_tiny_gpt, init_model_parallel, tiny_config

    init_model_parallel(tp, pp, cp)
    config = tiny_config(tp, pp, cp, sequence_parallel=sequence_parallel)
    model = build_tiny_gpt(config)
    _load_into(model, ckpt_dir)
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=optimizer_step)
    ddp = DistributedDataParallel(config, ddp_config, model)
    config.finalize_model_grads_func = finalize_model_grads

    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    cp_rank = ps.get_context_parallel_rank()
    tokens, labels = _batch()
    rows = BATCH // dp_size
    local = slice(dp_rank * rows, (dp_rank + 1) * rows)
    tokens = slice_for_cp_rank(tokens[local], 1, cp_rank, cp)
    labels = slice_for_cp_rank(labels[local], 1, cp_rank, cp)
    pos = slice_for_cp_rank(torch.arange(SEQ).expand(rows, SEQ), 1, cp_rank, cp)
    microbatches = [(tokens[i : i + 1], labels[i : i + 1], pos[i : i + 1]) for i in range(rows)]

    def loss_func(output: torch.Tensor):
        total = output.float().sum()
        count = torch.tensor(output.numel(), dtype=torch.int)
        return total, count, {"loss": torch.stack([total.detach(), count.float()])}

    def forward_step(data_iterator, module):
        tok, lab, p = next(data_iterator)
        return module(tok, p, None, labels=lab), partial(loss_func)

    reduced = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(microbatches),
        model=[ddp],
        num_microbatches=rows,
        seq_length=SEQ,  # the schedule divides by CP (and TP with sequence parallelism)
        micro_batch_size=1,
        forward_only=False,
    )
    stats = torch.zeros(2)
    if ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0:
        stats = torch.stack([r["loss"] for r in reduced]).sum(0)
    torch.distributed.all_reduce(stats)

    if optimizer_step:
        opt_config = OptimizerConfig(
            optimizer="adam", lr=1e-2, weight_decay=0.0, clip_grad=1.0, adam_eps=ADAM_EPS,
            use_distributed_optimizer=True, params_dtype=torch.float32,
        )
        optimizer = get_megatron_optimizer(opt_config, [ddp])
        ok, _, _ = optimizer.step()
        assert ok
    else:
        for param in model.parameters():
            param.data.copy_(param.main_grad)
    dist_checkpointing.save(model.sharded_state_dict(), out_dir)
    return (stats[0] / stats[1]).item()


def _load_unsharded(ckpt_dir: str) -> dict | None:
    """Load a checkpoint at TP=PP=CP=1; rank 0 returns the full tensors by parameter name."""
    from megatron_xdistill.testing.tiny_gpt import build_tiny_gpt, init_model_parallel, tiny_config

    init_model_parallel(1, 1, 1)
    model = build_tiny_gpt(tiny_config())
    _load_into(model, ckpt_dir)
    if torch.distributed.get_rank() != 0:
        return None
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _shared_dir(tmp_root: str, name: str) -> str:
    path = os.path.join(tmp_root, name)
    os.makedirs(path, exist_ok=True)
    return path


# ----------------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def pool():
    with RankPool(WORLD) as ranks:
        yield ranks


@pytest.fixture(scope="module")
def reference(pool, request, tmp_path_factory):
    root = str(scratch_dir(request, tmp_path_factory, "megatron_base"))
    ckpt = _shared_dir(root, "init")
    ref = pool.run(_reference, ckpt)[0]
    return root, ckpt, ref


def _assert_close(actual: dict, expected: dict, what: str, atol: float = 1e-7) -> None:
    assert actual.keys() == expected.keys()
    for name, exp in expected.items():
        torch.testing.assert_close(actual[name], exp, rtol=RTOL, atol=atol,
                                   msg=lambda m, n=name: f"{what} of {n}: {m}")


LAYOUTS = {"tp1": (1, 1, 1), "tp2": (2, 1, 1), "pp2": (1, 2, 1), "cp2": (1, 1, 2),
           "tp2pp2": (2, 2, 1), "tp2sp_pp2": (2, 2, 1, True), "tp2sp_cp2": (2, 1, 2, True)}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_loss_and_grads_match_unsharded(pool, reference, name):
    """Every layout (sequence parallelism with TP where the name says "sp") gives the unsharded
    loss and gradients."""
    root, ckpt, ref = reference
    tp, pp, cp, *sp = LAYOUTS[name]
    grad_dir = _shared_dir(root, f"grads_{name}")
    losses = pool.run(_layout_step, ckpt, grad_dir, tp, pp, cp, False, bool(sp))
    assert losses[0] == pytest.approx(ref["loss"], rel=RTOL)
    assert len(set(losses)) == 1, f"ranks disagree on the loss: {losses}"
    grads = pool.run(_load_unsharded, grad_dir)[0]
    _assert_close(grads, ref["grads"], f"gradient ({name})")


def test_distributed_optimizer_step_matches_dense_adam(pool, reference):
    root, ckpt, ref = reference
    out = _shared_dir(root, "after_step")
    pool.run(_layout_step, ckpt, out, 2, 1, 1, optimizer_step=True)  # TP=2 x DP=2
    stepped = pool.run(_load_unsharded, out)[0]

    params = {n: torch.nn.Parameter(w.clone()) for n, w in ref["weights"].items()}
    for n, p in params.items():
        p.grad = ref["grads"][n].clone()
    torch.nn.utils.clip_grad_norm_(list(params.values()), 1.0)
    adam = torch.optim.AdamW(list(params.values()), lr=1e-2, weight_decay=0.0, eps=ADAM_EPS)
    adam.step()
    # Adam's first update g / (|g| + eps) has slope 1/eps near g = 0, so gradients that agree to
    # 1e-6 relative can give updates that differ by ~1e-6 / eps of lr where |g| ~ eps. ADAM_EPS
    # = 1e-4 keeps that below 1e-4 * lr (= atol) while most updates are still ~lr.
    _assert_close(stepped, {n: p.detach() for n, p in params.items()}, "weight after one step",
                  atol=1e-6)


def _recompute_step(ckpt_dir: str, overrides: dict) -> dict:
    """One forward/backward with activation recomputation: loss, gradients and how often the
    first layer and its core attention ran forward."""
    from megatron_xdistill.testing.tiny_gpt import build_tiny_gpt, init_model_parallel, tiny_config

    init_model_parallel(1, 1, 1)
    model = build_tiny_gpt(tiny_config(**overrides))
    _load_into(model, ckpt_dir)
    layer = model.decoder.layers[0]
    calls = {"layer": 0, "core_attention": 0}
    layer.register_forward_hook(lambda *a: calls.__setitem__("layer", calls["layer"] + 1))
    layer.self_attention.core_attention.register_forward_hook(
        lambda *a: calls.__setitem__("core_attention", calls["core_attention"] + 1))
    tokens, labels = _batch()
    pos = torch.arange(SEQ).expand(BATCH, SEQ)
    loss = model(tokens, pos, None, labels=labels).mean()
    loss.backward()
    return {"loss": loss.item(), "calls": calls,
            "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}


@pytest.mark.parametrize("overrides,runs", [
    ({"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 2},
     {"layer": 2, "core_attention": 2}),
    ({"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 1},
     {"layer": 2, "core_attention": 2}),
    ({"recompute_granularity": "selective"}, {"layer": 1, "core_attention": 2}),
])
def test_activation_recomputation_reruns_forward_and_keeps_gradients(pool, reference, overrides,
                                                                      runs):
    """Recomputation (the student's --recompute-*) re-runs what it drops in backward and leaves
    the loss and every gradient as without it."""
    _, ckpt, ref = reference
    out = pool.run(_recompute_step, ckpt, overrides)[0]
    assert out["calls"] == runs
    assert out["loss"] == pytest.approx(ref["loss"], rel=RTOL)
    _assert_close(out["grads"], ref["grads"], f"gradient with {overrides}")
