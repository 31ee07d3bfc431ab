"""Two models with different layouts in the same ranks, each on its own process-group collection.

A "student" at TP=2 (DP=2) and a "teacher" at PP=2 (DP=2) are built side by side in every rank
without Megatron's global parallel_state; each must reproduce the unsharded model's loss and
gradients (rel 1e-5), with weights and gradients moved through dist_checkpointing.
"""

from __future__ import annotations

import os
from functools import partial

import pytest
import torch

from megatron_xdistill.parallel.layout import ParallelLayout
from megatron_xdistill.testing.multirank import RankPool

WORLD = 4
BATCH, SEQ = 4, 32
RTOL = 1e-5


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, 256, (BATCH, SEQ + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _build(groups, seed: int = 5):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_xdistill.models.specs import gpt_layer_spec
    from megatron_xdistill.testing.tiny_gpt import tiny_config

    layout = groups.layout
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed, tp_rank=groups.coords["tp"], ep_rank=0, etp_rank=0,
                                    force_reset_rng=True)
    config = tiny_config(layout.tp, layout.pp, layout.cp)
    model = GPTModel(
        config=config,
        transformer_layer_spec=gpt_layer_spec(use_te=False),
        vocab_size=256,
        max_sequence_length=SEQ,
        pre_process=groups.is_first_stage,
        post_process=groups.is_last_stage,
        share_embeddings_and_output_weights=True,
        position_embedding_type="rope",
        pg_collection=groups.pg_collection,
    )
    return config, model


def _train_step(groups, config, model) -> tuple[float, object]:
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    from megatron_xdistill.parallel.context_parallel import slice_for_cp_rank

    pgs, layout, coords = groups.pg_collection, groups.layout, groups.coords
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), model,
                                  pg_collection=pgs)
    config.finalize_model_grads_func = finalize_model_grads
    tokens, labels = _batch()
    rows = BATCH // layout.dp
    local = slice(coords["dp"] * rows, (coords["dp"] + 1) * rows)
    tokens = slice_for_cp_rank(tokens[local], 1, coords["cp"], layout.cp)
    labels = slice_for_cp_rank(labels[local], 1, coords["cp"], layout.cp)
    pos = slice_for_cp_rank(torch.arange(SEQ).expand(rows, SEQ), 1, coords["cp"], layout.cp)
    micro = [(tokens[i : i + 1], labels[i : i + 1], pos[i : i + 1]) for i in range(rows)]

    def loss_func(output):
        total = output.float().sum()
        return total, torch.tensor(output.numel(), dtype=torch.int), {
            "loss": torch.stack([total.detach(), torch.tensor(float(output.numel()))])}

    def forward_step(it, module):
        tok, lab, p = next(it)
        return module(tok, p, None, labels=lab), partial(loss_func)

    reduced = get_forward_backward_func(pp_size=layout.pp)(
        forward_step_func=forward_step, data_iterator=iter(micro), model=[ddp],
        num_microbatches=rows, seq_length=SEQ // layout.cp, micro_batch_size=1,
        forward_only=False, p2p_communicator=P2PCommunicator(pp_group=pgs.pp, config=config),
        pg_collection=pgs,
    )
    stats = torch.zeros(2)
    if groups.is_last_stage and coords["tp"] == 0:
        stats = torch.stack([r["loss"] for r in reduced]).sum(0)
    torch.distributed.all_reduce(stats)
    return (stats[0] / stats[1]).item(), ddp


def _sharded(model, groups):
    # Without parallel_state, the DP x CP group (replica ids) must come through metadata.
    return model.sharded_state_dict(metadata={"dp_cp_group": groups.pg_collection.dp_cp})


def _save(model, groups, path: str) -> None:
    from megatron.core import dist_checkpointing

    os.makedirs(path, exist_ok=True)
    dist_checkpointing.save(_sharded(model, groups), path)


def _load(model, groups, path: str) -> None:
    from megatron.core import dist_checkpointing

    model.load_state_dict(dist_checkpointing.load(_sharded(model, groups), path))


def _reference(root: str) -> dict | None:
    """Unsharded model (TP=PP=1, DP=4): save its weights, return loss and gradients."""
    from megatron_xdistill.parallel.layout import build_model_parallel_groups

    groups = build_model_parallel_groups(ParallelLayout.for_world(WORLD))
    _, model = _build(groups)
    _save(model, groups, os.path.join(root, "init"))
    tokens, labels = _batch()
    loss = model(tokens, torch.arange(SEQ).expand(BATCH, SEQ), None, labels=labels).mean()
    loss.backward()
    if torch.distributed.get_rank():
        return None
    return {"loss": loss.item(), "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}


def _two_layouts(root: str, student: tuple, teacher: tuple) -> dict:
    """Build both models side by side, run one step on each, save each one's reduced grads."""
    from megatron_xdistill.parallel.layout import build_model_parallel_groups

    results = {}
    built = {}
    for name, (tp, cp, pp) in (("student", student), ("teacher", teacher)):
        groups = build_model_parallel_groups(ParallelLayout.for_world(WORLD, tp=tp, cp=cp, pp=pp))
        config, model = _build(groups, seed=100 + len(built))  # different init, then loaded
        _load(model, groups, os.path.join(root, "init"))
        built[name] = (groups, config, model)
    for name, (groups, config, model) in built.items():
        loss, _ = _train_step(groups, config, model)
        for param in model.parameters():
            param.data.copy_(param.main_grad)
        _save(model, groups, os.path.join(root, f"grads_{name}"))
        results[name] = loss
    return results


def _grads_unsharded(path: str) -> dict | None:
    from megatron_xdistill.parallel.layout import build_model_parallel_groups

    groups = build_model_parallel_groups(ParallelLayout.for_world(WORLD))
    _, model = _build(groups)
    _load(model, groups, path)
    if torch.distributed.get_rank():
        return None
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def pool():
    with RankPool(WORLD) as ranks:
        yield ranks


def test_for_world_names_the_bad_layout():
    with pytest.raises(ValueError, match="teacher: world size 6 is not divisible by"):
        ParallelLayout.for_world(6, tp=4, who="teacher")
    layout = ParallelLayout.for_world(8, tp=2, pp=2)
    assert layout.dp == 2
    assert [layout.coords(r)["tp"] for r in range(4)] == [0, 1, 0, 1]
    assert layout.coords(7) == {"tp": 1, "cp": 0, "dp": 1, "pp": 1}


@pytest.mark.parametrize("student,teacher", [((2, 1, 1), (1, 1, 2)), ((1, 2, 1), (2, 1, 2))])
def test_student_and_teacher_layouts_side_by_side(pool, tmp_path, student, teacher):
    root = str(tmp_path)
    ref = pool.run(_reference, root)[0]
    losses = pool.run(_two_layouts, root, student, teacher)
    for name in ("student", "teacher"):
        assert {r[name] for r in losses} == {losses[0][name]}, f"{name}: ranks disagree"
        assert losses[0][name] == pytest.approx(ref["loss"], rel=RTOL), name
        grads = pool.run(_grads_unsharded, os.path.join(root, f"grads_{name}"))[0]
        for pname, expected in ref["grads"].items():
            torch.testing.assert_close(grads[pname], expected, rtol=RTOL, atol=1e-7,
                                       msg=lambda m, n=pname, w=name: f"{w} grad {n}: {m}")
