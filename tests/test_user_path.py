"""The user's path through ``pretrain_xdistill.py`` as a user meets it (issue 67): bad input is
refused before anything is built with one message, exit code 2 and no traceback of ours;
Megatron-LM's flags and habits (no abbreviations, its compatibility flags, architecture flags
checked against the checkpoint); a log that reads like Megatron-LM's without the dependency
warnings every run and rank repeated.

The runs are the real script in a subprocess, on the end-to-end tests' tiny converted models
with the real SmolLM2 / Qwen2 tokenizers (tests/test_e2e.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from shared_assets import TOKENIZERS, needs_shared_assets

from megatron_xdistill.training.arguments.checks import parse_args

REPO = Path(__file__).resolve().parents[1]
PREFIX = "pretrain_xdistill.py: error: "


def _pretrain(argv: list[str], world: int = 1, torchrun: bool = False,
              timeout: float = 600) -> subprocess.CompletedProcess:
    """The script as a user runs it (one process, or torchrun with ``world`` ranks)."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    env.pop("RANK", None)
    if torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
               "--master-port", "29637", str(REPO / "pretrain_xdistill.py"), *argv]
    else:
        env["WORLD_SIZE"] = str(world)  # the world size the checks see; none of them starts
        cmd = [sys.executable, str(REPO / "pretrain_xdistill.py"), *argv]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout,
                          cwd=REPO)


def _base(root: Path, s_tok: Path, t_tok: Path, **changes: str) -> list[str]:
    values = {"--load": str(root / "student"), "--teacher-load": str(root / "teacher"),
              "--tokenizer-model": str(s_tok), "--teacher-tokenizer-model": str(t_tok),
              "--projection-path": str(root / "proj.safetensors"),
              "--data-path": str(root / "train.jsonl"), "--seq-length": "32",
              "--teacher-seq-length": "40", "--micro-batch-size": "1",
              "--global-batch-size": "4", "--train-iters": "2", "--lr": "1e-3",
              "--kd-loss": "pkl", "--kd-topk": "16", "--num-workers": "0",
              "--data-cache-path": str(root / "cache")}
    values.update(changes)
    return [token for flag, value in values.items() for token in (flag, value)]


def assert_refused(done: subprocess.CompletedProcess, message: str) -> None:
    """Exit code 2, one error line of ours naming the problem, no traceback, few lines, and
    nothing built (Megatron-Core's model warning never printed)."""
    out = done.stdout + done.stderr
    assert done.returncode == 2, out[-3000:]
    errors = [line for line in out.splitlines() if line.startswith(PREFIX)]
    assert len(errors) == 1 and message in errors[0], out[-3000:]
    assert "Traceback" not in out and "GPTModel" not in out, out[-3000:]
    assert len(out.splitlines()) <= 10, out


@pytest.fixture(scope="module")
def wrong_projection(e2e_setup):
    """A projection built for SmolLM2 -> GPT-2, not the run's SmolLM2 -> Qwen2."""
    from megatron_xdistill.projection import BuildOptions, build_projection, save_projection

    path = e2e_setup[0] / "proj_gpt2.safetensors"
    if not path.exists():
        save_projection(build_projection(str(TOKENIZERS / "smollm2"), str(TOKENIZERS / "gpt2"),
                                         BuildOptions()), str(path))
    return path


@needs_shared_assets
@pytest.mark.parametrize("case", ["projection", "text_field", "utf8", "tp_kv_heads",
                                  "architecture", "tokenizer", "tensorboard"])
def test_bad_input_is_one_message_before_anything_is_built(e2e_setup, wrong_projection,
                                                           tmp_path, case):
    """Each of a user's usual mistakes: exit 2 with one line that names the input and the fix,
    before torch.distributed starts or a model is built (today's main took 13-25 s and 94-168
    lines of per-rank tracebacks for these, torchrun's summary aside)."""
    root, s_tok, t_tok = e2e_setup
    world = 1
    if case == "projection":
        argv, message = _base(root, s_tok, t_tok, **{"--projection-path": str(wrong_projection)}), \
            "W was built for teacher tokenizer"
    elif case == "text_field":
        data = tmp_path / "notext.jsonl"
        data.write_text('{"content": "no text field"}\n')
        argv, message = _base(root, s_tok, t_tok, **{"--data-path": str(data)}), \
            "notext.jsonl:1: no field 'text' (use --text-field"
    elif case == "utf8":
        data = tmp_path / "latin1.jsonl"
        data.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9 au lait"}\n')
        argv, message = _base(root, s_tok, t_tok, **{"--data-path": str(data)}), \
            "latin1.jsonl:2: not UTF-8"
    elif case == "tp_kv_heads":  # the tiny teacher: 4 heads, 2 query groups
        argv = _base(root, s_tok, t_tok, **{"--teacher-tensor-model-parallel-size": "4"})
        world, message = 4, ("--teacher-tensor-model-parallel-size 4: the teacher "
                             "(Qwen2ForCausalLM, ")
        message += f"{root / 'teacher'}) has 2 query groups (KV heads), which 4 does not " \
                   "divide; use one of 1, 2"
    elif case == "architecture":
        argv = _base(root, s_tok, t_tok, **{"--num-layers": "24",
                                            "--max-position-embeddings": "256"})
        message = "these flags disagree with it: --num-layers 24, but the checkpoint has 2"
    elif case == "tensorboard":  # an optional extra, asked for but not installed
        import importlib.util

        if importlib.util.find_spec("tensorboard") is not None:
            pytest.skip("tensorboard is installed here")
        argv = [*_base(root, s_tok, t_tok), "--tensorboard-dir", str(tmp_path / "tb")]
        message = "--tensorboard-dir needs the tensorboard package: pip install"
    else:  # the teacher's tokenizer given for the student
        argv = _base(root, s_tok, t_tok, **{"--tokenizer-model": str(t_tok)})
        message = "has a vocabulary of 49152 but its tokenizer"
    assert_refused(_pretrain(argv, world=world), message)


@needs_shared_assets
@pytest.mark.parametrize("where", [  # the suite's 30 minutes: one torchrun case by default
    "checks", pytest.param("full_read", marks=pytest.mark.slow)])
def test_under_torchrun_rank_0_alone_reports(e2e_setup, wrong_projection, tmp_path, where):
    """Two ranks under torchrun: one line (rank 0's), ranks exit 2, no traceback of ours
    (torchrun adds its own summary of the failed ranks). ``checks``: found by every rank before
    anything starts (rank 1 must not exit first: torchrun would stop rank 0 before its line is
    out); ``full_read``: a fault past the records the first read checks, found by rank 0's full
    read after torch.distributed started."""
    root, s_tok, t_tok = e2e_setup
    if where == "checks":
        argv = _base(root, s_tok, t_tok, **{"--projection-path": str(wrong_projection)})
        want = f"{PREFIX}{wrong_projection}: W was built for teacher tokenizer"
    else:
        data = tmp_path / "late.jsonl"
        good = json.loads((root / "train.jsonl").read_text().splitlines()[0])["text"]
        data.write_text("\n".join(json.dumps({"text": good}) for _ in range(40))
                        + '\n{"content": "the fortieth record has no text"}\n')
        argv = _base(root, s_tok, t_tok, **{"--data-path": str(data)})
        want = (f"{PREFIX}{data}:41: no field 'text' (use --text-field to name the field that "
                f"holds the text)")
    done = _pretrain(argv, world=2, torchrun=True)
    out = done.stdout + done.stderr
    assert done.returncode != 0 and "exitcode  : 2" in out, out[-3000:]
    errors = [line for line in out.splitlines() if line.startswith(PREFIX)]
    assert len(errors) == 1 and errors[0].startswith(want), out[-3000:]
    ours = [line for line in out.splitlines() if 'File "' in line and "megatron_xdistill" in line]
    assert not ours and "[rank0]" not in out and "[rank1]" not in out, out[-3000:]


@needs_shared_assets
def test_dry_run_checks_everything_and_builds_nothing(e2e_setup):
    root, s_tok, t_tok = e2e_setup
    done = _pretrain([*_base(root, s_tok, t_tok), "--dry-run"], world=4)
    assert done.returncode == 0, done.stderr[-3000:]
    for what in ("model configurations", "tokenizers", "projections", "data files",
                 "dry run passed"):
        assert what in done.stdout, done.stdout
    assert "GPTModel" not in done.stdout + done.stderr


# ---------------------------------------------------------------- Megatron-LM's flags


@pytest.fixture
def argv(base):
    return base


@pytest.mark.parametrize("flag, hint", [
    (["--teacher-tensor", "2"], "--teacher-tensor: did you mean "
                                "--teacher-tensor-model-parallel-size"),
    (["--save-int", "5"], "--save-int: did you mean --save-interval"),
    (["--kd-temp", "2"], "--kd-temp: did you mean --kd-temperature"),
    (["--sav-interval", "5"], "--sav-interval: did you mean --save-interval"),
    (["--tokenizer-type", "GPT2BPETokenizer"],
     "'GPT2BPETokenizer' is not supported: the tokenizers here are Hugging Face tokenizer "
     "directories (--tokenizer-model DIR): use HuggingFaceTokenizer"),
    (["--ckpt-format", "torch"], "'torch' is not supported: training checkpoints are "
                                 "dist_checkpointing's torch_dist format"),
])
def test_abbreviations_and_other_values_are_refused_with_what_to_use(argv, capsys, flag, hint):
    """As Megatron-LM: no abbreviated flags (``--teacher-tensor 2`` was read as the teacher's
    TP); a misspelt flag gets the closest names; a value this trainer does not take says what
    to use."""
    with pytest.raises(SystemExit) as exit_:
        parse_args([*argv, *flag], 4)
    assert exit_.value.code == 2
    assert hint in capsys.readouterr().err


def test_megatron_lm_flags_are_accepted_with_their_meaning(argv):
    args = parse_args([*argv, "--tokenizer-type", "HuggingFaceTokenizer", "--ckpt-format",
                       "torch_dist", "--distributed-backend", "gloo", "--log-throughput",
                       "--use-checkpoint-args", "--fp16", "--initial-loss-scale", "4096",
                       "--max-position-embeddings", "2048",
                       "--untie-embeddings-and-output-weights"], 4)
    assert (args.distributed_backend, args.log_throughput, args.fp16) == ("gloo", True, True)
    from megatron_xdistill.training.side_config import StudentSideConfig

    optimizer = StudentSideConfig.from_args(args).optimizer
    assert optimizer.fp16 and optimizer.initial_loss_scale == 4096
    assert str(optimizer.params_dtype) == "torch.float16"
    for wrong, message in ((["--bf16"], "--fp16 and --bf16"),):
        with pytest.raises(ValueError, match=message):
            parse_args([*argv, "--fp16", *wrong], 4)
    with pytest.raises(ValueError, match="--loss-scale: loss scaling is for --fp16"):
        parse_args([*argv, "--loss-scale", "128"], 4)


@needs_shared_assets
def test_architecture_flags_must_agree_with_the_checkpoint(e2e_setup, argv):
    """Megatron-LM's architecture flags: accepted when the student's checkpoint has that shape
    (the tiny student: 2 layers, hidden 64, 4 heads, 2 query groups, tied), refused naming both
    values when not."""
    from megatron_xdistill.training.preflight import check_models

    root = e2e_setup[0]
    argv[argv.index("--load") + 1] = str(root / "student")
    argv[argv.index("--teacher-load") + 1] = str(root / "teacher")
    agree = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
             "--num-query-groups", "2", "--group-query-attention", "--swiglu",
             "--normalization", "RMSNorm", "--position-embedding-type", "rope"]
    check_models(parse_args([*argv, *agree], 4))
    args = parse_args([*argv, "--hidden-size", "128", "--untie-embeddings-and-output-weights"],
                      4)
    with pytest.raises(ValueError, match=r"--hidden-size 128, but the checkpoint has 64; "
                                         r"--untie-embeddings-and-output-weights, but the "
                                         r"checkpoint ties its output layer"):
        check_models(args)


def test_model_flops_count_every_matrix_product_of_the_hf_model():
    """The throughput's FLOPs per token against the HF model's own linear layers (2 per
    weight of each, the attention's two sequence products, the output layer)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from megatron_xdistill.models import model_info_from_hf
    from megatron_xdistill.training.run_log import forward_flops_per_token

    config = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=176,
                         num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    seq = 128
    attention = 3 * 2 * 2 * seq * 64  # layers x (QK^T and AV) x 2 flops x positions x q width
    info = model_info_from_hf({**config.to_dict(), "architectures": ["LlamaForCausalLM"]})
    assert forward_flops_per_token(info, seq) == \
        2 * linear + attention


@needs_shared_assets
def test_the_log_reads_like_megatron_lms(e2e_setup):
    """One short run: the arguments once, Megatron-LM's iteration fields, TFLOP/s with
    --log-throughput, an ETA, a note that nothing is kept without --save, and none of the
    dependency warnings that every run and rank printed (36 of 53 lines before)."""
    root, s_tok, t_tok = e2e_setup
    done = _pretrain([*_base(root, s_tok, t_tok, **{"--train-iters": "1"}), "--log-throughput"],
                     world=2, torchrun=True)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert out.count("------------------------ arguments ------------------------") == 1
    iteration = next(line for line in out.splitlines() if "iteration 1/1" in line)
    for field in ("consumed samples: 4", "elapsed time per iteration (ms):",
                  "throughput per GPU (TFLOP/s/GPU):", "learning rate: 1.000000E-03",
                  "lm loss:", "kd loss:", "grad norm:", "ETA 0:00:00"):
        assert field in iteration, iteration
    assert "no --save: the model this run trains will not be kept" in out
    assert "no --save: the model trained to iteration 1 is not kept" in out
    for noise in ("UserWarning", "MimoModelConfig", "async save is deprecated",
                  "argument order of load"):
        assert noise not in out, out
    deprecated = [line for line in out.splitlines() if "GPTModel IS DEPRECATED" in line]
    assert len(deprecated) <= 1, "\n".join(deprecated)


def test_an_input_error_is_reported_once_and_a_bug_keeps_its_traceback(capsys, monkeypatch):
    """Within reading_inputs bad input (ValueError, a missing file, ...) becomes one message:
    from rank 0 alone when every rank raises it, prefixed by its rank when only that rank can
    have; XDISTILL_TRACEBACK=1 adds the traceback. Other errors (bugs) pass unchanged."""
    from megatron_xdistill.training.user_errors import InputError, reading_inputs, report

    with pytest.raises(InputError) as shared:
        with reading_inputs():
            raise ValueError("data.jsonl:3: no field 'text'")
    assert report(shared.value, rank=1) == 2 and capsys.readouterr().err == ""
    assert report(shared.value, rank=0) == 2
    assert capsys.readouterr().err == f"{PREFIX}data.jsonl:3: no field 'text'\n"

    with pytest.raises(InputError) as local:
        with reading_inputs(shared=False):
            open("/nonexistent/file.jsonl")
    report(local.value, rank=3)
    assert capsys.readouterr().err == (f"{PREFIX}[rank 3] /nonexistent/file.jsonl: No such file "
                                       f"or directory\n")
    monkeypatch.setenv("XDISTILL_TRACEBACK", "1")
    report(local.value, rank=3)
    assert "Traceback (most recent call last)" in capsys.readouterr().err

    with pytest.raises(KeyError):  # not bad input: a bug's own error and traceback
        with reading_inputs():
            raise KeyError("a bug")
