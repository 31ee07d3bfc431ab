"""Batched, KV-cached sampling with a Megatron ``GPTModel`` in its training layout (TP / PP / CP).

The key/value cache is Megatron's own (``StaticInferenceContext``): the prompt is encoded once,
then one token per step. Prompts of different lengths share a batch without padding masks: the
batch is encoded up to its shortest prompt, and a sequence whose prompt is longer is fed its own
prompt tokens one step at a time until its response begins (so every position sees exactly its
own prefix, as a causal model expects). A sequence that has finished leaves the batch (its
key/value rows with it), so a batch costs what its unfinished sequences cost.

Collectives: the last pipeline stage draws the next tokens from the full-vocabulary logits
(gathered over TP by the model), TP rank 0's draw is broadcast over TP and then over PP, so every
rank of the replica holds the same sequences and leaves the loop at the same step. Data-parallel
replicas decode their own prompts independently (each with its own generator).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core.inference.contexts import StaticInferenceContext

from megatron_xdistill.generation.decoding_mode import decoding_mode
from megatron_xdistill.generation.sampling import SamplingParams, sample_next
from megatron_xdistill.parallel.layout import ModelParallelGroups


@dataclass(frozen=True)
class Generation:
    """Sequences of a batch (CPU tensors, the same on every rank of the model-parallel replica).

    ``tokens`` [b, L]: prompt then response, ``pad_token_id`` after ``lengths[i]``.
    ``logprobs`` [b, L]: log p(token | prefix) under the model (temperature 1) at response
    positions, 0 elsewhere. ``finished`` [b]: the response ended with an EOS token (False: it
    stopped at ``max_new_tokens``).
    """

    tokens: torch.Tensor
    prompt_lengths: torch.Tensor
    lengths: torch.Tensor
    logprobs: torch.Tensor
    finished: torch.Tensor

    def response(self, i: int) -> list[int]:
        """Sequence ``i``'s response ids (with its EOS when it ended on one)."""
        return self.tokens[i, int(self.prompt_lengths[i]):int(self.lengths[i])].tolist()


def _kv_cache(model, context: StaticInferenceContext, device: torch.device,
              dtype: torch.dtype) -> None:
    """Allocate this stage's key/value buffers on ``device`` (Megatron would allocate them on
    the current CUDA device, which a CPU run does not have)."""
    for layer in model.decoder.layers:
        attention = layer.self_attention
        shape = (context.max_sequence_length, context.max_batch_size,
                 attention.num_query_groups_per_partition)
        context.key_value_memory_dict[attention.layer_number] = (
            torch.empty(*shape, attention.key_hidden_size, dtype=dtype, device=device),
            torch.empty(*shape, attention.val_hidden_size, dtype=dtype, device=device))


def _keep_cache_rows(context: StaticInferenceContext, keep: torch.Tensor) -> None:
    """Drop the key/value rows of finished sequences: Megatron writes a step's keys at batch
    rows ``0..b-1`` of its buffers, so the rows of the sequences still decoded move to the
    front, in order."""
    for number, (key, value) in context.key_value_memory_dict.items():
        context.key_value_memory_dict[number] = (key[:, keep], value[:, keep])


def _stage_forward(model, groups: ModelParallelGroups, tokens: torch.Tensor, start: int,
                   context: StaticInferenceContext, dtype: torch.dtype) -> torch.Tensor | None:
    """One step of this pipeline stage over ``tokens`` [b, s] at positions start.. : the last
    position's full-vocabulary logits [b, V] (fp32) on the last stage, None elsewhere."""
    pp = groups.pg_collection.pp
    b, s = tokens.shape
    positions = torch.arange(start, start + s, device=tokens.device).expand(b, -1)
    if not groups.is_first_stage:
        hidden = torch.empty(s, b, model.config.hidden_size, dtype=dtype, device=tokens.device)
        dist.recv(hidden, group=pp, group_src=pp.rank() - 1)
        model.set_input_tensor(hidden)
    out = model(tokens, positions, None, inference_context=context, runtime_gather_output=True)
    if not groups.is_last_stage:
        dist.send(out.contiguous(), group=pp, group_dst=pp.rank() + 1)
        return None
    return out[:, -1, :].float()


def _agree(groups: ModelParallelGroups, draw: torch.Tensor) -> torch.Tensor:
    """TP rank 0 of the last stage's ``draw`` on every rank of the replica."""
    tp, pp = groups.pg_collection.tp, groups.pg_collection.pp
    if groups.is_last_stage and tp.size() > 1:
        dist.broadcast(draw, group=tp, group_src=0)
    if pp.size() > 1:
        dist.broadcast(draw, group=pp, group_src=pp.size() - 1)
    return draw


def _param_dtype(model) -> torch.dtype:
    config = model.config
    return config.pipeline_dtype or config.params_dtype or next(model.parameters()).dtype


def generate(model, groups: ModelParallelGroups, prompts: Sequence[Sequence[int]],
             params: SamplingParams, *, eos_token_ids: Collection[int], vocab_size: int,
             device: torch.device, generator: torch.Generator | None = None,
             pad_token_id: int = 0,
             stop_when: Callable[[int, list[int]], bool] | None = None) -> Generation:
    """Sample a response to each prompt (token ids) with ``model`` (this rank's shard).

    Every rank of the model-parallel replica calls this with the same prompts. ``vocab_size`` is
    the tokenizer's: the padded vocabulary rows are never drawn. ``generator`` (on ``device``)
    makes the draws reproducible; greedy decoding needs none. A response ends after an
    ``eos_token_ids`` token or ``params.max_new_tokens`` tokens, or when ``stop_when(i,
    response ids so far)`` says so (e.g. a stop string in the decoded text): every rank holds the
    same sequences, so every rank's call gives the same answer and the ranks leave together.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate: every prompt needs at least one token (e.g. BOS)")
    eos = torch.tensor(sorted(set(eos_token_ids)), dtype=torch.long)
    batch = len(prompts)
    prompt_lengths = torch.tensor([len(p) for p in prompts])
    total = int(prompt_lengths.max()) + params.max_new_tokens
    tokens = torch.full((batch, total), pad_token_id, dtype=torch.long)
    for i, prompt in enumerate(prompts):
        tokens[i, :len(prompt)] = torch.as_tensor(prompt, dtype=torch.long)
    logprobs = torch.zeros(batch, total)
    new = torch.zeros(batch, dtype=torch.long)
    finished = torch.zeros(batch, dtype=torch.bool)
    done = torch.zeros(batch, dtype=torch.bool)
    rows = torch.arange(batch)  # the sequences still decoded, in their key/value cache order
    context = StaticInferenceContext(batch, total)
    with decoding_mode(model) as gpt:
        dtype = _param_dtype(gpt)
        _kv_cache(gpt, context, device, dtype)
        start, end = 0, int(prompt_lengths.min())
        while True:
            logits = _stage_forward(gpt, groups, tokens[rows, start:end].to(device), start,
                                    context, dtype)
            context.sequence_len_offset = end
            if start == 0:
                context.enable_decode_mode()
            draw = torch.zeros(len(rows), 2, dtype=torch.float64, device=device)
            if logits is not None:
                ids, lp = sample_next(logits[:, :vocab_size], params, generator)
                draw = torch.stack([ids.double(), lp.double()], dim=1)
            draw = _agree(groups, draw).cpu()
            in_prompt = end < prompt_lengths[rows]
            active = ~in_prompt  # every row still decoded is unfinished
            step = torch.where(in_prompt, tokens[rows, end], draw[:, 0].long())
            tokens[rows, end] = step
            logprobs[rows, end] = torch.where(active, draw[:, 1].float(), torch.zeros(len(rows)))
            new[rows] += active.long()
            ended = active & torch.isin(step, eos)
            finished[rows] |= ended
            stop = ended | (active & (new[rows] >= params.max_new_tokens))
            if stop_when is not None:
                for j in torch.nonzero(active & ~stop).flatten().tolist():
                    i = int(rows[j])
                    stop[j] = stop_when(i, tokens[i, int(prompt_lengths[i]):end + 1].tolist())
            done[rows] = stop
            if bool(done.all()) or end + 1 >= total:
                break
            if bool(stop.any()):  # finished sequences leave the batch: later steps skip them
                rows = rows[~stop]
                _keep_cache_rows(context, torch.nonzero(~stop).flatten().to(device))
            start, end = end, end + 1
    return Generation(tokens, prompt_lengths, prompt_lengths + new, logprobs, finished)
