"""A Megatron GPTModel in any TP / PP layout as the two calls an evaluation harness needs:
teacher-forced token log-probabilities and greedy (or sampled) KV-cached generation.

Every rank of a model-parallel replica calls the same method with the same inputs, in the same
order (the harness runs in lockstep on every rank): the first pipeline stage embeds, hidden
states travel stage to stage, the last stage computes full-vocabulary log-probabilities (logits
gathered over TP), and its results are broadcast over the pipeline group, so every rank returns
the same numbers. Sequence and context parallelism are switched off for the call
(:func:`~megatron_xdistill.generation.decoding_mode`): every rank sees whole sequences.

:func:`load_parallel_model` builds one from a checkpoint (a converted model or a training run)
in the layout of the running world; training wraps its own student model the same way.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_xdistill.generation import SamplingParams, decoding_mode, generate
from megatron_xdistill.parallel.layout import ModelParallelGroups


@dataclass
class ParallelModel:
    """This rank's stage of a model (possibly wrapped in DDP / Float16Module) and its layout.

    ``vocab_size``: the tokenizer's (real) vocabulary; logit columns past it are Megatron's
    padding. ``max_length``: the longest sequence the model takes (its position limit).
    """

    model: torch.nn.Module
    groups: ModelParallelGroups
    vocab_size: int
    max_length: int
    device: torch.device

    def _dtype(self, gpt) -> torch.dtype:
        config = gpt.config
        return config.pipeline_dtype or config.params_dtype or next(gpt.parameters()).dtype

    def _broadcast_from_last_stage(self, value: torch.Tensor) -> torch.Tensor:
        pp = self.groups.pg_collection.pp
        if pp.size() > 1:
            dist.broadcast(value, group=pp, group_src=pp.size() - 1)
        return value

    def token_logprobs(self, rows: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher-forced scores of ``rows`` (token ids, each at most ``max_length + 1`` long):
        ``(logprobs, greedy)``, both [len(rows), longest - 1] on the CPU, where entry ``t`` of a
        row is ``log p(row[t + 1] | row[:t + 1])`` (float64) and whether ``row[t + 1]`` is the
        arg-max token; entries past a row's end are 0 / False. Same on every rank."""
        if not rows or any(len(r) < 2 for r in rows):
            raise ValueError("token_logprobs: every row needs at least two tokens")
        width = max(len(r) for r in rows) - 1
        if width > self.max_length:
            raise ValueError(f"token_logprobs: {width} inputs exceed the model's {self.max_length}")
        inputs = torch.zeros(len(rows), width, dtype=torch.long)
        targets = torch.full((len(rows), width), -1, dtype=torch.long)
        for i, row in enumerate(rows):
            inputs[i, :len(row) - 1] = torch.as_tensor(row[:-1])
            targets[i, :len(row) - 1] = torch.as_tensor(row[1:])
        out = torch.zeros(2, len(rows), width, dtype=torch.float64, device=self.device)
        with decoding_mode(self.model) as gpt:
            logits = self._stage_forward(gpt, inputs.to(self.device))
            if logits is not None:
                logits = logits[..., :self.vocab_size].float()
                real = targets.to(self.device) >= 0
                index = targets.to(self.device).clamp(min=0)[..., None]
                # log-softmax at the targets only: no second [b, s, V] tensor
                logp = logits.gather(-1, index)[..., 0] - torch.logsumexp(logits, dim=-1)
                out[0] = torch.where(real, logp.double(), 0.0)
                out[1] = (real & (logits.argmax(-1) == index[..., 0])).double()
        out = self._broadcast_from_last_stage(out).cpu()
        return out[0], out[1].bool()

    def _stage_forward(self, gpt, tokens: torch.Tensor) -> torch.Tensor | None:
        """One forward of this pipeline stage over ``tokens`` [b, s]: the full-vocabulary
        logits [b, s, V] on the last stage, None elsewhere."""
        pp = self.groups.pg_collection.pp
        b, s = tokens.shape
        positions = torch.arange(s, device=tokens.device).expand(b, -1)
        if not self.groups.is_first_stage:
            hidden = torch.empty(s, b, gpt.config.hidden_size, dtype=self._dtype(gpt),
                                 device=tokens.device)
            dist.recv(hidden, group=pp, group_src=pp.rank() - 1)
            gpt.set_input_tensor(hidden)
        out = gpt(tokens, positions, None, runtime_gather_output=True)
        if not self.groups.is_last_stage:
            dist.send(out.contiguous(), group=pp, group_dst=pp.rank() + 1)
            return None
        return out

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 eos_token_ids: Sequence[int], stop_when: Callable[[int, list[int]], bool] | None
                 = None, generator: torch.Generator | None = None) -> list[list[int]]:
        """Responses (token ids, EOS included where one ended them) to ``prompts``, decoded
        with the project's KV-cached generation in this layout; the same on every rank."""
        out = generate(self.model, self.groups, prompts, params, eos_token_ids=eos_token_ids,
                       vocab_size=self.vocab_size, device=self.device, generator=generator,
                       stop_when=stop_when)
        return [out.response(i) for i in range(len(prompts))]


def _init_world() -> bool:
    """torch.distributed for this process: the torchrun world when launched by it (NCCL on
    GPUs, gloo on CPUs), else one rank. Returns whether it was created here."""
    from megatron_xdistill.mcore import compat as mcore_compat

    mcore_compat.install()
    if dist.is_initialized():
        return False
    cuda = mcore_compat.cuda_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    backend = "nccl" if cuda else "gloo"
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return True


def load_parallel_model(load: str, tp: int = 1, pp: int = 1,
                        dtype: torch.dtype = torch.float32) -> ParallelModel:
    """A checkpoint (``xdistill-convert hf-to-mcore`` output or a training run: its latest
    iteration) as this rank's stage at TP x PP over the running world (DP = the rest; each
    replica evaluates the same requests). Creates the world when none exists."""
    from megatron_xdistill.evaluation.bits_per_byte import quiet_loading
    from megatron_xdistill.mcore import compat as mcore_compat
    from megatron_xdistill.models import (
        build_model_for_layout,
        check_layout,
        load_megatron_checkpoint,
        load_model_info,
    )
    from megatron_xdistill.parallel.layout import ParallelLayout, build_model_parallel_groups
    from megatron_xdistill.storage import require_directory

    require_directory(load, "load")
    info = load_model_info(load)
    check_layout(info, tp, pp)
    _init_world()
    quiet_loading()
    layout = ParallelLayout.for_world(dist.get_world_size(), tp=tp, pp=pp, who="xdistill-lm-eval",
                                      fix="tp= / pp= in --model_args or the number of ranks")
    groups = build_model_parallel_groups(layout)
    model, _ = build_model_for_layout(info, groups, dtype, perform_initialization=False)
    load_megatron_checkpoint(model, load, groups.pg_collection)
    model.eval()
    device = (torch.device("cuda", torch.cuda.current_device())
              if mcore_compat.cuda_available() else torch.device("cpu"))
    return ParallelModel(model, groups, info.vocab_size, info.max_position_embeddings, device)
