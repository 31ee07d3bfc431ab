"""Argument validation says what to change before anything is built."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_xdistill.training.arguments.checks import parse_args


def test_defaults_are_derived(base):
    args = parse_args(base, world_size=4)
    assert args.teacher_seq_length is None  # derived from the data when the run starts
    assert args.lr_decay_iters == 3
    # gold from its compact payload by measurement (parser's --kd-loss help, REPORT.md)
    assert args.kd_loss == "gold" and args.teachers[0].kd_loss == "gold"
    assert (args.kd_gold_topk, args.kd_gold_uncommon_topk) == (64, 256)
    assert (args.kd_topk, args.kd_topk_mode) == (64, "chunk")  # pkl's, for --kd-loss pkl
    view = args.teachers[0].view(args)
    assert (view.kd_gold_topk, view.kd_gold_uncommon_topk, view.kd_topk) == (64, 256, 64)
    assert args.gkd_beta is None and args.teachers[0].gkd_beta is None


@pytest.mark.parametrize("extra,message", [
    (["--kd-topk", "128"], r"--kd-topk is for the P-KL payload, but this teacher's loss is gold "
                           r"\(default: gold\): add --kd-loss pkl"),
    (["--kd-topk-mode", "global", "--kd-loss", "hkl"], r"--kd-topk-mode is for the P-KL payload"),
    (["--kd-loss", "pkl", "--kd-gold-topk", "16"],
     r"--kd-gold-topk is for the gold / H-KL payload, but this teacher's loss is pkl"),
])
def test_a_payload_size_of_another_loss_is_an_error(base, extra, message):
    with pytest.raises(ValueError, match=message):
        parse_args(base + extra, world_size=1)


def test_each_loss_takes_its_own_payload_sizes(base, tmp_path):
    args = parse_args(base + ["--kd-loss", "pkl", "--kd-topk", "128"], world_size=1)
    assert (args.teachers[0].kd_topk, args.teachers[0].kd_gold_topk) == (128, 64)
    config = tmp_path / "teachers.yaml"
    config.write_text("teachers:\n- name: a\n  kd_gold_topk: 16\n- name: b\n"
                      "  kd_loss: pkl\n  kd_topk: 8\n")
    args = parse_args(base + ["--teachers-config", str(config)], world_size=1)
    assert [(t.kd_loss, t.kd_topk, t.kd_gold_topk) for t in args.teachers] == [
        ("gold", 64, 16), ("pkl", 8, 64)]
    config.write_text("teachers:\n- name: a\n  kd_topk: 8\n")
    with pytest.raises(ValueError, match=r"teachers\[0\]: kd_topk is for the P-KL payload"):
        parse_args(base + ["--teachers-config", str(config)], world_size=1)


def test_gkd_beta_reaches_each_teachers_view(base, tmp_path):
    config = tmp_path / "teachers.yaml"
    config.write_text(f"teachers:\n- name: a\n  gkd_beta: 0.25\n- name: b\n"
                      f"  load: {tmp_path / 'teacher'}\n")
    args = parse_args(base + ["--gkd-beta", "0.5", "--teachers-config", str(config)],
                      world_size=1)
    assert [spec.view(args).gkd_beta for spec in args.teachers] == [0.25, 0.5]


@pytest.mark.parametrize("extra,world,message", [
    (["--tensor-model-parallel-size", "3"], 4,
     r"world size 4 is not divisible by the student's TP x PP x CP = 3 x 1 x 1"),
    (["--teacher-pipeline-model-parallel-size", "3"], 4,
     r"teacher's TP x PP x CP = 1 x 3 x 1; change --teacher-tensor-model-parallel-size"),
    (["--global-batch-size", "6"], 4, r"--global-batch-size 6 must be a multiple of"),
    (["--teacher-seq-length", "16"], 1, r"--teacher-seq-length 16 is too short"),
    (["--context-parallel-size", "2", "--seq-length", "66"], 2, r"divisible by 2 x context"),
    (["--save-interval", "5"], 1, r"--save-interval needs --save"),
    (["--keep-last-checkpoints", "2"], 1, r"--keep-last-checkpoints needs --save"),
    (["--save", "/tmp/x", "--keep-last-checkpoints", "0"], 1,
     r"--keep-last-checkpoints needs --save and N >= 1, got 0"),
    (["--kd-weight", "0", "--ce-weight", "0"], 1, r"nothing to train"),
    (["--lr-warmup-iters", "3"], 1, r"--lr-warmup-iters 3 must be >= 0 and smaller than"),
    (["--sequence-parallel"], 1, r"--sequence-parallel needs --tensor-model-parallel-size > 1"),
    (["--teacher-tensor-model-parallel-size", "4", "--teacher-sequence-parallel",
      "--teacher-seq-length", "66"], 4,
     r"teacher sequence length 66 must be divisible by 4 with --teacher-sequence-parallel"),
    (["--recompute-granularity", "full"], 1, r"needs --recompute-method .* --recompute-num-layers"),
    (["--recompute-num-layers", "2"], 1, r"apply to --recompute-granularity full only"),
    (["--recompute-granularity", "full", "--recompute-method", "block",
      "--recompute-num-layers", "0"], 1, r"--recompute-num-layers must be >= 1, got 0"),
    (["--optimizer", "sgd", "--use-distributed-optimizer"], 2,
     r"--optimizer sgd does not work with --use-distributed-optimizer"),
    (["--optimizer", "sgd", "--sgd-momentum", "1"], 1, r"--sgd-momentum 1.0 must be in \[0, 1\)"),
    (["--split", "99,1", "--valid-data-path", "v.jsonl"], 1, r"drop --valid-data-path"),
    (["--split", "a,b"], 1, r"--split 'a,b': expected up to three non-negative shares"),
    (["--eval-interval", "5"], 1, r"--eval-interval needs --valid-data-path or --split"),
    (["--gkd-beta", "1.5"], 1, r"--gkd-beta 1.5 must be in \[0, 1\]"),
    (["--gkd-beta", "0.5", "--kd-reverse"], 1, r"--kd-reverse is --gkd-beta 1; drop one"),
    (["--samples-per-epoch", "4"], 1,
     r"--samples-per-epoch 4 must be at least --global-batch-size 8"),
    (["--on-policy", "--samples-per-epoch", "8"], 1,
     r"--on-policy trains on the student's own rollouts .*: drop --samples-per-epoch"),
])
def test_bad_layouts_and_sizes_are_named(base, extra, world, message):
    with pytest.raises(ValueError, match=message):
        parse_args(base + extra, world_size=world)


def test_recompute_arguments_become_transformer_config_fields(base):
    from megatron_xdistill.training.arguments import recompute_options

    assert recompute_options(parse_args(base, world_size=1)) == {}
    args = parse_args(base + ["--recompute-granularity", "full", "--recompute-method", "uniform",
                              "--recompute-num-layers", "2"], world_size=1)
    assert recompute_options(args) == {"recompute_granularity": "full",
                                       "recompute_method": "uniform", "recompute_num_layers": 2}
    args = parse_args(base + ["--recompute-granularity", "selective"], world_size=1)
    assert recompute_options(args) == {"recompute_granularity": "selective"}


def test_model_options_per_side(base):
    from megatron_xdistill.training.arguments import model_options

    args = parse_args(base + ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                              "--recompute-granularity", "selective"], world_size=2)
    assert model_options(args, "student") == {"sequence_parallel": True,
                                              "recompute_granularity": "selective"}
    assert model_options(args, "teacher") == {"sequence_parallel": False}


def test_missing_directories_are_named(base, tmp_path):
    argv = list(base)
    argv[argv.index("--teacher-load") + 1] = str(tmp_path / "nope")
    with pytest.raises(ValueError, match=r"--teacher-load: no such directory: .*nope"):
        parse_args(argv, world_size=1)


DISAGGREGATED = ["--teacher-placement", "disaggregated"]


def test_disaggregated_placement_splits_the_world(base):
    from megatron_xdistill.parallel.placement import Placement

    args = parse_args(base + DISAGGREGATED + ["--teacher-ranks", "1",
                                              "--tensor-model-parallel-size", "3"], world_size=4)
    placement = Placement.from_args(args, 4)
    assert placement.student_global_ranks() == [0, 1, 2]
    assert placement.teacher_global_ranks() == [3]
    assert placement.is_student(0) and placement.is_teacher(3) and not placement.is_teacher(2)


@pytest.mark.parametrize("extra,world,message", [
    (DISAGGREGATED, 4, r"needs --teacher-ranks N with 1 <= N <= 3 \(world size 4"),
    (DISAGGREGATED + ["--teacher-ranks", "4"], 4, r"1 <= N <= 3 .*got 4"),
    (DISAGGREGATED + ["--teacher-ranks", "1"], 1, r"needs at least 2 ranks"),
    (["--teacher-ranks", "2"], 4, r"--teacher-ranks applies to --teacher-placement disaggregated"),
    (DISAGGREGATED + ["--teacher-ranks", "1", "--tensor-model-parallel-size", "2"], 4,
     r"the student's 3 ranks \(world size 4 - --teacher-ranks 1\) are not divisible by the "
     r"student's TP x PP x CP = 2 x 1 x 1"),
    (DISAGGREGATED + ["--teacher-ranks", "2", "--teacher-pipeline-model-parallel-size", "4"], 4,
     r"the teacher's 2 ranks \(--teacher-ranks\) are not divisible by the teacher's"),
    (DISAGGREGATED + ["--teacher-ranks", "3"], 4,
     r"must be a multiple of the teacher's data-parallel size 3"),
])
def test_bad_disaggregated_placements_are_named(base, extra, world, message):
    with pytest.raises(ValueError, match=message):
        parse_args(base + extra, world_size=world)


def test_teacher_cache_arguments(base, tmp_path):
    import json

    def without_teacher(argv):
        at = argv.index("--teacher-load")
        return argv[:at] + argv[at + 2:]

    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match="--teacher-load is required"):
        parse_args(without_teacher(base), world_size=1)
    with pytest.raises(ValueError, match="--teacher-cache-only needs --teacher-cache DIR"):
        parse_args(base + ["--teacher-cache-only"], world_size=1)
    with pytest.raises(ValueError, match=r"is not complete: filling it needs the teacher"):
        parse_args(without_teacher(base) + ["--teacher-cache", str(cache)], world_size=1)
    with pytest.raises(ValueError, match="CE alone uses no teacher payloads"):
        parse_args(base + ["--teacher-cache", str(cache), "--kd-weight", "0",
                           "--ce-weight", "1"], world_size=1)
    with pytest.raises(ValueError, match="--teacher-cache-only: every rank serves the teacher"):
        parse_args(base + ["--teacher-cache", str(cache), "--teacher-cache-only",
                           "--teacher-placement", "disaggregated", "--teacher-ranks", "1"],
                   world_size=2)
    cache.mkdir()
    (cache / "manifest.json").write_text(json.dumps({
        "format": "xdistill-teacher-cache", "version": 1, "complete": True, "num_samples": 8,
        "payload_numel": 3, "key": {}, "teacher_model": {}}))
    args = parse_args(without_teacher(base) + ["--teacher-cache", str(cache)], world_size=1)
    assert args.teacher_load is None  # a complete cache needs no teacher
    with pytest.raises(ValueError, match="is complete: no teacher runs"):
        parse_args(base + ["--teacher-cache", str(cache), "--teacher-placement",
                           "disaggregated", "--teacher-ranks", "1"], world_size=2)


def _entry(*argv: str, env: dict | None = None):
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    return subprocess.run([sys.executable, "-X", "importtime", str(repo / "pretrain_xdistill.py"),
                           *argv], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=300)


def _imported(stderr: str) -> set[str]:
    return {line.split("|")[-1].strip() for line in stderr.splitlines()
            if line.startswith("import time:")}


def test_help_comes_before_torch_is_imported():
    done = _entry("--help")
    assert done.returncode == 0 and "--teacher-tensor-model-parallel-size" in done.stdout
    assert "torch" not in _imported(done.stderr)


def test_argument_errors_come_before_torch_distributed(base):
    """A bad layout is named and the process exits 2 before any process group exists (no
    torch.distributed rendezvous: MASTER_PORT points nowhere and nothing waits on it)."""
    done = _entry(*base, "--tensor-model-parallel-size", "3",
                  env={"WORLD_SIZE": "4", "RANK": "0", "MASTER_PORT": "1"})
    assert done.returncode == 2, done.stderr[-2000:]
    assert "error: world size 4 is not divisible by the student's TP x PP x CP = 3" in done.stderr
    assert "megatron.core" not in _imported(done.stderr)
    missing = _entry("--load", "x")
    assert missing.returncode == 2 and "the following arguments are required" in missing.stderr
    assert "torch" not in _imported(missing.stderr)


def _yaml(tmp_path, text: str):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return str(path)


def test_a_config_file_equals_the_flag_form(base, tmp_path):
    """--config run.yaml (flag names, a teacher group, a list, an on/off flag, an
    interpolation) plus dotted overrides parses to exactly the flags' namespace."""
    value = dict(zip(base[::2], base[1::2]))
    at = base.index("--data-path") + 1
    flags = [*base[:at], "0.7", *base[at:], "--teacher-tensor-model-parallel-size", "2", "--kd-loss", "gold",
             "--kd-temperature", "2.0", "--ce-weight", "0.5", "--kd-reverse", "--lr", "3e-4",
             "--min-lr", "3e-5"]
    config = _yaml(tmp_path, f"""
load: {value['--load']}
teacher:
  load: {value['--teacher-load']}
  tokenizer_model: {value['--teacher-tokenizer-model']}
  tensor-model-parallel-size: 2
tokenizer_model: {value['--tokenizer-model']}
data_path: [0.7, {value['--data-path']}]
seq_length: 64
micro_batch_size: 1
global_batch_size: 8
train_iters: 3
lr: 1.0e-3
min_lr: ${{lr}}
kd_loss: gold
kd_temperature: 2
kd_reverse: true
""")
    got = parse_args(["--config", config, "lr=3e-4", "min_lr=3e-5", "ce_weight=0.5"], 4)
    want = parse_args(flags, 4)
    assert got.config == config and want.config is None
    assert {k: v for k, v in vars(got).items() if k != "config"} == \
        {k: v for k, v in vars(want).items() if k != "config"}


def test_flags_win_over_the_config(base, tmp_path):
    config = _yaml(tmp_path, "lr: 1.0e-3\ntrain_iters: 50\n")
    args = parse_args(["--config", config, *base, "--lr", "2e-4", "train_iters=7",
                       "--train-iters", "9"], 4)
    assert args.lr == 2e-4 and args.train_iters == 9


def test_a_config_files_teachers_config_is_read_beside_it(base, tmp_path, monkeypatch):
    """``teachers_config: teachers.yaml`` in a config file names the file beside it (as the
    reference runs' config does), from any working directory; given on the command line
    (override or flag) it is the user's path, from the working directory."""
    teacher = base[base.index("--teacher-load") + 1]
    tok = base[base.index("--teacher-tokenizer-model") + 1]
    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / "teachers.yaml").write_text(
        f"teachers:\n  - {{name: a, load: {teacher}, tokenizer_model: {tok}}}\n"
        f"  - {{name: b, load: {teacher}, tokenizer_model: {tok}}}\n")
    (runs / "run.yaml").write_text("teachers_config: teachers.yaml\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    args = parse_args(["--config", str(runs / "run.yaml"), *base], 4)
    assert args.teachers_config == str(runs / "teachers.yaml")
    assert [t.name for t in args.teachers] == ["a", "b"]
    (elsewhere / "mine.yaml").write_text((runs / "teachers.yaml").read_text())
    for given in (["teachers_config=mine.yaml"], ["--teachers-config", "mine.yaml"]):
        args = parse_args(["--config", str(runs / "run.yaml"), *base, *given], 4)
        assert args.teachers_config == "mine.yaml"


@pytest.mark.parametrize("text, overrides, message", [
    ("learning_rate: 1.0\n", [], "unknown key 'learning_rate' (no --learning-rate argument"),
    ("teacher: {lod: x}\n", [], "unknown key 'teacher_lod'"),
    ("seq_length: long\n", [], "--seq-length got 'long'"),
    ("kd_loss: xkl\n", [], "--kd-loss must be one of ['pkl', 'gold', 'hkl']"),
    ("kd_reverse: 3\n", [], "--kd-reverse is on/off"),
    ("lr: 1.0\n", ["lr=fast"], "--lr got 'fast'"),
])
def test_config_errors_name_the_file_and_the_key(base, tmp_path, text, overrides, message):
    config = _yaml(tmp_path, text)
    with pytest.raises(ValueError, match="--config .*run.yaml") as err:
        parse_args(["--config", config, *base, *overrides], 4)
    assert message in str(err.value)


@pytest.mark.parametrize("style, formula", [
    ("linear", lambda r: 1.0 - r),
    ("cosine", lambda r: 0.5 * (math.cos(math.pi * r) + 1.0)),
    ("exponential", lambda r: 2.0 * 0.5 ** r - 1.0),
])
def test_wsd_and_warmup_fraction_follow_megatron_lm(base, style, formula):
    """--lr-decay-style WSD with --lr-warmup-fraction: linear warmup from --lr-warmup-init over
    10% of 20 iterations, stable, then the WSD decay over the last 5 (closed form here)."""
    from megatron_xdistill.training.lr_schedule import LRSchedule

    at = base.index("--train-iters")
    argv = [*base[:at], *base[at + 2:], "--train-iters", "20", "--lr", "1.0", "--min-lr", "0.1",
            "--lr-decay-style", "WSD", "--lr-wsd-decay-style", style, "--lr-wsd-decay-iters",
            "5", "--lr-warmup-fraction", "0.1", "--lr-warmup-init", "0.2"]
    args = parse_args(argv, 4)
    assert args.lr_warmup_iters == 2
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    schedule = LRSchedule.from_args(args)
    scheduler = schedule.build(optimizer)
    for step in range(1, 21):
        scheduler.step(schedule.step_size)  # samples, as Megatron-LM counts
        if step <= 2:
            want = 0.2 + (1.0 - 0.2) * step / 2
        elif step <= 15:
            want = 1.0
        else:
            want = 0.1 + 0.9 * formula((step - 15) / 5)
        assert optimizer.param_groups[0]["lr"] == pytest.approx(want), f"step {step}"


def test_wsd_needs_its_decay_length(base):
    with pytest.raises(ValueError, match="--lr-decay-style WSD needs --lr-wsd-decay-iters"):
        parse_args([*base, "--lr-decay-style", "WSD"], 4)
    with pytest.raises(ValueError, match="not both"):
        parse_args([*base, "--lr-warmup-iters", "1", "--lr-warmup-fraction", "0.1"], 4)


def test_the_packing_cache_is_never_the_current_directory(base, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert parse_args(base, 4).data_cache_path == str(tmp_path / "xdg" / "megatron-xdistill" /
                                                      "data")
    saved = parse_args([*base, "--save", str(tmp_path / "run")], 4)
    assert saved.data_cache_path == str(tmp_path / "run" / "data_cache")


def test_side_configs_carry_the_flags_in_megatron_types(base, tmp_path):
    """The student's and each teacher's typed configuration take their flags once, into
    Megatron-Core's DistributedDataParallelConfig / OptimizerConfig where those exist."""
    from megatron_xdistill.training.side_config import StudentSideConfig, TeacherSideConfig

    config = tmp_path / "teachers.yaml"
    config.write_text(f"teachers:\n- name: a\n  seq_length: 96\n- name: b\n"
                      f"  load: {tmp_path / 'student'}\n  seq_length: 80\n")
    args = parse_args(base + [
        "--adam-beta2", "0.95", "--bf16", "--clip-grad", "0.5",
        "--use-distributed-optimizer", "--overlap-grad-reduce", "--ddp-bucket-size", "1234",
        "--ce-weight", "0.25", "--no-load-optim", "--min-lr", "1e-5",
        "--teachers-config", str(config), "--recompute-granularity", "selective"], 4)
    student = StudentSideConfig.from_args(args)
    assert (student.optimizer.optimizer, student.optimizer.adam_beta2) == ("adam", 0.95)
    assert student.optimizer.bf16 and student.optimizer.params_dtype == torch.bfloat16
    assert student.optimizer.use_distributed_optimizer and student.optimizer.clip_grad == 0.5
    assert (student.optimizer.lr, student.optimizer.min_lr) == (1e-4, 1e-5)
    assert student.ddp.use_distributed_optimizer and student.ddp.overlap_grad_reduce
    assert not student.ddp.overlap_param_gather and student.ddp.bucket_size == 1234
    assert student.ddp.grad_reduce_in_fp32
    assert (student.ce_weight, student.load_optim, student.load_rng) == (0.25, False, True)
    assert student.model_options["recompute_granularity"] == "selective"
    assert (student.schedule.max_lr, student.schedule.min_lr) == (1e-4, 1e-5)
    # In samples, as Megatron-LM counts: 3 iterations of 8
    assert (student.schedule.decay_steps, student.schedule.step_size) == (24, 8)
    assert (student.global_batch_size, student.micro_batch_size, student.seq_length) == (8, 1, 64)
    teachers = [TeacherSideConfig.from_args(spec.view(args)) for spec in args.teachers]
    assert [t.seq_length for t in teachers] == [96, 80]
    assert teachers[1].load == str(tmp_path / "student")
    assert teachers[0].load == str(tmp_path / "teacher")  # the --teacher-load default
    assert all(t.micro_batch_size == 1 and t.global_batch_size == 8 for t in teachers)
