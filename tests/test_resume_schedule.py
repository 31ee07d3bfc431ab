"""A resumed run's learning-rate schedule (training.resume_schedule) and the sample-counted
schedule of Megatron-LM (training.lr_schedule), against closed forms."""

from __future__ import annotations

import argparse
import math

import pytest

from megatron_xdistill.training.arguments.checks import parse_args
from megatron_xdistill.training.lr_schedule import LRSchedule
from megatron_xdistill.training.resume_schedule import (
    SCHEDULE_KEY,
    resolve_schedule,
    saved_schedule,
    schedule_differences,
    scheduler_state,
)


@pytest.fixture
def base(base):
    """The shared command line (conftest) with its length left to each test, at --lr 1."""
    at = base.index("--train-iters")
    argv = base[:at] + base[at + 2:]
    argv[argv.index("--lr") + 1] = "1.0"
    return argv


def _cosine(samples: float, warmup: float, decay: float, lr=1.0, min_lr=0.0) -> float:
    if samples <= warmup:
        return lr * samples / warmup
    ratio = min((samples - warmup) / (decay - warmup), 1.0)
    return min_lr + (lr - min_lr) * 0.5 * (math.cos(math.pi * ratio) + 1)


def test_train_samples_counts_the_schedule_in_samples_as_megatron_lm(base):
    """--train-samples 44 at a global batch of 8: 5 iterations, the cosine decay over 40 of its
    samples after a 12-sample warmup, stepped by 8 samples an iteration (lengths that are no
    multiple of the batch, where a schedule in iterations would differ)."""
    args = parse_args([*base, "--train-samples", "44", "--lr-decay-samples", "40",
                       "--lr-warmup-samples", "12"], 4)
    assert args.train_iters == 5
    schedule = LRSchedule.from_args(args)
    assert (schedule.decay_steps, schedule.warmup_steps, schedule.step_size) == (40, 12, 8)
    for iteration in range(1, 6):
        consumed = (iteration - 1) * 8  # what the iteration trains at
        assert schedule.lr_at(consumed) == pytest.approx(_cosine(consumed, 12, 40), abs=1e-12)


def test_an_iteration_schedule_is_its_lengths_times_the_global_batch(base):
    args = parse_args([*base, "--train-iters", "10", "--lr-warmup-fraction", "0.25"], 4)
    schedule = LRSchedule.from_args(args)
    assert (schedule.decay_steps, schedule.warmup_steps, schedule.wd_incr_steps) == (80, 20, 80)
    for iteration in range(1, 11):
        assert schedule.lr_at((iteration - 1) * 8) == pytest.approx(
            _cosine(iteration - 1, 2.5, 10), abs=1e-12)


@pytest.mark.parametrize("extra, message", [
    (["--train-iters", "4", "--train-samples", "32"], "--train-iters N .* or --train-samples"),
    ([], "--train-iters N .* or --train-samples"),
    (["--train-iters", "4", "--lr-decay-samples", "8"],
     "--lr-decay-samples count samples and need --train-samples"),
    (["--train-samples", "64", "--lr-warmup-iters", "2"],
     "give --lr-decay-samples / --lr-warmup-samples / --lr-wsd-decay-samples instead of "
     "--lr-warmup-iters"),
    (["--train-samples", "4"], "less than one global batch"),
    (["--train-iters", "4", "--override-opt_param-scheduler",
      "--use-checkpoint-opt_param-scheduler"], "give one of them"),
])
def test_schedule_flags_that_do_not_go_together_are_named(base, extra, message):
    with pytest.raises(ValueError, match=message):
        parse_args([*base, *extra], 4)


def _schedule(**changes) -> LRSchedule:
    values = dict(init_lr=0.0, max_lr=1e-3, min_lr=0.0, warmup_steps=0, decay_steps=32,
                  decay_style="cosine", weight_decay=0.01, wd_incr_steps=32,
                  wsd_decay_steps=None, wsd_decay_style="exponential", step_size=8)
    return LRSchedule(**{**values, **changes})


def _common(schedule: LRSchedule, iteration: int) -> dict:
    megatron = {"max_lr": schedule.max_lr, "min_lr": schedule.min_lr,
                "lr_warmup_steps": schedule.warmup_steps, "lr_decay_steps": schedule.decay_steps,
                "lr_decay_style": schedule.decay_style, "num_steps": iteration * 8,
                "start_wd": 0.01, "end_wd": 0.01, "wd_incr_steps": 32,
                "wd_incr_style": "constant"}
    return {"iteration": iteration, "opt_param_scheduler": megatron,
            "common": {"consumed_samples": iteration * 8, SCHEDULE_KEY: schedule.to_dict()}}


def test_only_fields_that_shape_the_rate_count_as_differences():
    now = _schedule()
    assert schedule_differences(now, _schedule(wd_incr_steps=99, init_lr=0.5)) == []
    assert schedule_differences(now, _schedule(wsd_decay_steps=8)) == []  # not WSD
    lines = schedule_differences(now, _schedule(decay_steps=48, min_lr=1e-5))
    assert [line.split(":")[0].strip() for line in lines] == ["min_lr", "decay_steps"]
    assert "checkpoint 32 samples (4 iterations), arguments 48 samples (6 iterations)" in lines[1]


def test_the_chosen_schedule_and_what_the_log_says():
    saved = saved_schedule(_common(_schedule(), 4), _schedule())
    longer = _schedule(decay_steps=48)
    flags = argparse.Namespace(train_iters=6, override_opt_param_scheduler=False,
                               use_checkpoint_opt_param_scheduler=False)
    assert resolve_schedule(flags, _schedule(), saved, "--load r") == (_schedule(), [])
    with pytest.raises(ValueError, match=r"lr 0.00025 at iteration 5\), "
                                         r"--use-checkpoint-opt_param-scheduler keeps .* \(lr 0 "
                                         r"at iteration 5; iterations 5-6 would be past"):
        resolve_schedule(flags, longer, saved, "--load r")
    flags.override_opt_param_scheduler = True
    chosen, lines = resolve_schedule(flags, longer, saved, "--load r")
    assert chosen == longer and "following these arguments'" in lines[0]
    flags.override_opt_param_scheduler, flags.use_checkpoint_opt_param_scheduler = False, True
    chosen, lines = resolve_schedule(flags, longer, saved, "--load r")
    assert chosen == _schedule() and "iterations 5-6 are past" in lines[-1]


def test_a_checkpoint_that_counted_iterations_is_read_in_samples():
    """This trainer's checkpoints from before the schedule counted samples hold Megatron's
    fields in iterations and no full schedule: they read as the same schedule in samples."""
    old = _common(_schedule(), 4)
    del old["common"][SCHEDULE_KEY]
    old["opt_param_scheduler"].update(num_steps=4, lr_decay_steps=4)
    saved = saved_schedule(old, _schedule())
    assert (saved.num_steps, saved.schedule.decay_steps, saved.complete) == (32, 32, False)
    assert scheduler_state(old)["num_steps"] == 32
    assert scheduler_state(_common(_schedule(), 4))["num_steps"] == 32  # samples already
