"""Reward functions and reward weights of on-policy distillation."""

from __future__ import annotations

import math

import numpy as np
import pytest

from megatron_xdistill.onpolicy.prompts import PromptRecord
from megatron_xdistill.onpolicy.rewards import (
    code_of,
    exact_match,
    last_number,
    load_reward_fn,
    reward_weights,
    unit_tests,
)

ADD = PromptRecord(0, "p.jsonl:1", text="Write add(a, b).",
                   tests="assert add(2, 3) == 5\nassert add(-1, 1) == 0")


def test_exact_match_and_last_number():
    record = PromptRecord(0, "p:1", text="2+2=", answer=" Four.")
    assert exact_match(record, "four") == 1.0 and exact_match(record, "five") == 0.0
    sums = PromptRecord(1, "p:2", text="12*12=", answer="144")
    assert last_number(sums, "12 times 12 is 144") == 1.0
    assert last_number(sums, "144, no wait, 145") == 0.0
    assert last_number(sums, "no idea") == 0.0
    assert last_number(PromptRecord(2, "p:3", text="?", answer="1,000"), "It is 1000.") == 1.0
    with pytest.raises(ValueError, match="p:4: the reward 'exact_match' needs"):
        exact_match(PromptRecord(3, "p:4", text="?"), "x")


def test_unit_tests_run_the_code_in_a_subprocess_with_a_time_limit():
    good = "Here you go:\n```python\ndef add(a, b):\n    return a + b\n```\nDone."
    assert code_of(good).strip() == "def add(a, b):\n    return a + b"
    assert unit_tests(ADD, good) == 1.0
    assert unit_tests(ADD, "def add(a, b):\n    return a - b") == 0.0
    assert unit_tests(ADD, "def add(a, b) return") == 0.0  # a syntax error
    assert unit_tests(ADD, "while True:\n    pass", timeout_s=1.0) == 0.0
    with pytest.raises(ValueError, match="needs the record's 'tests'"):
        unit_tests(PromptRecord(1, "p:2", text="x"), "pass")


def test_reward_weights_are_softmax_weights_of_mean_one():
    w = reward_weights([0.0, 1.0, 1.0, 3.0], 0.5)
    e = np.exp(0.5 * np.array([0.0, 1.0, 1.0, 3.0]))
    assert np.allclose(w, e / e.mean()) and math.isclose(w.mean(), 1.0)
    assert np.array_equal(reward_weights([5.0, -2.0], 0.0), [1.0, 1.0])
    assert np.isfinite(reward_weights([1000.0, 0.0], 5.0)).all()  # no overflow
    with pytest.raises(ValueError, match="finite"):
        reward_weights([float("nan")], 1.0)


def test_reward_functions_are_found_by_name():
    assert load_reward_fn("exact_match") is exact_match
    fn = load_reward_fn("math:hypot")
    assert fn(3, 4) == 5.0
    for spec, message in [("nope", "give a built-in"), ("math:nothing", "has no attribute"),
                          ("no_such_module_xyz:f", "No module named"), ("math:pi", "callable")]:
        with pytest.raises(ValueError, match=message):
            load_reward_fn(spec)
