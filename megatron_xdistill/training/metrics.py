"""Progress lines, a JSON Lines metrics file and (optionally) TensorBoard, written by rank 0."""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping


class MetricsWriter:
    """Writes one record per logged step to stdout, ``--metrics-file`` and TensorBoard."""

    def __init__(self, metrics_file: str | None, tensorboard_dir: str | None,
                 enabled: bool) -> None:
        self.enabled = enabled
        self._file = None
        self._tb = None
        if not enabled:
            return
        if metrics_file:
            os.makedirs(os.path.dirname(os.path.abspath(metrics_file)), exist_ok=True)
            self._file = open(metrics_file, "a", buffering=1)
        if tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:  # tensorboard is an optional extra
                raise RuntimeError(
                    "--tensorboard-dir needs the tensorboard package: pip install tensorboard"
                ) from exc
            self._tb = SummaryWriter(log_dir=tensorboard_dir)

    def write(self, record: Mapping[str, float | int | str], line: str | None = None) -> None:
        """Log one record; ``line`` is the human progress line (default: built from record)."""
        if not self.enabled:
            return
        record = {"time": round(time.time(), 3), **record}
        print(line if line is not None else format_line(record), flush=True)
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
        if self._tb is not None:
            step = int(record.get("iteration", 0))
            for key, value in record.items():
                if isinstance(value, (int, float)) and key not in ("iteration", "time"):
                    self._tb.add_scalar(key, value, step)
            self._tb.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()


def format_line(record: Mapping) -> str:
    """`` iteration 10/100 | kd 1.23 | ce 2.34 | lr 1.0e-04 | ...`` in Megatron's manner."""
    parts = []
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
    return " | ".join(parts)


def bits_per_byte(loss_nats_sum: float, num_bytes: int) -> float:
    """Cross-entropy summed over tokens (nats) per byte of text, in bits."""
    return loss_nats_sum / (math.log(2) * max(num_bytes, 1))
