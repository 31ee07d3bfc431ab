"""HF folder -> Megatron dist_checkpointing checkpoint (plus ``xdistill_model.json``).

Every rank builds its own shard of the GPTModel at the requested layout (no initialisation),
fills each parameter from the HF tensors it needs, read one at a time, and the shards are saved
together with dist_checkpointing. Peak memory per rank: its model shard plus one HF tensor and
the unsharded Megatron tensor made from it.
"""

from __future__ import annotations

import os

import torch

from conversion import moe_mapping
from conversion.launch import layout_groups, log
from conversion.mapping import (
    check_hf_tensors,
    hf_names,
    parse_megatron_name,
    to_megatron,
    tp_shard,
)
from conversion.safetensors_io import SafetensorsFolder
from megatron_xdistill.models import (
    ModelInfo,
    build_model_for_layout,
    check_layout,
    copy_hf_files,
    model_info_from_hf,
    save_megatron_checkpoint,
    torch_dtype,
)


def preflight(hf_dir: str, tp: int = 1, pp: int = 1, ep: int = 1) -> tuple[ModelInfo, list[str]]:
    """Check an HF folder before any work: supported architecture, layout, every tensor's name
    and shape (headers only). Returns the ModelInfo and notes on ignored tensors."""
    from megatron_xdistill.models.moe import moe_config_kwargs

    info = model_info_from_hf(hf_dir)
    check_layout(info, tp, pp)
    moe_config_kwargs(info, ep)  # EP must divide the experts
    with SafetensorsFolder(hf_dir) as hf:
        notes = check_hf_tensors(hf, info)
    return info, notes


def fill_from_hf(model, hf: SafetensorsFolder, info: ModelInfo, tp_rank: int, tp: int) -> None:
    """Copy every parameter of this rank's model shard from the HF tensors."""
    layers = model.decoder.layers
    report = max(1, len(layers) // 8)
    last_layer = None
    for name, param in model.named_parameters():
        role, local = parse_megatron_name(name)
        layer = None if local is None else layers[local].layer_number - 1
        if moe_mapping.expert_of(role) is not None:  # this EP rank's expert -> global index
            role = moe_mapping.globalize(role, layers[local].mlp.local_expert_indices)
        sources = hf_names(role, layer, info)
        full = to_megatron(role, [hf.get(n) for n in sources], info, tp)
        shard = tp_shard(role, full, tp_rank, tp)
        if tuple(shard.shape) != tuple(param.shape):
            raise ValueError(f"{name} (from {', '.join(sources)}): TP rank {tp_rank} part has "
                             f"shape {list(shard.shape)}, the model expects {list(param.shape)}")
        with torch.no_grad():
            param.copy_(shard)
        if local is not None and local != last_layer:
            last_layer = local
            if local % report == 0:
                log(f"  layer {layer + 1}/{info.num_layers}")


def convert_hf_to_mcore(
    hf_dir: str, out: str, tp: int = 1, pp: int = 1, dtype: str | None = None,
    overwrite: bool = False, seed: int = 1234, ep: int = 1,
) -> dict:
    """Collective (every rank of the world): write a checkpoint of ``hf_dir`` at ``out``.

    The world is split into TP x PP x DP (DP ranks hold replicas and write nothing extra; with
    ``ep`` > 1, MoE models spread their experts over EP of the DP ranks).
    ``dtype`` defaults to the HF config's. Returns a summary (same on every rank).
    """
    info, notes = preflight(hf_dir, tp, pp, ep)
    for note in notes:
        log(note)
    dtype = torch_dtype(dtype or info.hf_dtype)
    groups = layout_groups(tp, pp, ep=ep)
    log(f"building {info.architecture} ({info.num_layers} layers, hidden {info.hidden_size}, "
        f"vocab {info.vocab_size} -> {info.padded_vocab_size(tp)} padded) at TP={tp} PP={pp}, "
        f"{dtype}" + (f", EP={ep}" if ep > 1 else ""))
    model, _ = build_model_for_layout(info, groups, dtype, seed, use_te=False,
                                      perform_initialization=False, use_cpu_initialization=True)
    log(f"reading {hf_dir}")
    with SafetensorsFolder(hf_dir) as hf:
        fill_from_hf(model, hf, info, groups.coords["tp"], tp)
    log(f"saving {out}")
    source = {"hf_dir": os.path.abspath(hf_dir), "dtype": str(dtype).replace("torch.", ""),
              "tp": tp, "pp": pp, **({"ep": ep} if ep > 1 else {})}
    save_megatron_checkpoint(model, out, info, groups.pg_collection, overwrite=overwrite,
                             extra={"source": source},
                             before_commit=lambda tmp: copy_hf_files(hf_dir, tmp))
    log(f"wrote {out}")
    return {"out": os.path.abspath(out), **source}
