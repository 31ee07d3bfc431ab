"""pretrain_xdistill with Phi-3-family models on both sides, in layouts of their own.

The teacher is Phi-4-mini-shaped (LongRoPE with a 32-token original length, 3/4 rotary, tied;
GPT-2's byte-level BPE tokenizer stands in for Phi-4-mini's o200k one, which is not on this
machine: the architecture does not depend on it), the student Phi-3-mini-shaped (untied, a
7-token sliding window, the Llama-2 SentencePiece tokenizer Phi-3 extends). The projection comes
from the ``xdistill-projection`` command line. The teacher's 40-token samples are past its
original length, its micro-batches trimmed to what their text needs (one sample each on one
rank; with PP2 the replica's longest): with the student at TP2 x DP2 and the teacher at CP2 x PP2,
the first steps' losses must equal the single-rank run's, which needs the LongRoPE factors chosen
for the configured 40 tokens whatever width a micro-batch runs.
"""

from __future__ import annotations

import json
import subprocess
import sys

from shared_assets import ASSETS, needs_shared_assets
from test_e2e import _argv, _convert, _losses, _run_main, assert_losses_match, reference_losses

from megatron_xdistill.testing.multirank import RankPool
from megatron_xdistill.testing.tiny_models import make_tiny_model

pytestmark = needs_shared_assets
TEACHER_VOCAB = 50304  # GPT-2's 50257 tokens, rounded up as a model vocabulary would be


def _setup(root):
    s_tok, t_tok = ASSETS / "tokenizers" / "mistral", ASSETS / "tokenizers" / "gpt2"
    student_hf = make_tiny_model("phi3", str(root / "student_hf"), seed=1)
    teacher_hf = make_tiny_model("phi4mini", str(root / "teacher_hf"), seed=2,
                                 vocab_size=TEACHER_VOCAB, initializer_range=0.3)
    with RankPool(1) as pool:
        pool.run(_convert, student_hf, str(root / "student"))
        pool.run(_convert, teacher_hf, str(root / "teacher"))
    run = subprocess.run(
        [sys.executable, "-m", "megatron_xdistill.projection.cli", "build", "--tokenizer-model",
         str(s_tok), "--teacher-tokenizer-model", str(t_tok), "--out",
         str(root / "proj.safetensors"), "--quiet"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    lines = (ASSETS / "corpora" / "enwiki_val.jsonl").read_text().splitlines()[:3]
    (root / "train.jsonl").write_text(
        "\n".join(json.dumps({"text": json.loads(x)["text"][:6000]}) for x in lines))
    return s_tok, t_tok


def test_phi3_student_and_phi4mini_teacher_in_their_own_layouts(e2e_pool, tmp_path):
    s_tok, t_tok = _setup(tmp_path)
    reference = reference_losses(tmp_path, s_tok, t_tok)
    assert all(kd > 0.05 for kd, _ in reference), reference  # a teacher worth matching
    layout = ["--tensor-model-parallel-size", "2", "--teacher-context-parallel-size", "2",
              "--teacher-pipeline-model-parallel-size", "2"]
    e2e_pool.run(_run_main, _argv(tmp_path, s_tok, t_tok, "phi_layout", layout))
    assert_losses_match(_losses(tmp_path, "phi_layout"), reference, "phi3 layouts")
