"""The on-policy flags of ``pretrain_xdistill.py``, their checks, and the typed configuration
the stage reads (:class:`RolloutConfig`: the one place that reads those flags)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the generation stage imports Megatron's inference code: not for --help
    from megatron_xdistill.generation import SamplingParams


@dataclass(frozen=True)
class RolloutConfig:
    """What the per-step rollout needs from a run's arguments (checked ones)."""

    global_batch_size: int
    seed: int
    gkd_lambda: float  # share of on-policy steps
    sampling: SamplingParams
    max_prompt_length: int  # student tokens; longer prompts keep their last ones
    reward_fn: str | None
    reward_timeout: float
    reward_beta: float
    generations_file: str | None  # rank 0 writes every rollout there

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RolloutConfig:
        from megatron_xdistill.generation import SamplingParams

        return cls(
            global_batch_size=args.global_batch_size, seed=args.seed,
            gkd_lambda=args.gkd_lambda,
            sampling=SamplingParams(max_new_tokens=args.max_new_tokens,
                                    temperature=args.sampling_temperature,
                                    top_p=args.sampling_top_p, top_k=args.sampling_top_k),
            max_prompt_length=args.max_prompt_length, reward_fn=args.reward_fn,
            reward_timeout=args.reward_timeout, reward_beta=args.reward_beta,
            generations_file=args.generations_file)


def add_onpolicy_arguments(parser: argparse.ArgumentParser) -> None:
    """``--on-policy`` and the sampling / GKD flags, as one argument group."""
    g = parser.add_argument_group("on-policy distillation (the student writes, the teacher grades)")
    g.add_argument("--on-policy", action="store_true",
                   help="train on the student's own responses to prompts: --data-path names "
                   "prompt files (.jsonl / .parquet records with 'prompt' or 'messages', "
                   "optionally 'answer'); the student samples a response per prompt with its "
                   "Megatron model in its training layout, every teacher scores the text, the "
                   "loss covers the response only (use --gkd-beta for the divergence)")
    g.add_argument("--max-new-tokens", type=int, default=128,
                   help="response length cap (a response also ends on the student's EOS)")
    g.add_argument("--sampling-temperature", type=float, default=1.0,
                   help="0 = greedy decoding")
    g.add_argument("--sampling-top-p", type=float, default=1.0, help="nucleus sampling (1: off)")
    g.add_argument("--sampling-top-k", type=int, default=0, help="top-k sampling (0: off)")
    g.add_argument("--gkd-lambda", type=float, default=1.0,
                   help="GKD's lambda: the share of steps trained on the student's own "
                   "responses; the other steps train on the prompts' reference answers "
                   "(their 'answer' field; CE and divergence on the answer)")
    g.add_argument("--max-prompt-length", type=int, default=None,
                   help="prompts longer than this (student tokens) keep their last tokens "
                   "(default: --seq-length + 1 - --max-new-tokens)")
    g.add_argument("--no-chat-template", action="store_true",
                   help="feed prompts as plain text even to tokenizers with a chat template")
    g.add_argument("--prompt-field", default="prompt", help="record field of a text prompt")
    g.add_argument("--messages-field", default="messages", help="record field of a chat prompt")
    g.add_argument("--answer-field", default="answer", help="record field of the reference answer")
    g.add_argument("--reward-fn", default=None, metavar="NAME",
                   help="score each on-policy response: exact_match or last_number (against "
                   "the record's 'answer'), unit_tests (the response's code then the record's "
                   "'tests' in a subprocess: 1 if it exits 0), or package.module:function "
                   "taking (record, response text); logged as 'reward'")
    g.add_argument("--reward-beta", type=float, default=0.0,
                   help="reward-weighted distillation: each on-policy sample's divergence "
                   "counts exp(beta * reward) / (its mean over the global batch) times; 0: "
                   "rewards are only logged")
    g.add_argument("--reward-timeout", type=float, default=10.0,
                   help="seconds a unit_tests reward may run")
    g.add_argument("--tests-field", default="tests", help="record field of the unit tests")
    g.add_argument("--generations-file", default=None, metavar="PATH",
                   help="JSON Lines of every rollout (step, position, prompt, response ids and "
                   "text, finished), written by rank 0")


def check_onpolicy_args(args: argparse.Namespace, check) -> None:
    """``check(condition, message)`` on the on-policy flags against the rest of the run."""
    if not args.on_policy:
        given = [flag for flag, value in (("--reward-fn", args.reward_fn),
                                          ("--generations-file", args.generations_file))
                 if value is not None]
        check(not given, f"{', '.join(given)} apply to --on-policy runs only")
        return
    check(args.max_new_tokens >= 1, f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    check(args.sampling_temperature >= 0, "--sampling-temperature must be >= 0 (0: greedy)")
    check(0.0 < args.sampling_top_p <= 1.0, "--sampling-top-p must be in (0, 1]")
    check(args.sampling_top_k >= 0, "--sampling-top-k must be >= 0 (0: off)")
    check(0.0 <= args.gkd_lambda <= 1.0, f"--gkd-lambda {args.gkd_lambda} must be in [0, 1]")
    room = args.seq_length + 1 - args.max_new_tokens
    check(room >= 1, f"--seq-length {args.seq_length} leaves no room for a prompt before "
          f"--max-new-tokens {args.max_new_tokens}: raise --seq-length or lower "
          f"--max-new-tokens")
    if args.max_prompt_length is None:
        args.max_prompt_length = room
    check(1 <= args.max_prompt_length <= room,
          f"--max-prompt-length {args.max_prompt_length} must be in [1, --seq-length + 1 - "
          f"--max-new-tokens = {room}]")
    check(len(args.data_path) == 1 and args.data_path[0].endswith(
        (".jsonl", ".json", ".ndjson", ".parquet")),
          "--on-policy reads prompts from one .jsonl or .parquet file in --data-path")
    check(args.split is None, "--on-policy: --split does not apply (prompts are not split)")
    check(args.teacher_cache is None and not args.teacher_cache_only
          and all(spec.cache is None for spec in args.teachers),
          "--on-policy: a teacher payload cache cannot serve responses that change every run")
    check(args.kd_weight > 0, "--on-policy needs a teacher: --kd-weight must be > 0")
    check(not args.overlap_param_gather,
          "--on-policy does not work with --overlap-param-gather (generation reads the "
          "parameters outside the training forward)")
    check(args.reward_beta == 0.0 or args.reward_fn is not None,
          "--reward-beta needs --reward-fn (the rewards it weights by)")
    check(args.reward_timeout > 0, "--reward-timeout must be > 0")
    if args.reward_fn is not None:
        from megatron_xdistill.onpolicy.rewards import load_reward_fn

        try:
            load_reward_fn(args.reward_fn)
        except ValueError as exc:
            check(False, str(exc))
    for spec in args.teachers:
        check(spec.seq_length is not None,
              f"--on-policy: give the teacher {spec.name!r} its sequence length "
              f"(--teacher-seq-length, or 'seq_length' in --teachers-config): it must hold the "
              f"teacher's prompt and response tokens")
