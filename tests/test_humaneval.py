"""HumanEval offline: the sandbox runs the canonical solutions of a sample of problems to a pass,
a wrong one to a failure, stops an endless loop and a memory hog by their limits, and contains a
completion that writes outside its directory, deletes a file or opens a socket -- the next
program runs normally after each. The two lm-eval tasks run with the ``xdistill`` backend; the
canonical-solution bits per byte equals a dense ``transformers`` computation."""

from __future__ import annotations

import math

import pytest
import torch
from scratch import scratch_dir
from shared_assets import TOKENIZERS, needs_shared_assets

from megatron_xdistill.evaluation import humaneval
from megatron_xdistill.evaluation.sandbox import SandboxLimits, network_isolation, run_program

FAST = SandboxLimits(cpu_seconds=2.0, wall_seconds=6.0, memory_mb=512)


@pytest.fixture(scope="module")
def problems():
    return humaneval.problems()


def test_the_package_data_is_there(problems):
    assert len(problems) == 164
    assert all(p["task_id"] == f"HumanEval/{i}" for i, p in enumerate(problems))


def test_canonical_solutions_pass_and_a_wrong_one_fails(problems):
    for doc in problems[::20]:  # 9 problems
        assert humaneval.process_results(doc, [doc["canonical_solution"]]) == {"pass@1": 1.0}
    wrong = run_program(humaneval.program(problems[0], "    return not True\n"))
    assert wrong.status == "failed" and "AssertionError" in wrong.output


def _still_works() -> None:
    result = run_program("print(sum(range(10)))", FAST)
    assert result.passed and result.output.strip() == "45"


def test_limits_stop_an_endless_loop_a_sleeper_and_a_memory_hog():
    assert run_program("while True:\n    pass\n", FAST).status == "timed out"  # CPU limit
    _still_works()
    assert run_program("import time\ntime.sleep(60)\n", FAST).status == "timed out"  # wall
    _still_works()
    hog = run_program("x = []\nwhile True:\n    x.append(bytearray(1 << 24))\n", FAST)
    assert hog.status == "out of memory"
    _still_works()


def test_writes_outside_deletes_and_sockets_are_contained(tmp_path):
    victim = tmp_path / "training_file.txt"
    victim.write_text("keep")
    outside = tmp_path / "written.txt"
    programs = [
        f"open({str(outside)!r}, 'w').write('x')",
        f"import os\nos.remove({str(victim)!r})",
        f"import shutil\nshutil.rmtree({str(tmp_path)!r})",
        f"import os\nos.rename({str(victim)!r}, 'mine.txt')",
        "import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=1)",
        "import subprocess\nsubprocess.run(['touch', '/tmp/xdistill_sandbox_escape'])",
        "import os\nos.kill(1, 9)",
    ]
    for source in programs:
        result = run_program(source, FAST)
        assert result.status == "failed" and "PermissionError" in result.output, source
        _still_works()
    assert victim.read_text() == "keep" and not outside.exists()
    inside = run_program("open('scratch.txt', 'w').write('ok')\nprint(open('scratch.txt').read())",
                         FAST)
    assert inside.passed and inside.output.strip() == "ok"  # its own directory is writable


def test_network_namespace_when_the_os_allows_it():
    """With a network namespace there is no route even past the audit hook's refusal (only a
    down loopback): the interfaces the program sees say which case this machine is."""
    result = run_program("print(open('/proc/net/dev').read())", FAST)
    assert result.passed and result.network_isolated == network_isolation()
    interfaces = [line.split(":")[0].strip() for line in result.output.splitlines()[2:] if ":" in line]
    if network_isolation():
        assert interfaces == ["lo"]


def test_bits_per_byte_aggregation():
    items = [(-2.0, 10), (-3.0, 5)]
    assert humaneval.bits_per_byte(items) == pytest.approx(5.0 / math.log(2) / 15)
    doc = {"prompt": "def f():\n    \"\"\"x\"\"\"\n", "canonical_solution": "    return 1\n"}
    assert humaneval.scored_bytes(doc) == len("\n    return 1\n")


@needs_shared_assets
def test_tasks_with_the_backend(request, tmp_path_factory, problems):
    from conversion.hf_to_mcore import convert_hf_to_mcore
    from conversion.launch import run_distributed
    from megatron_xdistill.evaluation.lm_eval_backend import XDistillLM
    from megatron_xdistill.evaluation.lm_eval_tasks import evaluate_tasks
    from megatron_xdistill.testing.tiny_models import make_tiny_model

    root = scratch_dir(request, tmp_path_factory, "humaneval")
    hf = make_tiny_model("smollm2", str(root / "hf"), str(TOKENIZERS), seed=5)
    run_distributed(convert_hf_to_mcore, 1, hf, str(root / "ckpt"))
    lm = XDistillLM(load=str(root / "ckpt"), batch_size=2)
    scores = evaluate_tasks(lm, ["xdistill_humaneval", "xdistill_humaneval_bpb"], limit=3,
                            gen_kwargs={"max_gen_toks": 48})  # the tiny model holds 512
    assert scores["xdistill_humaneval/pass@1"] == 0.0  # a random model
    # reference: dense transformers log-likelihood of each solution given its prompt
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf)
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    nats, num_bytes = 0.0, 0
    for doc in problems[:3]:
        context = doc["prompt"].rstrip()
        ids = tok.encode(doc["prompt"] + doc["canonical_solution"])
        start = len(tok.encode(context))
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)
        nats -= sum(float(logp[t - 1, ids[t]]) for t in range(start, len(ids)))
        num_bytes += humaneval.scored_bytes(doc)
    assert scores["xdistill_humaneval_bpb/canonical_bits_per_byte"] == pytest.approx(
        nats / math.log(2) / num_bytes, rel=1e-5)
