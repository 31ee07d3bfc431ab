"""One pass of Megatron's pipeline schedule over a model's micro-batches.

The only place the runtime calls the schedule: the teacher's forward-only pass, the student's
training step and its evaluation all go through :func:`run_schedule`, which feeds each
micro-batch's tokens (this CP rank's slice, with their positions) to the model and hands its
output to the caller's loss function.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from functools import partial

import torch
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

from megatron_xdistill.parallel.layout import ModelParallelGroups


def cp_local_inputs(tokens: torch.Tensor, groups: ModelParallelGroups, device: torch.device
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """This CP rank's slice of ``tokens`` [b, s] and of their positions, on ``device``."""
    positions = torch.arange(tokens.size(1)).expand(tokens.size(0), -1)
    return groups.cp_local(tokens).to(device), groups.cp_local(positions).to(device)


def run_schedule(model, config, groups: ModelParallelGroups, microbatches: list, *,
                 tokens: Callable[[object], torch.Tensor], loss_func: Callable, seq_length: int,
                 micro_batch_size: int, device: torch.device, forward_only: bool) -> list:
    """Megatron's forward(-backward) schedule over ``microbatches``.

    The model reads ``tokens(microbatch)[:, :-1]`` (the inputs of the next-token shift);
    ``loss_func(microbatch, logits)`` returns Megatron's loss-function tuple on the last stage.
    Returns what the schedule collects from the loss functions (last stage; empty elsewhere).
    Forward-only passes run without autograd.
    """

    def forward_step(data_iterator, module):
        microbatch = next(data_iterator)
        inputs, positions = cp_local_inputs(tokens(microbatch)[:, :-1], groups, device)
        return module(inputs, positions, None), partial(loss_func, microbatch)

    grad = torch.no_grad() if forward_only else contextlib.nullcontext()
    with grad:
        return get_forward_backward_func(pp_size=groups.layout.pp)(
            forward_step_func=forward_step, data_iterator=iter(microbatches),
            model=[model], num_microbatches=len(microbatches), seq_length=seq_length,  # the schedule divides by CP
            micro_batch_size=micro_batch_size, forward_only=forward_only,
            p2p_communicator=P2PCommunicator(pp_group=groups.pg_collection.pp, config=config),
            pg_collection=groups.pg_collection,
        )
