"""Importing megatron_xdistill changes nothing in torch or Megatron; ``mcore.compat.install()``
(called by the entry points) does, and building a model without it is refused by name."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

_CHILD = textwrap.dedent("""
    import torch
    from torch.overrides import _get_current_function_mode_stack

    current_device = torch.cuda.current_device
    from megatron_xdistill import models
    from megatron_xdistill.mcore import compat as mcore_compat
    import megatron.core  # noqa: F401  (importable without Triton once the package is)
    import megatron_xdistill.training.distiller  # noqa: F401  (the whole runtime imports)

    assert not _get_current_function_mode_stack(), "a torch function mode is active at import"
    assert torch.cuda.current_device is current_device, "torch.cuda patched at import"
    try:
        models.build_gpt_model(None, None)  # refused before its arguments are looked at
    except RuntimeError as exc:
        assert "mcore.compat.install()" in str(exc) and "GPTModel" in str(exc), exc
    else:
        raise AssertionError("a model was built without mcore.compat.install()")
    mcore_compat.install()
    assert _get_current_function_mode_stack(), "install() did not adapt Megatron to the CPU"
    assert torch.cuda.current_device() == torch.device("cpu")
    print("ok")
""")


def test_import_is_inert_and_install_is_required_to_build():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    done = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("ok")
