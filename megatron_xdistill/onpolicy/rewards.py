"""Per-sample rewards of on-policy responses, and the weights they give the distillation term.

A reward function takes the prompt record and the response text and returns a float. Built in:
``exact_match`` (the answer, compared after trimming, case folding and collapsing whitespace),
``last_number`` (the last number in the response equals the answer's: arithmetic), and
``unit_tests`` (the response's code, or its first fenced code block, followed by the record's
``tests``, run by a fresh Python in a subprocess with a time limit: 1 if it exits 0). Any other
``module:function`` is imported. With ``--reward-beta B`` each on-policy sample's divergence
counts ``exp(B r) / mean over the global batch of exp(B r)`` times (weights of mean 1; B = 0:
rewards are only logged).
"""

from __future__ import annotations

import importlib
import math
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence

import numpy as np

from megatron_xdistill.onpolicy.prompts import PromptRecord

RewardFn = Callable[[PromptRecord, str], float]
_NUMBER = re.compile(r"-?\d+(?:[.,]\d+)*")
_FENCE = re.compile(r"```(?:[A-Za-z0-9_+-]*)\n(.*?)```", re.DOTALL)


def _normal(text: str) -> str:
    return " ".join(text.strip().casefold().split()).rstrip(".")


def _answer(record: PromptRecord, name: str) -> str:
    if record.answer is None:
        raise ValueError(f"{record.where}: the reward {name!r} needs the record's reference "
                         f"answer")
    return record.answer


def exact_match(record: PromptRecord, response: str) -> float:
    """1 when the response is the reference answer (trimmed, case-folded, whitespace
    collapsed, a final period ignored), else 0."""
    return float(_normal(response) == _normal(_answer(record, "exact_match")))


def last_number(record: PromptRecord, response: str) -> float:
    """1 when the last number in the response equals the last number in the answer."""
    want = _NUMBER.findall(_answer(record, "last_number"))
    got = _NUMBER.findall(response)
    if not want or not got:
        return 0.0
    def value(text: str) -> float:
        return float(text.replace(",", ""))
    return float(value(got[-1]) == value(want[-1]))


def code_of(response: str) -> str:
    """The response's first fenced code block, else the response itself."""
    match = _FENCE.search(response)
    return match.group(1) if match else response


def unit_tests(record: PromptRecord, response: str, timeout_s: float = 10.0) -> float:
    """1 when the response's code followed by the record's ``tests`` runs to exit code 0 in a
    fresh Python within ``timeout_s`` seconds (a temporary working directory; no other
    isolation: run untrusted code only where that is acceptable), else 0."""
    if record.tests is None:
        raise ValueError(f"{record.where}: the reward 'unit_tests' needs the record's 'tests'")
    with tempfile.TemporaryDirectory(prefix="xdistill-reward-") as tmp:
        path = os.path.join(tmp, "candidate.py")
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(code_of(response) + "\n\n" + record.tests + "\n")
        try:
            done = subprocess.run([sys.executable, "-I", path], cwd=tmp, timeout=timeout_s,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return 0.0
    return float(done.returncode == 0)


BUILT_IN: dict[str, RewardFn] = {"exact_match": exact_match, "last_number": last_number,
                                 "unit_tests": unit_tests}


def load_reward_fn(spec: str, timeout_s: float = 10.0) -> RewardFn:
    """A built-in reward by name, or ``package.module:function``."""
    if spec == "unit_tests":
        return lambda record, response: unit_tests(record, response, timeout_s)
    if spec in BUILT_IN:
        return BUILT_IN[spec]
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"--reward-fn {spec!r}: give a built-in ({', '.join(BUILT_IN)}) or "
                         f"'package.module:function'")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"--reward-fn {spec!r}: {exc}") from None
    if not callable(fn):
        raise ValueError(f"--reward-fn {spec!r} is not callable")
    return fn


def reward_weights(rewards: Sequence[float], beta: float) -> np.ndarray:
    """``exp(beta * r)`` normalised to mean 1 (computed stably; beta 0: ones)."""
    r = np.asarray(rewards, dtype=np.float64)
    if not np.isfinite(r).all():
        raise ValueError(f"rewards must be finite numbers, got {r.tolist()}")
    if beta == 0.0 or r.size == 0:
        return np.ones_like(r)
    z = beta * r
    w = np.exp(z - z.max())
    return w / w.mean()


def call_reward(fn: RewardFn, record: PromptRecord, response: str) -> float:
    """``fn``'s reward as a float; a reward function that fails names the prompt."""
    try:
        value = float(fn(record, response))
    except Exception as exc:  # noqa: BLE001 - a user's function: say which prompt broke it
        raise RuntimeError(f"reward function failed on {record.where}: {exc}") from exc
    if not math.isfinite(value):
        raise ValueError(f"reward function gave {value} on {record.where}: rewards must be "
                         f"finite")
    return value
