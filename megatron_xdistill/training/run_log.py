"""The run's console log in Megatron-LM's manner: the arguments once at start, an iteration line
with Megatron-LM's fields (``lm loss``, ``elapsed time per iteration (ms)``, throughput, an ETA),
and dependency warnings that every run and rank would repeat filtered where they are understood.

The metrics file (``--metrics-file``) keeps every value under this project's keys; the console
line shows what a Megatron-LM user reads first.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import time
import warnings
from collections.abc import Mapping

#: Warnings of Megatron-Core and torch that every run and every rank would print and that say
#: nothing the user can act on here (message prefixes, as ``warnings.filterwarnings`` matches).
UNDERSTOOD_WARNINGS = (
    # Our own single-process reads of a checkpoint's common state.
    "torch.distributed is disabled, unavailable or uninitialized",
    # dist_checkpointing's call into torch's loader.
    "The argument order of load has been changed",
    # Import-time notes of Megatron-Core modules this project does not use.
    "MimoModelConfig is experimental",
    "absl.logging is not installed",
    # Without TransformerEngine / Apex Megatron-Core's torch fallbacks run (said once, below).
    "Transformer Engine and Apex are not installed",
    # CPU ranks: torch's fused RMSNorm is skipped for a 16-bit input (the result is the same).
    "Mismatch dtype between input and weight",
)

#: Megatron-Core log records shown once per process (they repeat per model built).
ONCE_LOG_RECORDS = (
    "GPTModel IS DEPRECATED",  # every model built; the move to HybridModel is tracked
)
#: Megatron-Core log records dropped: its default checkpoint strategy's name, logged by every
#: rank on every save, synchronous ones included (this project's saves are synchronous).
DROPPED_LOG_RECORDS = (
    "MCore's async save is deprecated",
)


class _Once(logging.Filter):
    """Lets the first record that starts with each of ``once`` through and drops repeats;
    drops every record that starts with one of ``dropped``."""

    def __init__(self, once: tuple[str, ...], dropped: tuple[str, ...]) -> None:
        super().__init__()
        self.once, self.dropped = once, dropped
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith(self.dropped):
            return False
        for prefix in self.once:
            if message.startswith(prefix):
                if prefix in self.seen:
                    return False
                self.seen.add(prefix)
        return True


_ONCE = _Once(ONCE_LOG_RECORDS, DROPPED_LOG_RECORDS)


def quiet_known_warnings() -> None:
    """Filter :data:`UNDERSTOOD_WARNINGS` and :data:`DROPPED_LOG_RECORDS`, show
    :data:`ONCE_LOG_RECORDS` once per process (call before Megatron-Core is imported: some are
    import-time warnings)."""
    for prefix in UNDERSTOOD_WARNINGS:
        warnings.filterwarnings("ignore", message=prefix)
    # and on the module loggers that emit them, which no handler added later (a library's
    # logging.basicConfig after this call) can bypass
    for name in ("megatron", "megatron.core", "megatron.core.models.gpt.gpt_model"):
        logger = logging.getLogger(name)
        if _ONCE not in logger.filters:
            logger.addFilter(_ONCE)
    # Megatron-Core logs through its module loggers; a filter on a parent logger does not see
    # records propagated from children, so the handlers that print them get it: the root's,
    # and Python's last resort, which prints warnings when nothing is configured.
    for handler in [*logging.getLogger().handlers, logging.lastResort]:
        if handler is not None and _ONCE not in handler.filters:
            handler.addFilter(_ONCE)


def arguments_block(args: argparse.Namespace) -> str:
    """The arguments as Megatron-LM prints them at start: one sorted ``name ..... value`` line
    each between two rules."""
    lines = ["------------------------ arguments ------------------------"]
    for name in sorted(vars(args)):
        value = getattr(args, name)
        if name == "teachers":
            value = [spec.name for spec in value]
        elif name == "lr_schedule" and value is not None:
            value = "(from the flags below)" if not hasattr(value, "to_dict") else \
                f"decay {value.decay_style} over {value.decay_steps} samples"
        dots = "." * max(48 - len(name), 2)
        lines.append(f"  {name} {dots} {value}")
    lines.append("-------------------- end of arguments ---------------------")
    return "\n".join(lines)


def forward_flops_per_token(info, seq_length: int) -> float:
    """Model FLOPs of one token's forward pass (2 per multiply-add): the layers' matrix products
    (Q, K / V at their query groups, the output projection, a gated or plain MLP), the attention
    scores and values over ``seq_length`` positions (counted whole, as Megatron-LM counts them)
    and the output layer."""
    h, d = info.hidden_size, info.kv_channels
    q, kv = info.num_attention_heads * d, info.num_query_groups * d
    mlp = (3 if info.activation in ("silu", "gelu_tanh") else 2) * h * info.ffn_hidden_size
    per_layer = 2 * (h * q + 2 * h * kv + q * h + mlp) + 2 * 2 * seq_length * q
    return info.num_layers * per_layer + 2 * h * info.vocab_size


class IterationLog:
    """Builds each logged iteration's console line and its throughput and ETA figures."""

    def __init__(self, args: argparse.Namespace, start_iteration: int, world_size: int,
                 student_info=None, teacher_infos=()) -> None:
        """``student_info`` / ``teacher_infos``: ModelInfo of the models (for TFLOP/s with
        ``--log-throughput``; None: unknown)."""
        self.args = args
        self.start_iteration = start_iteration
        self.started = time.perf_counter()
        self.world_size = world_size
        self.flops_per_step = None
        if getattr(args, "log_throughput", False) and student_info is not None:
            gbs = args.global_batch_size
            flops = 3 * forward_flops_per_token(student_info, args.seq_length) * \
                gbs * args.seq_length  # forward and backward (twice the forward)
            for info, spec in zip(teacher_infos, args.teachers, strict=False):
                if info is not None and spec.seq_length:
                    flops += forward_flops_per_token(info, spec.seq_length) * gbs * spec.seq_length
            self.flops_per_step = flops

    def figures(self, record: Mapping, iteration: int) -> dict:
        """``tflops_per_gpu`` (with --log-throughput) and ``eta_s`` for a record."""
        out = {}
        ms = record.get("elapsed_ms_per_iteration")
        if self.flops_per_step is not None and ms:
            out["tflops_per_gpu"] = round(self.flops_per_step / (ms * 1e-3) / self.world_size
                                          / 1e12, 4)
        done = iteration - self.start_iteration
        if done > 0:
            per = (time.perf_counter() - self.started) / done
            out["eta_s"] = round(per * (self.args.train_iters - iteration), 1)
        return out

    def line(self, record: Mapping) -> str:
        """Megatron-LM's iteration line: its fields and names first, then distillation's."""
        stamp = time.strftime("[%Y-%m-%d %H:%M:%S]", time.localtime(record.get("time",
                                                                              time.time())))
        it, total = record["iteration"], record.get("train_iters", self.args.train_iters)
        width = len(str(total))
        parts = [f"{stamp} iteration {it:>{width}}/{total}"]

        def add(label: str, key: str, form: str) -> None:
            value = record.get(key)
            if value is not None and not (isinstance(value, float) and value != value):
                parts.append(f"{label}: {value:{form}}")

        add("consumed samples", "consumed_samples", "d")
        add("elapsed time per iteration (ms)", "elapsed_ms_per_iteration", ".1f")
        add("throughput per GPU (TFLOP/s/GPU)", "tflops_per_gpu", ".3g")
        add("tokens/s", "tokens_per_s", ".0f")
        add("learning rate", "lr", ".6E")
        parts.append(f"global batch size: {self.args.global_batch_size}")
        add("lm loss", "ce", ".6E")
        add("kd loss", "kd", ".6E")
        for key in sorted(k for k in record if k.startswith("kd/")):
            add(f"kd loss ({key[3:]})", key, ".6E")
        add("top-1 agreement", "top1_agree", ".4f")
        add("load_balancing_loss", "load_balancing_loss", ".6E")
        add("loss scale", "loss_scale", ".1f")
        add("grad norm", "grad_norm", ".3f")
        add("number of skipped iterations", "skipped", "d")
        times = [f"{key[5:]} {record[key]:.2f}" for key in
                 ("time_teacher", "time_route", "time_student", "time_loss", "time_optimizer")
                 if isinstance(record.get(key), float)]
        if times:
            parts.append("seconds: " + ", ".join(times))
        if record.get("eta_s") is not None:
            parts.append(f"ETA {datetime.timedelta(seconds=round(record['eta_s']))}")
        return " | ".join(parts)


def validation_line(record: Mapping) -> str:
    """Megatron-LM's validation line, with bits per byte."""
    import math

    ce = record.get("eval_ce")
    parts = [f"validation loss at iteration {record['iteration']}"]
    if ce is not None:
        parts += [f"lm loss value: {ce:.6E}", f"lm loss PPL: {math.exp(min(ce, 700)):.6E}"]
    if record.get("eval_bpb") is not None:
        parts.append(f"bits per byte: {record['eval_bpb']:.4f}")
    parts += [f"{key}: {value:.4f}" for key, value in record.items()
              if "/" in key and isinstance(value, float)]  # --eval-tasks' metrics
    return " | ".join(parts)


__all__ = ["DROPPED_LOG_RECORDS", "ONCE_LOG_RECORDS", "UNDERSTOOD_WARNINGS", "IterationLog", "arguments_block",
           "forward_flops_per_token", "quiet_known_warnings", "validation_line"]
