"""``xdistill-convert`` end to end (subprocesses, spawned ranks) and bad input: unsupported
architectures, mis-shaped or missing tensors, existing outputs, and writes that fail or are killed
half-way never leave a directory that looks complete."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from scratch import scratch_dir

from conversion.safetensors_io import SafetensorsFolder, TensorSpec, write_safetensors
from megatron_xdistill.storage import atomic_directory
from megatron_xdistill.testing.tiny_models import make_tiny_model

TOKENIZERS = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "assets", "tokenizers")


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "conversion.cli", *args], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def tiny(request, tmp_path_factory):
    root = scratch_dir(request, tmp_path_factory, "cli")
    tokenizers = TOKENIZERS if os.path.isdir(TOKENIZERS) else None
    make_tiny_model("smollm2", str(root / "smollm2"), tokenizers, seed=5)
    return root


def test_cli_import_verify_export(tiny):
    ckpt, back = tiny / "ckpt", tiny / "back"
    run = _cli("hf-to-mcore", "--hf-dir", str(tiny / "smollm2"), "--out", str(ckpt), "--tp", "2")
    assert run.returncode == 0, run.stderr
    assert "layer 1/4" in run.stdout and "wrote" in run.stdout
    info = json.loads((ckpt / "xdistill_model.json").read_text())
    assert info["source"]["tp"] == 2 and info["model_info"]["vocab_size"] == 49152
    assert not (tiny / "ckpt.tmp").exists()

    metrics = tiny / "verify.json"
    run = _cli("verify", "--hf-dir", str(tiny / "smollm2"), "--load", str(ckpt),
               "--seq-length", "24", "--max-rel-diff", "1e-4", "--json", str(metrics))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "top-1 agreement 1.0000" in run.stdout and "PASS" in run.stdout
    assert json.loads(metrics.read_text())["max_rel_diff"] <= 1e-4

    run = _cli("mcore-to-hf", "--load", str(ckpt), "--out", str(back))
    assert run.returncode == 0, run.stderr
    with SafetensorsFolder(str(tiny / "smollm2")) as a, SafetensorsFolder(str(back)) as b:
        assert sorted(a.names()) == sorted(b.names())
        for name in a.names():
            assert torch.equal(a.get(name), b.get(name)), name
    assert (back / "config.json").exists() and (back / "generation_config.json").exists()


def test_unsupported_architecture_is_named_before_any_work(tmp_path):
    from conversion.hf_to_mcore import preflight

    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 50257}))
    with pytest.raises(ValueError) as err:
        preflight(str(tmp_path))
    assert "GPT2LMHeadModel" in str(err.value) and "Qwen3ForCausalLM" in str(err.value)


def _rewrite(folder, change) -> None:
    """Rewrite a folder's model.safetensors with ``change(dict of tensors)`` applied."""
    from safetensors.torch import load_file, save_file

    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_shape_mismatch_and_missing_tensor_are_named(tiny, tmp_path):
    from conversion.hf_to_mcore import preflight

    bad = make_tiny_model("qwen2", str(tmp_path / "bad"), seed=7)
    name = "model.layers.2.mlp.up_proj.weight"
    _rewrite(bad, lambda t: t.__setitem__(name, t[name][:-1].clone()))
    with pytest.raises(ValueError, match=rf"{name}.*\[95, 64\].*\[96, 64\]"):
        preflight(bad)
    missing = "model.layers.3.self_attn.k_proj.bias"
    _rewrite(bad, lambda t: t.pop(missing))
    with pytest.raises(ValueError, match=missing):
        preflight(bad)


def test_failed_hf_write_leaves_nothing(tmp_path):
    out = tmp_path / "out"
    specs = [TensorSpec("a", (2, 2), torch.float32), TensorSpec("b", (3,), torch.float32)]

    def tensors():
        yield "a", torch.ones(2, 2)
        raise RuntimeError("source went away")

    with pytest.raises(RuntimeError, match="went away"):
        with atomic_directory(str(out)) as tmp:
            write_safetensors(tmp, specs, tensors())
    assert not out.exists() and not (tmp_path / ".out.tmp").exists()
    with pytest.raises(ValueError, match="does not match the planned b"):
        with atomic_directory(str(out)) as tmp:
            write_safetensors(tmp, specs, iter([("a", torch.ones(2, 2)), ("b", torch.ones(4))]))
    assert not out.exists()


def test_killed_write_never_looks_complete(tmp_path):
    out = tmp_path / "out"
    script = textwrap.dedent(f"""
        import os, signal, torch
        from megatron_xdistill.storage import atomic_directory
        from conversion.safetensors_io import TensorSpec, write_safetensors
        def tensors():
            yield "a", torch.ones(4)
            os.kill(os.getpid(), signal.SIGKILL)
        with atomic_directory({str(out)!r}) as tmp:
            write_safetensors(tmp, [TensorSpec("a", (4,), torch.float32),
                                    TensorSpec("b", (4,), torch.float32)], tensors())
    """)
    run = subprocess.run([sys.executable, "-c", script], timeout=120)
    assert run.returncode == -9
    assert not out.exists() and (tmp_path / ".out.tmp").exists()
    with pytest.raises(FileExistsError, match="--overwrite"):
        with atomic_directory(str(tmp_path)):
            pass
    # The next write replaces the leftover and completes.
    with atomic_directory(str(out)) as tmp:
        write_safetensors(tmp, [TensorSpec("a", (4,), torch.float32)], [("a", torch.ones(4))])
    assert not (tmp_path / ".out.tmp").exists()
    with SafetensorsFolder(str(out)) as folder:
        assert torch.equal(folder.get("a"), torch.ones(4))


def test_sharded_write_round_trips(tmp_path):
    specs = [TensorSpec(f"t{i}", (256,), torch.bfloat16) for i in range(5)]
    values = {s.name: torch.randn(256).to(torch.bfloat16) for s in specs}
    files = write_safetensors(str(tmp_path), specs, values.items(), max_shard_bytes=1024)
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    from safetensors import safe_open

    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 5 * 512
    for name, file in index["weight_map"].items():
        with safe_open(str(tmp_path / file), "pt") as fh:  # the reference reader agrees
            assert torch.equal(fh.get_tensor(name), values[name])
    with SafetensorsFolder(str(tmp_path)) as folder:
        assert all(torch.equal(folder.get(n), v) for n, v in values.items())
