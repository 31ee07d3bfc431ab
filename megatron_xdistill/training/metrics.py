"""Progress lines, a JSON Lines metrics file and (optionally) TensorBoard, written by rank 0.

The metrics file is strict JSON (a value that is not a finite number, such as the KD term of a
CE-only run, is ``null``); TensorBoard and Weights & Biases get each value under our name and,
where Megatron-LM has one, under Megatron-LM's tag too (``lm loss``, ``learning-rate``,
``grad-norm``, ...), so existing dashboards find them.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping

#: our record key -> (Megatron-LM's TensorBoard tag, factor to its unit)
MEGATRON_TAGS = {
    "ce": ("lm loss", 1.0),
    "eval_ce": ("lm loss validation", 1.0),
    "lr": ("learning-rate", 1.0),
    "grad_norm": ("grad-norm", 1.0),
    "elapsed_ms_per_iteration": ("iteration-time", 1e-3),
}


#: the lines that refuse a metrics destination without its package (an optional extra each)
TENSORBOARD_MISSING = ("--tensorboard-dir needs the tensorboard package: pip install "
                       "'megatron-xdistill[tensorboard]' (or pip install tensorboard)")
WANDB_MISSING = ("--wandb-project needs the wandb package: pip install 'megatron-xdistill[wandb]' "
                 "(or pip install wandb)")


def _summary_writer():
    """TensorBoard's ``SummaryWriter`` class, or None without the tensorboard package."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # torch.utils.tensorboard imports tensorboard: an optional extra
        return None
    return SummaryWriter


def missing_writer_package(tensorboard_dir: str | None, wandb_project: str | None) -> str | None:
    """The line refusing a metrics destination asked for whose package is not installed (None
    when every one asked for can be written), so a run can refuse it before it starts rather
    than when its first metrics are written."""
    if tensorboard_dir and _summary_writer() is None:
        return TENSORBOARD_MISSING
    if wandb_project:
        try:
            import wandb  # noqa: F401 - only whether it imports
        except ImportError:
            return WANDB_MISSING
    return None


def json_safe(record: Mapping) -> dict:
    """The record with every non-finite float as None (strict JSON: null, never NaN)."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in record.items()}


def tensorboard_scalars(record: Mapping) -> dict[str, float]:
    """TensorBoard tag -> value of a record: our names, plus Megatron-LM's where it has one."""
    out = {}
    for key, value in record.items():
        if key in ("iteration", "time") or isinstance(value, bool):
            continue
        if isinstance(value, (int, float)) and math.isfinite(value):
            out[key] = value
            if key in MEGATRON_TAGS:
                tag, factor = MEGATRON_TAGS[key]
                out[tag] = value * factor
    return out


class MetricsWriter:
    """Writes one record per logged step to stdout, ``--metrics-file`` and TensorBoard."""

    def __init__(self, metrics_file: str | None, tensorboard_dir: str | None,
                 enabled: bool, wandb: Mapping | None = None) -> None:
        """``wandb``: ``wandb.init`` keywords (project, name, dir, entity, config) or None."""
        self.enabled = enabled
        self._file = None
        self._tb = None
        self._wandb = None
        if not enabled:
            return
        summary_writer = _summary_writer() if tensorboard_dir else None
        if tensorboard_dir and summary_writer is None:  # before a file or a wandb run is opened
            raise RuntimeError(TENSORBOARD_MISSING)
        if wandb is not None:
            try:
                import wandb as wandb_module
            except ImportError as exc:  # an optional extra
                raise RuntimeError(WANDB_MISSING) from exc
            if wandb.get("dir"):
                os.makedirs(wandb["dir"], exist_ok=True)
            self._wandb = wandb_module.init(**{k: v for k, v in wandb.items() if v is not None})
        if metrics_file:
            os.makedirs(os.path.dirname(os.path.abspath(metrics_file)), exist_ok=True)
            self._file = open(metrics_file, "a", buffering=1)
        if summary_writer is not None:
            self._tb = summary_writer(log_dir=tensorboard_dir)

    def write(self, record: Mapping[str, float | int | str], line: str | None = None) -> None:
        """Log one record; ``line`` is the human progress line (default: built from record)."""
        if not self.enabled:
            return
        record = {"time": round(time.time(), 3), **record}
        print(line if line is not None else format_line(record), flush=True)
        if self._file is not None:
            self._file.write(json.dumps(json_safe(record), allow_nan=False) + "\n")
        if self._tb is not None or self._wandb is not None:
            step = int(record.get("iteration", 0))
            scalars = tensorboard_scalars(record)
            if self._tb is not None:
                for tag, value in scalars.items():
                    self._tb.add_scalar(tag, value, step)
                self._tb.flush()
            if self._wandb is not None:
                self._wandb.log(scalars, step=step)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def format_line(record: Mapping) -> str:
    """``[2026-11-25 12:00:00] iteration 10/100 | kd 1.23 | ce 2.34 | lr 1.0e-04 | ...`` in
    Megatron's manner (the timestamp is the record's ``time``, local time)."""
    parts = []
    stamp = ""
    if "time" in record:
        stamp = time.strftime("[%Y-%m-%d %H:%M:%S] ", time.localtime(record["time"]))
    for key, value in record.items():
        if key == "time":
            continue
        if key == "iteration" and "train_iters" in record:
            parts.append(f"iteration {value}/{record['train_iters']}")
        elif key == "train_iters":
            continue
        elif isinstance(value, float):
            text = f"{value:.3e}" if (value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e5)) \
                else f"{value:.4f}"
            parts.append(f"{key} {text}")
        else:
            parts.append(f"{key} {value}")
    return stamp + " | ".join(parts)


def bits_per_byte(loss_nats_sum: float, num_bytes: int) -> float:
    """Cross-entropy summed over tokens (nats) per byte of text, in bits."""
    return loss_nats_sum / (math.log(2) * max(num_bytes, 1))
