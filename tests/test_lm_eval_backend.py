"""lm-eval backend ``xdistill``: the same numbers as lm-eval's own ``hf`` backend on the same
weights (a tiny random SmolLM2-shaped model and its Megatron conversion), on local tasks made
here from a few jsonl records (multiple choice, rolling log-likelihood, generation with stop
strings), at TP = PP = 1 in this process and at TP = 2 and PP = 2 on two gloo ranks."""

from __future__ import annotations

import json
import os

import pytest
import yaml
from scratch import scratch_dir
from shared_assets import TOKENIZERS, needs_shared_assets

from conversion.hf_to_mcore import convert_hf_to_mcore
from conversion.launch import run_distributed
from megatron_xdistill.testing.multirank import RankPool
from megatron_xdistill.testing.tiny_models import make_tiny_model

pytestmark = needs_shared_assets
RTOL = 1e-5

RECORDS = [
    {"question": "2 + 2 =", "choices": [" 4", " 5", " four"], "answer": 0,
     "text": "The cat sat on the mat. " * 9},
    {"question": "The capital of France is", "choices": [" Paris", " Rome"], "answer": 0,
     "text": "def f(x):\n    return x * 2\n\n\nprint(f(3))\n"},
    {"question": "", "choices": ["yes", "no"], "answer": 1, "text": "Hello world"},
    {"question": "Ünïcödé:  ", "choices": ["naïve", " café 🙂"], "answer": 1,
     "text": "日本語のテキスト。 emoji 🙂 " * 4},
]


def _task(name: str, data: str, **fields) -> dict:
    return {"task": name, "dataset_path": "json",
            "dataset_kwargs": {"data_files": {"test": data}}, "test_split": "test", **fields}


def write_tasks(root) -> list[str]:
    """Three task YAMLs over ``root/records.jsonl``: one per request kind."""
    data = str(root / "records.jsonl")
    (root / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    tasks = {
        "xd_mc": _task("xd_mc", data, output_type="multiple_choice",
                       doc_to_text="{{question}}", doc_to_choice="{{choices}}",
                       doc_to_target="{{answer}}",
                       metric_list=[{"metric": "acc"}, {"metric": "acc_norm"}]),
        "xd_roll": _task("xd_roll", data, output_type="loglikelihood_rolling", doc_to_text="",
                         doc_to_target="{{text}}",
                         metric_list=[{"metric": m} for m in
                                      ("word_perplexity", "byte_perplexity", "bits_per_byte")]),
        "xd_gen": _task("xd_gen", data, output_type="generate_until",
                        doc_to_text="Q: {{question}}", doc_to_target=" 4",
                        generation_kwargs={"until": ["\n", " the"], "max_gen_toks": 7},
                        metric_list=[{"metric": "exact_match"}]),
    }
    paths = []
    for name, config in tasks.items():
        path = root / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config))
        paths.append(str(path))
    return paths


@pytest.fixture(scope="module")
def tiny(request, tmp_path_factory):
    root = scratch_dir(request, tmp_path_factory, "lm_eval")
    hf = make_tiny_model("smollm2", str(root / "hf"), str(TOKENIZERS), seed=11)
    run_distributed(convert_hf_to_mcore, 1, hf, str(root / "ckpt"))
    write_tasks(root)
    return root


def run_tasks(lm, root) -> dict:
    """Task scores and per-request responses of ``lm`` on the three local tasks."""
    import lm_eval

    from megatron_xdistill.evaluation.lm_eval_tasks import task_specs

    tasks, manager = task_specs([str(root / f"{n}.yaml") for n in ("xd_mc", "xd_roll", "xd_gen")])
    out = lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=manager, log_samples=True,
                                  bootstrap_iters=0, verbosity="WARNING")
    if out is None:
        return {}
    return {"results": {t: {k: v for k, v in m.items() if k != "alias"}
                        for t, m in out["results"].items()},
            "resps": {t: [s["resps"] for s in sorted(rows, key=lambda s: s["doc_id"])]
                      for t, rows in out["samples"].items()}}


def xdistill_scores(root, tp: int = 1, pp: int = 1, batch_size: int = 3) -> dict:
    from megatron_xdistill.evaluation.lm_eval_backend import XDistillLM

    return run_tasks(XDistillLM(load=str(root / "ckpt"), tp=tp, pp=pp, batch_size=batch_size),
                     root)


@pytest.fixture(scope="module")
def hf_scores(tiny):
    from lm_eval.models.huggingface import HFLM

    return run_tasks(HFLM(pretrained=str(tiny / "hf"), dtype="float32", batch_size=2,
                          device="cpu"), tiny)


def assert_same(ours: dict, reference: dict) -> None:
    """Per-request log-likelihoods rel 1e-5, the same greedy flags and texts, the same task
    scores."""
    assert ours["resps"].keys() == reference["resps"].keys()
    for task, rows in reference["resps"].items():
        for mine, theirs in zip(ours["resps"][task], rows, strict=True):
            for a, b in zip(mine, theirs, strict=True):
                a, b = a[0], b[0]
                if isinstance(b, str):
                    assert a == b, task
                elif isinstance(b, (list, tuple)):  # (log-likelihood, is greedy)
                    assert a[0] == pytest.approx(b[0], rel=RTOL) and a[1] == b[1], task
                else:
                    assert a == pytest.approx(b, rel=RTOL), task
    for task, metrics in reference["results"].items():
        for key, value in metrics.items():
            if isinstance(value, str):  # "N/A" standard errors
                assert ours["results"][task][key] == value, (task, key)
            else:
                assert ours["results"][task][key] == pytest.approx(value, rel=RTOL), (task, key)


def test_single_process_equals_hf_backend(tiny, hf_scores):
    from megatron_xdistill.evaluation.lm_eval_backend import XDistillLM
    from megatron_xdistill.generation import SamplingParams

    lm = XDistillLM(load=str(tiny / "ckpt"), batch_size=3)
    assert_same(run_tasks(lm, tiny), hf_scores)
    assert set(hf_scores["results"]["xd_roll"]) >= {"bits_per_byte,none", "word_perplexity,none"}
    # a greedy response is greedy under teacher forcing too (the is-greedy flag's True case)
    prompt = lm.tok_encode("Q: 2 + 2 =")
    [response] = lm.model.generate([prompt], SamplingParams(6, temperature=0.0), [-1])
    _, greedy = lm.model.token_logprobs([prompt + response])
    assert len(response) == 6 and bool(greedy[0, len(prompt) - 1:].all())


def _ranked(root, tp: int, pp: int) -> dict:
    return xdistill_scores(root, tp=tp, pp=pp, batch_size=2)


@pytest.fixture(scope="module")
def two_ranks():
    with RankPool(2) as ranks:
        yield ranks


@pytest.mark.parametrize("tp,pp", [(2, 1), pytest.param(1, 2, marks=pytest.mark.slow)])
def test_parallel_layouts_equal_hf_backend(tiny, hf_scores, two_ranks, tp, pp):
    per_rank = two_ranks.run(_ranked, tiny, tp, pp, timeout=600)
    assert per_rank[1] == {}  # only LOCAL_RANK 0 returns results to the caller
    assert_same(per_rank[0], hf_scores)


def test_bad_model_args(tiny):
    from megatron_xdistill.evaluation.lm_eval_backend import XDistillLM

    with pytest.raises(ValueError, match="auto is not supported"):
        XDistillLM(load=str(tiny / "ckpt"), batch_size="auto")
    with pytest.raises(FileNotFoundError, match="nowhere"):
        XDistillLM(load=str(tiny / "nowhere"))


def test_cli_writes_results(tiny, tmp_path, monkeypatch):
    from megatron_xdistill.evaluation.lm_eval_cli import main

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    assert main(["--model", "xdistill", "--model_args", f"load={tiny / 'ckpt'}",
                 "--tasks", str(tiny / "xd_mc.yaml"), "--batch_size", "4",
                 "--output_path", str(tmp_path / "out")]) == 0
    [result] = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "out") for f in fs
                if f.startswith("results_")]
    assert "acc,none" in json.loads(open(result).read())["results"]["xd_mc"]
