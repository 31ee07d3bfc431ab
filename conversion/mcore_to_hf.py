"""Megatron checkpoint -> HF folder (safetensors, config.json, tokenizer files).

The checkpoint (any layout it was saved in, or a training run's latest iteration) is loaded into
an unsharded model, then the HF tensors are produced and written one at a time. Peak memory: the
model plus one tensor. The config comes from ``--hf-template`` (checked against the checkpoint's
architecture) or from the HF config stored at import; tokenizer files likewise.
"""

from __future__ import annotations

import json
import os
import shutil

import torch
import torch.distributed as dist

from conversion.launch import layout_groups, log
from conversion.mapping import hf_specs, iter_hf_tensors
from conversion.safetensors_io import write_safetensors
from megatron_xdistill.models import (
    ModelInfo,
    build_model_for_layout,
    load_megatron_checkpoint,
    load_model_info,
    model_info_from_hf,
    resolve_checkpoint_dir,
    torch_dtype,
)
from megatron_xdistill.models.model_checkpoint import HF_SIDE_FILES, all_ranks_ok, hf_files_dir
from megatron_xdistill.storage import atomic_directory, refuse_existing


def checkpoint_dtype(ckpt_dir: str) -> torch.dtype:
    """dtype the checkpoint stores its weights in (read from its metadata)."""
    from megatron.core import dist_checkpointing

    meta = dist_checkpointing.load_tensors_metadata(resolve_checkpoint_dir(ckpt_dir))
    tensor = meta.get("embedding.word_embeddings.weight")
    if tensor is None:  # not first-stage weights? any model tensor tells the same
        tensor = next(t for k, t in meta.items() if k.startswith(("decoder.", "output_layer.")))
    return tensor.dtype


def _hf_config(info: ModelInfo, template: str | None, dtype: torch.dtype) -> dict:
    """config.json content: the template's (must describe the same model) or the stored one."""
    config = dict(info.hf_config)
    if template is not None:
        with open(os.path.join(template, "config.json")) as fh:
            config = json.load(fh)
        theirs = model_info_from_hf(config, info.make_vocab_size_divisible_by)
        diffs = [f for f in ModelInfo.__dataclass_fields__
                 if f not in ("hf_config", "hf_dtype") and getattr(theirs, f) != getattr(info, f)]
        if diffs:
            field = diffs[0]
            raise ValueError(f"--hf-template {template} describes another model: {field} is "
                             f"{getattr(theirs, field)!r} there, {getattr(info, field)!r} in the "
                             "checkpoint")
    config["dtype"] = str(dtype).replace("torch.", "")
    config.pop("torch_dtype", None)
    return config


def _write_hf_folder(model, info: ModelInfo, config: dict, out: str, ckpt_dir: str,
                     template: str | None, dtype: torch.dtype, max_shard_bytes: int,
                     overwrite: bool) -> list[str]:
    params = dict(model.named_parameters())
    with atomic_directory(out, replace=overwrite) as staging:
        tmp = str(staging)
        files = write_safetensors(
            tmp, hf_specs(info, dtype),
            iter_hf_tensors(info, params, dtype, progress=lambda m: log(f"  {m}")),
            max_shard_bytes)
        with open(os.path.join(tmp, "config.json"), "w") as fh:
            json.dump(config, fh, indent=2, sort_keys=True)
            fh.write("\n")
        side = template if template is not None else hf_files_dir(ckpt_dir)
        copied = []
        if side is not None:
            for name in HF_SIDE_FILES:
                if name != "config.json" and os.path.isfile(os.path.join(side, name)):
                    shutil.copy2(os.path.join(side, name), tmp)
                    copied.append(name)
        if not any(name.startswith("tokenizer") for name in copied):
            log("warning: no tokenizer files found; pass --hf-template DIR to include them")
    return files


def convert_mcore_to_hf(
    load: str, out: str, hf_template: str | None = None, dtype: str | None = None,
    max_shard_size_gb: float = 5.0, overwrite: bool = False,
) -> dict:
    """Collective (every rank): rank 0 writes the HF folder of checkpoint ``load`` to ``out``.

    All ranks load the unsharded model (DP replicas), so run this on one rank unless testing.
    ``dtype`` defaults to the original HF model's. Returns a summary (rank 0's).
    """
    refuse_existing(out, overwrite)
    info = load_model_info(load)
    stored = checkpoint_dtype(load)
    out_dtype = torch_dtype(dtype or info.hf_dtype)
    hf_config = _hf_config(info, hf_template, out_dtype)  # a wrong template fails before loading
    groups = layout_groups(1, 1, who="export")
    model, _ = build_model_for_layout(info, groups, stored, use_te=False,
                                      perform_initialization=False, use_cpu_initialization=True)
    path = load_megatron_checkpoint(model, load, groups.pg_collection)
    log(f"loaded {path} ({info.architecture}, {stored}); writing {out} as {out_dtype}")
    files: list[str] = []
    error = None
    if dist.get_rank() == 0:
        try:
            files = _write_hf_folder(model, info, hf_config, out, load, hf_template, out_dtype,
                                     int(max_shard_size_gb * 2**30), overwrite)
        except Exception as exc:  # noqa: BLE001 - re-raised after the other ranks know
            error = exc
    ok = all_ranks_ok(error is None)
    if error is not None:
        raise error
    if not ok:
        raise RuntimeError("export failed on rank 0")
    log(f"wrote {out} ({', '.join(files)})")
    return {"out": os.path.abspath(out), "files": files,
            "dtype": str(out_dtype).replace("torch.", "")}
