"""The ``xdistill`` lm-eval backend on real weights (SmolLM2-135M from the shared assets, no
near-ties): the same greedy text as lm-eval's ``hf`` backend at TP = 1, and in parallel layouts
(PP = 2, TP = 3) the teacher-forced log-likelihoods of that text within rel 1e-5.

Needs ``../shared/assets/fetch_models.sh smollm2-135m``. Run: ``pytest -m "slow and assets"
tests/test_lm_eval_real.py``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from scratch import scratch_dir

from conversion.hf_to_mcore import convert_hf_to_mcore
from conversion.launch import run_distributed
from megatron_xdistill.testing.multirank import RankPool

pytestmark = [pytest.mark.slow, pytest.mark.assets]

HF = Path(os.environ.get("XDISTILL_ASSETS", Path.home() / ".cache" / "xdistill-assets")) \
    / "models" / "smollm2-135m"
PROMPTS = ["def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           "The three primary colors are", "import math\n\n\ndef circle_area(radius):\n"]
GEN_KWARGS = {"until": ["\n\n\n"], "max_gen_toks": 32, "do_sample": False}


@pytest.fixture(scope="module")
def ckpt(request, tmp_path_factory):
    if not (HF / "model.safetensors").exists():
        pytest.skip(f"{HF} missing: run ../shared/assets/fetch_models.sh smollm2-135m")
    root = scratch_dir(request, tmp_path_factory, "lm_eval_real")
    run_distributed(convert_hf_to_mcore, 1, str(HF), str(root / "ckpt"))
    return root / "ckpt"


def _requests(kind: str, args: list[tuple]):
    from lm_eval.api.instance import Instance

    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


def texts_of(lm) -> list[str]:
    return lm.generate_until(_requests("generate_until", [(p, dict(GEN_KWARGS)) for p in PROMPTS]))


def loglikelihoods(ckpt: Path, texts: list[str], tp: int = 1, pp: int = 1) -> list[float]:
    from megatron_xdistill.evaluation.lm_eval_backend import XDistillLM

    lm = XDistillLM(load=str(ckpt), tp=tp, pp=pp, batch_size=3)
    return [ll for ll, _ in lm.loglikelihood(_requests("loglikelihood", list(zip(PROMPTS, texts))))]


def test_greedy_text_and_parallel_loglikelihoods(ckpt):
    from lm_eval.models.huggingface import HFLM

    from megatron_xdistill.evaluation.lm_eval_backend import XDistillLM

    ours = texts_of(XDistillLM(load=str(ckpt), batch_size=3))
    theirs = texts_of(HFLM(pretrained=str(HF), dtype="float32", batch_size=1, device="cpu"))
    assert ours == theirs
    assert all(len(t) > 20 for t in ours), ours  # real continuations, not empty stops
    reference = loglikelihoods(ckpt, ours)
    for world, tp, pp in ((2, 1, 2), (3, 3, 1)):
        with RankPool(world) as ranks:
            got = ranks.run(loglikelihoods, ckpt, ours, tp, pp, timeout=1200)
        for rank_values in got:
            assert rank_values == pytest.approx(reference, rel=1e-5), (tp, pp)
