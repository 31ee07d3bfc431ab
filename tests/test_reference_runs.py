"""The reference runs' config files (examples/reference_runs/) run as a user runs them.

``pretrain_xdistill.py --config <example> key=value ...`` with tiny random models in place of the
real ones: only what a small CPU run cannot take from the file is overridden (paths, lengths,
batch, steps, bf16 -> fp32 for 1e-5 comparisons, layout sizes that the rank count cannot hold),
so a key the reader refuses or a layout the file names that does not work fails here. The
two-teacher file's teachers file is copied with only its paths, teacher lengths and (for the
single-rank reference) sizes replaced; every other key is the example's own.

- two teachers (Phi-4-mini-shaped, another tokenizer, through the projection; a Llama teacher
  with the student's tokenizer, full-vocabulary KL) into a Llama-shaped student: at 2 ranks in
  the file's own layout (student DP2, each teacher TP2);
- Qwen3-shaped teacher TP2 x CP2 (the file's) into the student at TP2 x CP2 (the file's TP4 x
  CP2 scaled to 4 ranks).

Each run's first steps (KD, CE, each teacher's KD) equal the single-rank run's (rel 1e-5), the
losses are finite and positive, and the checkpoint is saved. The full layouts (8 ranks: student
DP8 under both teachers at TP2; student TP4 x CP2 under the teacher at TP2 x CP2) are slow tests.

The tokenizers are the shared assets' (Phi-4-mini's, Qwen3's and Llama 3.2's own are not on this
machine; the architectures do not depend on them): the student and the same-tokenizer teacher
take SmolLM2's (a Llama model's), the two cross-tokenizer teachers Qwen2's.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import yaml
from scratch import scratch_dir
from shared_assets import needs_shared_assets
from test_e2e import _convert, _run_main

from megatron_xdistill.testing.multirank import RankPool
from megatron_xdistill.testing.tiny_models import make_tiny_model

pytestmark = needs_shared_assets
REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples" / "reference_runs"
TWO_TEACHERS = EXAMPLES / "two_teachers_phi4mini_llama3b.yaml"
QWEN3 = EXAMPLES / "qwen3_4b_to_llama_1b.yaml"
STEPS, SEQ, TEACHER_SEQ, GBS = 3, 32, 40, 8
RTOL = 1e-5
STUDENT_VOCAB, QWEN_VOCAB = 49152, 151936  # the SmolLM2 and Qwen2 tokenizers' models


@pytest.fixture(scope="module")
def models(e2e_setup, request, tmp_path_factory):
    """``(root, student tokenizer, cross teachers' tokenizer)``: test_e2e's student (a tiny Llama),
    its projection to the Qwen2 tokenizer and text, plus the tiny teachers converted: a
    Phi-4-mini-shaped one and a Qwen3-shaped one on Qwen2's vocabulary, a Llama one on the
    student's."""
    e2e_root, s_tok, t_tok = e2e_setup
    root = scratch_dir(request, tmp_path_factory, "reference_runs")
    for name in ("student", "proj.safetensors", "train.jsonl"):
        (root / name).symlink_to(e2e_root / name)
    make_tiny_model("phi4mini", str(root / "phi4mini_hf"), seed=2, vocab_size=QWEN_VOCAB)
    make_tiny_model("llama3", str(root / "llama3b_hf"), seed=3, vocab_size=STUDENT_VOCAB)
    make_tiny_model("qwen3", str(root / "qwen3_hf"), seed=4)
    with RankPool(1) as pool:
        for name in ("phi4mini", "llama3b", "qwen3"):
            pool.run(_convert, str(root / f"{name}_hf"), str(root / name))
    return root, s_tok, t_tok


def _common(root: Path, name: str, student: str = "student") -> list[str]:
    """The overrides every scaled-down run needs: paths, lengths, batch, steps, fp32, and a
    learning rate from the first step on large enough that a wrong gradient shows in the next
    steps' losses of a tiny model."""
    return [f"load={root / student}", f"data_path=[{root / 'train.jsonl'}]",
            f"save={root / name}", f"save_interval={STEPS}", f"seq_length={SEQ}",
            f"global_batch_size={GBS}", f"train_iters={STEPS}", "lr=1e-3", "lr_warmup_iters=0",
            "bf16=false", "num_workers=0", f"metrics_file={root / name}.jsonl",
            f"data_cache_path={root / name}_cache"]


def two_teachers_argv(root: Path, s_tok: Path, t_tok: Path, name: str, teacher_tp: int | None,
                      student: str = "student") -> list[str]:
    """The two-teacher example with the tiny models; ``teacher_tp`` None keeps each teacher's
    size from the example's teachers file."""
    config = yaml.safe_load(TWO_TEACHERS.read_text())
    teachers_file = TWO_TEACHERS.parent / config["teachers_config"]  # read beside the file
    assert teachers_file == EXAMPLES / "two_teachers.yaml"
    data = yaml.safe_load(teachers_file.read_text())
    phi, llama = data["teachers"]
    assert (phi["name"], llama["name"]) == ("phi4mini", "llama3b")
    assert "projection_path" not in llama  # same tokenizer as the student: no projection
    phi.update(load=str(root / "phi4mini"), tokenizer_model=str(t_tok),
               projection_path=str(root / "proj.safetensors"), seq_length=TEACHER_SEQ)
    llama.update(load=str(root / "llama3b"), tokenizer_model=str(s_tok))
    for teacher in (phi, llama):
        if teacher_tp is not None:
            teacher["tensor_model_parallel_size"] = teacher_tp
    copy = root / f"{name}_teachers.yaml"
    copy.write_text(yaml.safe_dump(data, sort_keys=False))
    return ["--config", str(TWO_TEACHERS), f"tokenizer_model={s_tok}",
            f"teachers_config={copy}", *_common(root, name, student)]


def qwen3_argv(root: Path, s_tok: Path, t_tok: Path, name: str, layout: dict[str, int],
               student: str = "student") -> list[str]:
    """The Qwen3 example with the tiny models; ``layout`` overrides sizes the ranks cannot hold
    (keys as in the file, e.g. ``tensor_model_parallel_size`` or ``teacher.context_parallel_size``)."""
    return ["--config", str(QWEN3), f"tokenizer_model={s_tok}",
            f"teacher.load={root / 'qwen3'}", f"teacher.tokenizer_model={t_tok}",
            f"teacher.seq_length={TEACHER_SEQ}", f"projection_path={root / 'proj.safetensors'}",
            *_common(root, name, student), *(f"{k}={v}" for k, v in layout.items())]


def step_losses(root: Path, name: str) -> list[dict[str, float]]:
    """Each training step's KD, CE and (several teachers) each teacher's KD."""
    records = [json.loads(x) for x in (root / f"{name}.jsonl").read_text().splitlines()]
    out = []
    for r in records:
        if "kd" not in r:
            continue
        out.append({k: v for k, v in r.items() if k in ("kd", "ce") or k.startswith("kd/")})
    return out


def check_run(root: Path, name: str, reference: str) -> None:
    """``name``'s steps equal ``reference``'s (rel RTOL), are finite and teach something; its
    checkpoint of the last step is saved."""
    got, ref = step_losses(root, name), step_losses(root, reference)
    assert len(got) == len(ref) == STEPS, (got, ref)
    for step, (g, r) in enumerate(zip(got, ref), 1):
        assert g.keys() == r.keys(), (g, r)
        for key, value in r.items():
            assert math.isfinite(value) and value > 0, (name, step, key, value)
            assert g[key] == pytest.approx(value, rel=RTOL), f"{name} step {step} {key}"
    tracker = root / name / "latest_checkpointed_iteration.txt"
    assert tracker.read_text().strip() == str(STEPS), os.listdir(root / name)


def test_two_teachers_config_finds_its_teachers_file_from_anywhere(tmp_path, monkeypatch):
    """As written, run from another directory, the example reads its teachers file (beside it)
    and stops at the first path left for the user, naming the teacher and the key."""
    from megatron_xdistill.training.arguments.checks import parse_args

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as err:
        parse_args(["--config", str(TWO_TEACHERS)], 16)
    assert str(err.value) == \
        "teacher 'phi4mini': load: no such directory: /path/to/phi-4-mini-instruct-mcore"


def _single_rank(argv: list[str]) -> None:
    with RankPool(1) as pool:
        pool.run(_run_main, argv)


@pytest.mark.slow  # minutes on 2 cores; its 8-rank sibling is slow too: the suite's budget
def test_two_teachers_config_at_two_ranks_matches_single_rank(models):
    root, s_tok, t_tok = models
    _single_rank(two_teachers_argv(root, s_tok, t_tok, "two_ref", teacher_tp=1))
    assert {"kd/phi4mini", "kd/llama3b"} <= step_losses(root, "two_ref")[0].keys()
    with RankPool(2) as pool:  # the file's layout: student DP2, each teacher TP2
        pool.run(_run_main, two_teachers_argv(root, s_tok, t_tok, "two_tp2", teacher_tp=None))
    check_run(root, "two_tp2", "two_ref")


@pytest.mark.slow  # the suite's 30 minutes; its 8-rank sibling is slow too (make test-slow)
def test_qwen3_config_at_four_ranks_matches_single_rank(models, e2e_pool):
    root, s_tok, t_tok = models
    single = {"tensor_model_parallel_size": 1, "context_parallel_size": 1,
              "teacher.tensor_model_parallel_size": 1, "teacher.context_parallel_size": 1}
    _single_rank(qwen3_argv(root, s_tok, t_tok, "qwen_ref", single))
    # teacher TP2 x CP2 as the file; the student TP2 x CP2 (the file's TP4 x CP2 on 4 ranks)
    e2e_pool.run(_run_main, qwen3_argv(root, s_tok, t_tok, "qwen_tp2cp2",
                                       {"tensor_model_parallel_size": 2}))
    check_run(root, "qwen_tp2cp2", "qwen_ref")


#: 8 ranks on a 2-core machine: generous start-up and collective limits (a hang still ends).
EIGHT = {"start_timeout_s": 900.0, "collective_timeout_s": 900.0}
EIGHT_RUN_S = 1800.0


@pytest.fixture(scope="module")
def student_kv4(models):
    """A tiny Llama student whose 4 query groups split over TP4 (Llama-3.2-1B: 32 heads, 8
    groups), with the student tokenizer's vocabulary."""
    root = models[0]
    if not (root / "student_kv4").exists():
        make_tiny_model("llama3", str(root / "student_kv4_hf"), seed=5, vocab_size=STUDENT_VOCAB,
                        num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=True)
        with RankPool(1) as pool:
            pool.run(_convert, str(root / "student_kv4_hf"), str(root / "student_kv4"))
    return "student_kv4"


@pytest.mark.slow  # 8 ranks
def test_two_teachers_config_full_layout_at_eight_ranks(models):
    """The file's layout at 8 ranks: student DP8, each teacher TP2 (DP4)."""
    root, s_tok, t_tok = models
    _single_rank(two_teachers_argv(root, s_tok, t_tok, "two_ref8", teacher_tp=1))
    with RankPool(8, **EIGHT) as pool:
        pool.run(_run_main, two_teachers_argv(root, s_tok, t_tok, "two_8", teacher_tp=None),
                 timeout=EIGHT_RUN_S)
    check_run(root, "two_8", "two_ref8")


@pytest.mark.slow  # 8 ranks
def test_qwen3_config_full_layout_at_eight_ranks(models, student_kv4):
    """The file's layout at 8 ranks: teacher TP2 x CP2 (DP2), student TP4 x CP2."""
    root, s_tok, t_tok = models
    single = {"tensor_model_parallel_size": 1, "context_parallel_size": 1,
              "teacher.tensor_model_parallel_size": 1, "teacher.context_parallel_size": 1}
    _single_rank(qwen3_argv(root, s_tok, t_tok, "qwen_ref8", single, student=student_kv4))
    with RankPool(8, **EIGHT) as pool:
        pool.run(_run_main, qwen3_argv(root, s_tok, t_tok, "qwen_8", {}, student=student_kv4),
                 timeout=EIGHT_RUN_S)
    check_run(root, "qwen_8", "qwen_ref8")
