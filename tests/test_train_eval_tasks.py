"""``pretrain_xdistill.py --eval-tasks``: lm-eval task scores of the student in its training
layout (TP 2 on two gloo ranks) at iteration 0, every --eval-interval and at the end, each once
across a run stopped by --exit-interval and resumed; the logged scores equal the ``xdistill``
backend's on the run's final checkpoint in one process; a task whose data is not on the machine
is refused before anything is built."""

from __future__ import annotations

import json

import pytest
from scratch import scratch_dir
from shared_assets import ASSETS, TOKENIZERS, needs_shared_assets
from test_lm_eval_backend import write_tasks

from conversion.hf_to_mcore import convert_hf_to_mcore
from conversion.launch import run_distributed
from megatron_xdistill.testing.multirank import RankPool
from megatron_xdistill.testing.tiny_models import make_tiny_model

pytestmark = needs_shared_assets


@pytest.fixture(scope="module")
def setup(request, tmp_path_factory):
    root = scratch_dir(request, tmp_path_factory, "train_eval_tasks")
    hf = make_tiny_model("smollm2", str(root / "hf"), str(TOKENIZERS), seed=3)
    run_distributed(convert_hf_to_mcore, 1, hf, str(root / "student"))
    write_tasks(root)
    lines = (ASSETS / "corpora" / "enwiki_val.jsonl").read_text().splitlines()[:3]
    (root / "train.jsonl").write_text("\n".join(
        json.dumps({"text": json.loads(x)["text"][:4000]}) for x in lines))
    return root


def _argv(root, *extra: str) -> list[str]:
    tok = str(TOKENIZERS / "smollm2")  # CE only: the teacher flags name the student, unused
    return ["--load", str(root / "student"), "--tokenizer-model", tok,
            "--teacher-load", str(root / "student"), "--teacher-tokenizer-model", tok,
            "--data-path", str(root / "train.jsonl"), "--seq-length", "32",
            "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "4",
            "--lr", "1e-3", "--kd-weight", "0", "--ce-weight", "1", "--num-workers", "0",
            "--tensor-model-parallel-size", "2", "--data-cache-path", str(root / "cache"),
            "--metrics-file", str(root / "metrics.jsonl"), *extra]


def _run_main(argv: list[str]) -> int:
    from megatron_xdistill.training.run import main

    return main(argv)


def test_task_scores_at_the_interval_once_across_a_resume(setup):
    root = setup
    tasks = [str(root / "xd_mc.yaml"), str(root / "xd_roll.yaml")]
    argv = _argv(root, "--eval-tasks", *tasks, "--eval-limit", "3", "--eval-interval", "2",
                 "--save", str(root / "run"), "--save-interval", "2")
    with RankPool(2) as ranks:
        assert ranks.run(_run_main, argv + ["--exit-interval", "2"], timeout=900) == [0, 0]
        assert ranks.run(_run_main, argv, timeout=900) == [0, 0]  # resumes at iteration 2
    records = [json.loads(x) for x in (root / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "xd_mc/acc" in r]
    assert [r["iteration"] for r in evals] == [0, 2, 4]
    assert all({"xd_mc/acc_norm", "xd_roll/bits_per_byte", "xd_roll/word_perplexity"} <= set(r)
               for r in evals)
    assert not any("xd_mc/acc" in r for r in records if "ce" in r)  # not in the step records
    assert evals[0]["xd_roll/bits_per_byte"] != evals[2]["xd_roll/bits_per_byte"]  # it trained

    from megatron_xdistill.evaluation.lm_eval_backend import XDistillLM
    from megatron_xdistill.evaluation.lm_eval_tasks import evaluate_tasks

    final = evaluate_tasks(XDistillLM(load=str(root / "run"), tokenizer=str(TOKENIZERS /
                                                                             "smollm2")),
                           tasks, limit=3)
    for key, value in final.items():
        assert evals[2][key] == pytest.approx(value, rel=1e-5), key


def test_a_task_without_local_data_is_refused_at_start(setup, tmp_path):
    from test_e2e import refusal

    task = (setup / "xd_mc.yaml").read_text().replace(str(setup / "records.jsonl"),
                                                       str(tmp_path / "gone.jsonl"))
    (tmp_path / "gone.yaml").write_text(task)
    message = refusal(_argv(setup, "--eval-tasks", str(tmp_path / "gone.yaml")), world=2)
    assert "gone.yaml" in message and "not on this machine" in message
    assert "dataset_path: json" in message  # how to point lm-eval at a local copy
    message = refusal(_argv(setup, "--eval-tasks", "no_such_task_xyz"), world=2)
    assert "no_such_task_xyz" in message
