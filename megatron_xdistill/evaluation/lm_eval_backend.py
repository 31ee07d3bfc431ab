"""lm-evaluation-harness backend ``xdistill``: this project's Megatron checkpoints, in any TP / PP
layout, as an ``lm_eval`` model.

    xdistill-lm-eval --model xdistill --model_args load=CKPT,tokenizer=DIR --tasks T ...
    torchrun --nproc-per-node 2 -m megatron_xdistill.evaluation.lm_eval_cli \\
        --model xdistill --model_args load=CKPT,tp=2 --tasks T ...

From Python, ``lm_eval.simple_evaluate(model=XDistillLM(load=CKPT), tasks=[...])``, or
``XDistillLM(model=ParallelModel(...), tokenizer=...)`` around a model already in memory (the
training run's student).

The requests are handled as lm-eval's own ``hf`` backend handles them (the same tokenisation,
left truncation to the model's length, rolling windows, stop strings), so the two give the same
numbers for the same weights. Every rank runs the harness in lockstep with the same requests
(lm-eval's "tensor-parallel launcher" mode: each reports rank 0 of 1, and only ``LOCAL_RANK`` 0
writes results), so every collective of the model is entered by every rank in the same order.
Model args: ``load`` (checkpoint), ``tokenizer`` (HF tokenizer folder; default: the checkpoint's
``hf_files/``), ``tp``, ``pp``, ``dtype`` (float32 / bfloat16 / float16), ``batch_size``,
``max_length``, ``max_gen_toks`` (default 256), ``add_bos_token``, ``seed`` (sampled decoding).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (
    Collator,
    handle_stop_sequences,
    normalize_gen_kwargs,
    postprocess_generated_text,
)
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from megatron_xdistill.evaluation.parallel_model import ParallelModel, load_parallel_model
from megatron_xdistill.generation import SamplingParams

log = logging.getLogger(__name__)

#: gen_kwargs keys that decoding here reads (the rest are refused by name)
_SAMPLING_KEYS = {"do_sample", "temperature", "top_p", "top_k"}


def _flag(value: Any) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    return str(value).lower() in ("1", "true", "yes")


def _dtype(name: str | torch.dtype) -> torch.dtype:
    from megatron_xdistill.models import torch_dtype

    return torch_dtype(name)


@register_model("xdistill")
class XDistillLM(TemplateLM):
    """A Megatron GPTModel of this project as an lm-eval ``LM`` (see the module docstring)."""

    backend = "causal"

    def __init__(self, load: str | None = None, tokenizer: Any = None, tp: int = 1, pp: int = 1,
                 dtype: str = "float32", batch_size: int | str = 8,
                 max_length: int | None = None, max_gen_toks: int = 256,
                 add_bos_token: bool | str | None = None, seed: int = 1234,
                 model: ParallelModel | None = None, device: str | None = None,
                 max_batch_size: int | None = None) -> None:
        """``device`` and ``max_batch_size`` come from lm-eval's command line and are not used:
        each rank runs on its own GPU (``LOCAL_RANK``) or on the CPU."""
        super().__init__()
        if (load is None) == (model is None):
            raise ValueError("xdistill: give exactly one of load=CKPT (in --model_args) and model=")
        if str(batch_size).startswith("auto"):
            raise ValueError("xdistill: --batch_size auto is not supported; give a number "
                             "(requests per forward)")
        self.batch_size_per_gpu = int(batch_size)
        if self.batch_size_per_gpu < 1:
            raise ValueError(f"xdistill: batch_size must be >= 1, got {batch_size}")
        self.model = model if model is not None else load_parallel_model(
            load, tp=int(tp), pp=int(pp), dtype=_dtype(dtype))
        self.tokenizer = self._tokenizer(tokenizer, load)
        self._max_length = int(max_length) if max_length else self.model.max_length
        self._max_gen_toks = int(max_gen_toks)
        self.add_bos_token = _flag(add_bos_token)
        self.seed = int(seed)

    @staticmethod
    def _tokenizer(tokenizer: Any, load: str | None):
        if tokenizer is not None and not isinstance(tokenizer, str):
            return tokenizer  # a tokenizer object (training)
        from megatron_xdistill.align import load_tokenizer
        from megatron_xdistill.evaluation.bits_per_byte import model_tokenizer_dir

        if tokenizer is None and load is None:
            raise ValueError("xdistill: give tokenizer=DIR with model=")
        return load_tokenizer(model_tokenizer_dir(load, None, tokenizer))

    # ------------------------------------------------------------------ what lm-eval reads
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def batch_size(self) -> int:
        return self.batch_size_per_gpu

    @property
    def tokenizer_name(self) -> str:
        return str(self.tokenizer.name_or_path).replace("/", "__")

    def _progress(self, total: int, desc: str, disable: bool) -> tqdm:
        quiet = disable or (dist.is_initialized() and dist.get_rank() != 0)
        return tqdm(total=total, desc=desc, disable=quiet)

    def tok_encode(self, string: str, add_special_tokens: bool | None = None,
                   **kwargs: Any) -> list[int]:
        """As the ``hf`` backend: the tokenizer's own special tokens unless told, none when the
        text already starts with the prefix token's text."""
        if add_special_tokens is None and self.add_bos_token is not None:
            add_special_tokens = self.add_bos_token
        if add_special_tokens is None and string.startswith(
                self.tokenizer.decode(self.prefix_token_id)):
            add_special_tokens = False
        special = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        return self.tokenizer.encode(string, **special)

    def tok_decode(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, chat_history: list[dict[str, str]],
                            add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(
            chat_history, tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=not add_generation_prompt)

    # ------------------------------------------------------------------ scoring
    def _loglikelihood_tokens(self, requests: list[tuple[Any, list[int], list[int]]],
                              disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """(log p(continuation | context), whether greedy decoding gives the continuation) per
        request; a context longer than the model's length loses its left part."""
        for _, _, continuation in requests:
            if not continuation or len(continuation) > self.max_length:
                raise ValueError(f"xdistill: a continuation of {len(continuation)} tokens "
                                 f"(1..{self.max_length} allowed)")
        collator = Collator(requests, sort_fn=lambda r: (-len(r[1] + r[2]), tuple(r[1] + r[2])))
        results = []
        bar = self._progress(len(requests), "Running loglikelihood requests", disable_tqdm)
        for chunk in collator.get_batched(n=self.batch_size):
            rows = [(ctx + cont)[-(self.max_length + 1):] for _, ctx, cont in chunk]
            logprobs, greedy = self.model.token_logprobs(rows)
            for i, ((key, _, cont), row) in enumerate(zip(chunk, rows)):
                span = slice(len(row) - 1 - len(cont), len(row) - 1)
                answer = (float(logprobs[i, span].sum()), bool(greedy[i, span].all()))
                results.append(answer)
                if key is not None:
                    self.cache_hook.add_partial("loglikelihood", key, answer)
                bar.update(1)
        bar.close()
        return collator.get_original(results)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of each whole text in windows of ``max_length`` predictions, every
        token predicted once with as much context as fits (lm-eval's rolling windows)."""
        windows: list[tuple[None, list[int], list[int]]] = []
        counts = []
        for (text,) in [request.args for request in requests]:
            parts = [make_disjoint_window(w) for w in get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1)]
            windows.extend((None, ctx, cont) for ctx, cont in parts)
            counts.append(len(parts))
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        totals, at = [], 0
        for request, count in zip(requests, counts):
            total = sum(score for score, _ in scores[at:at + count])
            at += count
            totals.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    # ------------------------------------------------------------------ generation
    def _sampling(self, kwargs: dict, max_gen_toks: int) -> SamplingParams:
        unknown = sorted(set(kwargs) - _SAMPLING_KEYS - {"max_length"})
        if unknown:
            raise ValueError(f"xdistill: generation arguments {unknown} are not supported "
                             f"(supported: until, max_gen_toks, {sorted(_SAMPLING_KEYS)})")
        temperature = float(kwargs.get("temperature") or 0.0)
        if not kwargs.get("do_sample") or temperature == 0.0:
            return SamplingParams(max_new_tokens=max_gen_toks, temperature=0.0)
        return SamplingParams(max_new_tokens=max_gen_toks, temperature=temperature,
                              top_p=float(kwargs.get("top_p") or 1.0),
                              top_k=int(kwargs.get("top_k") or 0))

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Continuations up to the first stop string (or EOS, or ``max_gen_toks`` tokens), the
        stop string cut off; greedy unless the task samples."""
        collator = Collator([request.args for request in requests],
                            sort_fn=lambda x: (-len(self.tok_encode(x[0])), x[0]),
                            group_by="gen_kwargs", group_fn=lambda x: x[1])
        eos_text = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        generator = torch.Generator(device=self.model.device).manual_seed(self.seed)
        results = []
        bar = self._progress(len(requests), "Running generate_until requests", disable_tqdm)
        for chunk in collator.get_batched(n=self.batch_size):
            contexts, all_kwargs = zip(*chunk)
            kwargs = normalize_gen_kwargs(all_kwargs[0], self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text)
            max_gen_toks = kwargs.pop("max_gen_toks")
            params = self._sampling(kwargs, max_gen_toks)
            room = self.max_length - max_gen_toks
            if room < 1:
                raise ValueError(f"xdistill: max_gen_toks {max_gen_toks} leaves no room for a "
                                 f"prompt in the model's {self.max_length} tokens")
            prompts = [self.tok_encode(c)[-room:] or [self.prefix_token_id] for c in contexts]

            def stop_when(_i: int, ids: list[int], until=until) -> bool:
                text = self.tok_decode(ids, skip_special_tokens=False)
                return any(s and s in text for s in until)

            responses = self.model.generate(prompts, params, [self.eot_token_id], stop_when,
                                            generator if not params.greedy else None)
            for context, gen_kwargs, ids in zip(contexts, all_kwargs, responses):
                text = postprocess_generated_text(self.tok_decode(ids), until, None)
                results.append(text)
                self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
                bar.update(1)
        bar.close()
        return collator.get_original(results)
