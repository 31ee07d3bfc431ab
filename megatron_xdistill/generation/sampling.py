"""Choosing the next token from a model's logits: greedy, temperature, top-k and top-p.

The filters follow the usual definitions (those of Hugging Face's ``generate``): top-k keeps the k
largest logits; top-p (nucleus) keeps the smallest set of most likely tokens whose probability
reaches ``top_p`` (always at least one). Sampling draws from the filtered softmax with a caller's
``torch.Generator``, so a seeded generator reproduces the draws exactly. All in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How responses are drawn. ``temperature`` 0 is greedy decoding (argmax; ties to the lowest
    id); ``top_k`` 0 and ``top_p`` 1 switch those filters off."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0: greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: off), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """``logits`` [b, V] with the tokens outside top-k and outside the top-p nucleus set to -inf."""
    logits = logits.float()
    if top_k > 0 and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        ordered, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass of the more likely tokens
        drop = before >= top_p
        drop[:, 0] = False
        logits = logits.scatter(-1, order, ordered.masked_fill(drop, float("-inf")))
    return logits


def sample_next(logits: torch.Tensor, params: SamplingParams,
                generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Next token per row of ``logits`` [b, V] and its log-probability under the model's own
    distribution (temperature 1, unfiltered): ``(ids [b] int64, logprobs [b] fp32)``."""
    logits = logits.float()
    if params.greedy:
        ids = torch.argmax(logits, dim=-1)
    else:
        filtered = filter_logits(logits / params.temperature, params.top_k, params.top_p)
        probs = torch.softmax(filtered, dim=-1)
        ids = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    logprobs = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, None]).squeeze(-1)
    return ids, logprobs
