"""Run the HF model and the converted Megatron model on the same tokens and compare logits.

The Megatron model runs at the requested TP x CP x PP layout (fp32, torch-native spec, on the
CPU) through Megatron's own forward-only pipeline schedule; with CP each rank runs its part of
the sequence (Megatron's load-balanced 2*CP order). Its vocab-parallel logits are gathered over TP
(and CP) and the padded columns dropped. Reported: max abs difference, max relative difference
(max abs difference over the largest |HF logit|), mean abs difference and top-1 agreement.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from conversion.launch import layout_groups, log
from megatron_xdistill.models import (
    ModelInfo,
    build_model_for_layout,
    load_megatron_checkpoint,
    load_model_info,
    model_info_from_hf,
)

SAMPLE_TEXT = (
    "The quick brown fox jumps over the lazy dog. Knowledge distillation trains a small student "
    "model to match the predictions of a larger teacher.\n\n"
    "def fibonacci(n: int) -> int:\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, "
    "a + b\n    return a\n\nprint([fibonacci(i) for i in range(10)])\n"
)


def sample_tokens(hf_dir: str, info: ModelInfo, batch: int, seq_length: int,
                  seed: int = 0, text: bool = True) -> torch.Tensor:
    """[batch, seq_length] ids: row 0 is real text when ``text`` and the folder has a tokenizer;
    the other rows (or all) are seeded random ids over the whole vocabulary."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, info.vocab_size, (batch, seq_length), generator=gen)
    if not text:
        return tokens
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    except Exception:  # noqa: BLE001 - no (loadable) tokenizer: random ids only
        return tokens
    ids: list[int] = []
    while len(ids) < seq_length:
        ids += tokenizer(SAMPLE_TEXT, add_special_tokens=not ids)["input_ids"]
    tokens[0] = torch.tensor(ids[:seq_length])
    return tokens


def megatron_logits(model, tokens: torch.Tensor, config, pg_collection) -> torch.Tensor | None:
    """Logits [b, s, padded vocab] of the full ``tokens`` on the last pipeline stage (gathered
    over TP and CP), else None."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    from megatron_xdistill.parallel.context_parallel import (
        restore_from_cp_parts,
        slice_for_cp_rank,
    )

    cp = pg_collection.cp
    cp_size, cp_rank = cp.size(), cp.rank()
    batch, full = tokens.shape
    tokens = slice_for_cp_rank(tokens, 1, cp_rank, cp_size)
    positions = slice_for_cp_rank(torch.arange(full).expand(batch, full), 1, cp_rank, cp_size)

    def forward_step(data_iterator, module):
        output = module(next(data_iterator), positions, None)
        return output, lambda out, non_loss_data=False: out

    pp = pg_collection.pp
    model.eval()
    with torch.no_grad():
        outputs = get_forward_backward_func(pp_size=pp.size())(
            forward_step_func=forward_step, data_iterator=iter([tokens]), model=[model],
            num_microbatches=1, seq_length=full, micro_batch_size=batch, forward_only=True,
            collect_non_loss_data=True,
            p2p_communicator=P2PCommunicator(pp_group=pp, config=config),
            pg_collection=pg_collection,
        )
    if pp.rank() != pp.size() - 1:
        return None
    local = outputs[0].float()
    tp = pg_collection.tp
    parts = [torch.empty_like(local) for _ in range(tp.size())]
    dist.all_gather(parts, local.contiguous(), group=tp)
    logits = torch.cat(parts, dim=-1)
    if cp_size == 1:
        return logits
    parts = [torch.empty_like(logits) for _ in range(cp_size)]
    dist.all_gather(parts, logits, group=cp)
    return restore_from_cp_parts(parts, 1)


def hf_logits(hf_dir: str, tokens: torch.Tensor) -> torch.Tensor:
    """The HF model's fp32 logits (eager attention)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32,
                                                 attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        return model(tokens).logits.float()


def compare_logits(reference: torch.Tensor, actual: torch.Tensor) -> dict[str, float]:
    """Max abs / max rel (over max |reference|) / mean abs difference and top-1 agreement."""
    diff = (actual - reference).abs()
    scale = reference.abs().max().clamp_min(1e-30)
    agree = (actual.argmax(-1) == reference.argmax(-1)).float().mean()
    return {"max_abs_diff": diff.max().item(), "max_rel_diff": (diff.max() / scale).item(),
            "mean_abs_diff": diff.mean().item(), "top1_agreement": agree.item(),
            "max_abs_logit": scale.item()}


def verify_conversion(hf_dir: str, load: str, tp: int = 1, pp: int = 1, batch: int = 2,
                      seq_length: int = 64, seed: int = 0, text: bool = True,
                      cp: int = 1, ep: int = 1) -> dict[str, Any]:
    """Collective: compare ``load`` (at TP x CP x PP, DP = the rest, EP within CP x DP for an
    MoE model) with the HF model in ``hf_dir``. With CP, ``seq_length`` must be a multiple of
    2 x CP. Every DP rank runs the same tokens (EP ranks exchange them with their experts).

    Returns the metrics on every rank.
    """
    info = load_model_info(load)
    theirs = model_info_from_hf(hf_dir, info.make_vocab_size_divisible_by)
    # Both models run in fp32, so the stored dtype may differ (an fp32 export of bf16 weights).
    differences = info.differences(theirs, ignore=("hf_dtype",))
    if differences:
        raise ValueError(f"{load} (Megatron) and {hf_dir} (HF) describe different models: "
                         + "; ".join(differences))
    if theirs.hf_dtype != info.hf_dtype:
        log(f"note: {load} was converted from {info.hf_dtype} weights, {hf_dir} stores "
            f"{theirs.hf_dtype}; both run in fp32 here")
    if seq_length % (2 * cp):
        raise ValueError(f"--seq-length {seq_length} is not a multiple of 2 x CP = {2 * cp}")
    groups = layout_groups(tp, pp, who="verify", cp=cp, ep=ep)
    reporter = dist.get_rank() == _reporting_rank(groups.layout)
    tokens = torch.empty(batch, seq_length, dtype=torch.long)
    if dist.get_rank() == 0:  # one tokenizer load, not one per rank
        tokens = sample_tokens(hf_dir, info, batch, seq_length, seed, text)
    dist.broadcast(tokens, src=0)
    log(f"running HF and Megatron (TP={tp} CP={cp} PP={pp}) on {batch}x{seq_length} tokens")
    # The HF model runs (and is freed) before the Megatron shard is built: peak memory is the
    # larger of the two models, not their sum.
    reference = hf_logits(hf_dir, tokens) if reporter else None
    model, config = build_model_for_layout(info, groups, torch.float32, seed, use_te=False,
                                           perform_initialization=False,
                                           use_cpu_initialization=True)
    load_megatron_checkpoint(model, load, groups.pg_collection)
    logits = megatron_logits(model, tokens, config, groups.pg_collection)
    result: list[Any] = [None]
    if reporter:
        padded = logits[..., info.vocab_size:]
        metrics = compare_logits(reference, logits[..., : info.vocab_size])
        metrics["padded_logits_max_abs"] = padded.abs().max().item() if padded.numel() else 0.0
        metrics.update(tp=tp, cp=cp, pp=pp, ep=ep, batch=batch, seq_length=seq_length)
        result = [metrics]
    dist.broadcast_object_list(result, src=_reporting_rank(groups.layout))
    return result[0]


def _reporting_rank(layout) -> int:
    """Global rank of (tp 0, cp 0, dp 0, last pp stage) in Megatron's tp-cp-dp-pp order."""
    return (layout.pp - 1) * layout.tp * layout.cp * layout.dp
