"""Each step's samples for on-policy distillation: prompts, the student's responses, exchanged.

Step ``s`` covers global-batch positions ``0 .. G-1``; position ``g`` takes prompt
``order[(s * G + g) mod P]`` (one seeded permutation of the P prompts per epoch). A step is
on-policy with probability ``--gkd-lambda`` (one seeded draw per step, the same on every rank);
otherwise its responses are the prompts' reference answers. On an on-policy step every student
replica samples the responses of its own positions (its model in its training layout, the
generator seeded by (seed, step, replica), so a resumed run draws the same tokens), and one rank
of each replica shares them with the world; each rank then builds the samples it needs (its
student replica's and its teachers' positions) with :class:`~.samples.SampleBuilder`.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import torch
import torch.distributed as dist

from megatron_xdistill.generation import generate
from megatron_xdistill.onpolicy.arguments import RolloutConfig
from megatron_xdistill.onpolicy.prompts import PromptRecord, response_ids
from megatron_xdistill.onpolicy.rewards import call_reward, load_reward_fn, reward_weights
from megatron_xdistill.onpolicy.samples import Rollout, SampleBuilder
from megatron_xdistill.storage.atomic import write_text_atomic


def _seed(*parts: int) -> int:
    """A 63-bit seed from integers (numpy's SeedSequence mixes them)."""
    return int(np.random.SeedSequence([int(p) & 0xFFFFFFFF for p in parts]).generate_state(
        2, dtype=np.uint32).view(np.uint64)[0] >> 1)


def is_on_policy_step(seed: int, gkd_lambda: float, step: int) -> bool:
    """Whether ``step`` trains on the student's own responses (probability ``gkd_lambda``, one
    seeded draw per step: the same on every rank and after a resume)."""
    if gkd_lambda >= 1.0 or gkd_lambda <= 0.0:
        return gkd_lambda >= 1.0
    return bool(np.random.default_rng(_seed(seed, step, 29)).random() < gkd_lambda)


class RolloutSteps:
    """Iterator of ``{position in the global batch: sample dict}`` per step (like
    :class:`~megatron_xdistill.data.loader.StepBatches`), rolling out on-policy steps with the
    student. ``positions``: the global-batch positions this rank needs."""

    def __init__(self, config: RolloutConfig, records: Sequence[PromptRecord],
                 builder: SampleBuilder, student, positions: Sequence[int], start_step: int,
                 log=print) -> None:
        self.config, self.records, self.builder, self.student = config, records, builder, student
        self.positions = list(positions)
        self.step = start_step
        self.log = log
        tokenizer = builder.tokenizers.student_tokenizer
        self.eos = int(tokenizer.eos_token_id)
        self._prompts: dict[int, tuple[int, ...]] = {}
        self._answers: dict[int, list[int]] = {}
        self._order: tuple[int, np.ndarray] | None = None  # (epoch, its prompt permutation)
        self.reward_fn = (load_reward_fn(config.reward_fn, config.reward_timeout)
                          if config.reward_fn else None)
        self.metrics: dict[str, float] = {}
        self.file = config.generations_file if dist.get_rank() == 0 else None
        if self.file is not None:
            _keep_until(self.file, start_step)

    # ------------------------------------------------------------------ what a step holds
    def prompt_of(self, step: int, position: int) -> int:
        """The prompt record at ``position`` of ``step``."""
        n = len(self.records)
        flat = step * self.config.global_batch_size + position
        epoch = flat // n
        if self._order is None or self._order[0] != epoch:  # one permutation per epoch
            self._order = (epoch, np.random.default_rng(_seed(self.config.seed, epoch, 17))
                           .permutation(n))
        return int(self._order[1][flat % n])

    def on_policy(self, step: int) -> bool:
        return is_on_policy_step(self.config.seed, self.config.gkd_lambda, step)

    def student_prompt(self, index: int) -> tuple[int, ...]:
        """The student's prompt ids of a record, keeping the last --max-prompt-length."""
        if index not in self._prompts:
            ids = self.builder.student_prompt(self.records[index])
            limit = self.config.max_prompt_length
            if len(ids) > limit:
                self.log(f"> prompt {self.records[index].where}: {len(ids)} tokens, keeping "
                         f"the last {limit} (--max-prompt-length)")
                ids = ids[-limit:]
            self._prompts[index] = tuple(ids)
        return self._prompts[index]

    def reference(self, step: int, position: int) -> Rollout:
        """The reference answer at a position (an off-policy step)."""
        index = self.prompt_of(step, position)
        if index not in self._answers:
            tokenizer = self.builder.tokenizers.student_tokenizer
            self._answers[index] = response_ids(tokenizer, self.records[index].answer, self.eos)
        ids = self._answers[index]
        cap = self.config.sampling.max_new_tokens
        finished = len(ids) <= cap
        return Rollout(index, self.student_prompt(index), tuple(ids[:cap]),
                       finished, on_policy=False)

    # ------------------------------------------------------------------ one step
    def _generate(self, step: int) -> dict[int, Rollout]:
        """This replica's responses (every rank of the replica computes the same ones)."""
        side = self.student
        mine = side.positions()
        indices = [self.prompt_of(step, g) for g in mine]
        prompts = [list(self.student_prompt(i)) for i in indices]
        generator = torch.Generator(device=side.device).manual_seed(
            _seed(self.config.seed, step, side.groups.coords["dp"], 41))
        out = generate(side.model, side.groups, prompts, self.config.sampling,
                       eos_token_ids=[self.eos], vocab_size=side.info.vocab_size,
                       device=side.device, generator=generator)
        rollouts = {g: Rollout(i, tuple(p), tuple(out.response(k)), bool(out.finished[k]))
                    for k, (g, i, p) in enumerate(zip(mine, indices, prompts))}
        if self.reward_fn is not None and self._shares():  # scored once per replica
            rollouts = {g: replace(r, reward=call_reward(
                self.reward_fn, self.records[r.prompt], self.builder.response_text(r.response)))
                for g, r in rollouts.items()}
        return rollouts

    def _shares(self) -> bool:
        """Whether this rank speaks for its student replica (TP, PP and CP rank 0)."""
        coords = self.student.groups.coords if self.student is not None else None
        return coords is not None and coords["tp"] == coords["pp"] == coords["cp"] == 0

    def _exchange(self, mine: dict[int, Rollout]) -> dict[int, Rollout]:
        """Every replica's rollouts on every rank (one rank per replica contributes)."""
        share = mine if self._shares() else {}
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, share)
        out: dict[int, Rollout] = {}
        for part in gathered:
            out.update(part)
        return out

    def __next__(self) -> dict[int, dict]:
        step = self.step
        self.step += 1
        gbs = self.config.global_batch_size
        t0 = time.perf_counter()
        if self.on_policy(step):
            mine = self._generate(step) if self.student is not None else {}
            generate_s = time.perf_counter() - t0
            rollouts = self._exchange(mine)
            new_tokens = sum(len(r.response) for r in mine.values())
            self.metrics = {"on_policy": 1.0, "time_generate": round(generate_s, 3),
                            "generate_tokens_per_s": round(new_tokens / max(generate_s, 1e-9), 1)}
        else:
            rollouts = {g: self.reference(step, g) for g in range(gbs)}
            self.metrics = {"on_policy": 0.0}
        if len(rollouts) != gbs:
            raise RuntimeError(f"step {step + 1}: rollouts of {len(rollouts)} of {gbs} "
                               f"positions arrived (rank {dist.get_rank()})")
        self.metrics.update(
            tokens=sum(len(r.response) for r in rollouts.values()),  # what the step trains on
            response_tokens=float(np.mean([len(r.response) for r in rollouts.values()])),
            finished_fraction=float(np.mean([r.finished for r in rollouts.values()])))
        weights = {}
        rewards = [rollouts[g].reward for g in range(gbs)]
        if all(r is not None for r in rewards):
            self.metrics.update(reward=float(np.mean(rewards)))
            if self.config.reward_beta:
                w = reward_weights(rewards, self.config.reward_beta)
                weights = dict(enumerate(w.tolist()))
                self.metrics.update(reward_weight_max=float(w.max()))
        if self.file is not None:
            self._write(step, rollouts)
        samples = {g: self.builder.build(step * gbs + g, rollouts[g], weights.get(g))
                   for g in self.positions}
        self.metrics["truncated_teacher_chunks"] = float(self.builder.truncated_chunks)
        return samples

    def __iter__(self) -> RolloutSteps:
        return self

    def _write(self, step: int, rollouts: dict[int, Rollout]) -> None:
        with open(self.file, "a", encoding="utf-8") as fh:
            for g in sorted(rollouts):
                r = rollouts[g]
                fh.write(json.dumps({
                    "iteration": step + 1, "position": g, "prompt": r.prompt,
                    "on_policy": r.on_policy, "finished": r.finished, "reward": r.reward,
                    "response_ids": list(r.response),
                    "response": self.builder.response_text(r.response)}) + "\n")


def _keep_until(path: str, step: int) -> None:
    """Drop a generations file's records after ``step`` (a resumed run writes them again)."""
    if not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as fh:
        kept = [line for line in fh if line.strip() and json.loads(line)["iteration"] <= step]
    write_text_atomic(path, "".join(kept))
