"""A training-layout ``GPTModel`` switched to incremental decoding for the length of a block.

Generation runs in the model's own training layout. Three things a training forward relies on
do not hold for one-token steps, so :func:`decoding_mode` turns them off and restores them:

* sequence parallelism (a one-token step cannot be split over the TP ranks): the attributes
  Megatron's ``set_model_to_sequence_parallel`` toggles, switched here module by module (its
  own cache is keyed by ``id(model)``, which a later model in the same process can reuse);
* context parallelism: every CP rank decodes the whole sequence (CP ranks hold the same weights),
  so the rotary tables and the core attention see CP size 1;
* training mode and autograd: ``eval()``, ``no_grad``, and Megatron's ``InferenceMode`` flag.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from megatron.core.inference.utils import InferenceMode
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

from megatron_xdistill.models.attention import TorchCoreAttention


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The ``GPTModel`` inside Megatron's DDP / Float16Module wrappers."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def _cp_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of ``model`` that split or gather over a CP group of more than one rank."""
    return [module for module in model.modules()
            if isinstance(module, (RotaryEmbedding, TorchCoreAttention))
            and getattr(module, "cp_group", None) is not None and module.cp_group.size() > 1]


#: the module attributes that carry sequence parallelism (Megatron's own list)
_SEQUENCE_PARALLEL_ATTRS = ("sequence_parallel", "scatter_to_sequence_parallel",
                            "reduce_scatter_embeddings")


def _sequence_parallel_off(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, bool]]:
    """Turn sequence parallelism off everywhere in ``model``; returns what to restore."""
    saved = []
    for module in model.modules():
        for attr in _SEQUENCE_PARALLEL_ATTRS:
            if getattr(module, attr, None) is True:
                saved.append((module, attr, True))
                setattr(module, attr, False)
    return saved


@contextlib.contextmanager
def decoding_mode(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Within the block ``model`` (unwrapped) decodes: eval, no autograd, no sequence or context
    parallelism. Everything is restored on exit, also on error."""
    model = unwrap(model)
    was_training = model.training
    sequence_parallel = bool(model.config.sequence_parallel)
    cp_modules = _cp_modules(model)
    cp_groups = [module.cp_group for module in cp_modules]
    model.eval()
    saved = _sequence_parallel_off(model)
    model.config.sequence_parallel = False
    for module in cp_modules:
        module.cp_group = None
    try:
        with torch.no_grad(), InferenceMode.active():
            yield model
    finally:
        for module, group in zip(cp_modules, cp_groups):
            module.cp_group = group
        for module, attr, value in saved:
            setattr(module, attr, value)
        model.config.sequence_parallel = sequence_parallel
        model.train(was_training)
