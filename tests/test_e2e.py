"""End to end: pretrain_xdistill's first steps agree across student and teacher layouts.

Tiny random HF models with the real SmolLM2 (student) and Qwen2 (teacher) vocabularies are
converted to Megatron checkpoints; the projection is built from the real tokenizers. Every layout
must reproduce the single-rank reference run's first three losses (rel 1e-5); an interrupted
and resumed run matches the uninterrupted one exactly.
"""

from __future__ import annotations

import glob
import json
import shutil
from pathlib import Path

import pytest
from shared_assets import ASSETS, needs_shared_assets

from megatron_xdistill.testing.multirank import RankPool

pytestmark = needs_shared_assets
WORLD = 4
STEPS = 3
RTOL = 1e-5


def _tiny_hf(out: Path, arch: str, vocab_size: int, seed: int, init_std: float = 0.02) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256, rms_norm_eps=1e-5, initializer_range=init_std)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=True))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=False))
    model.save_pretrained(out)
    return out


def _convert(hf_dir: str, out: str) -> dict:
    from conversion import convert_hf_to_mcore

    return convert_hf_to_mcore(hf_dir, out, dtype="fp32")


def make_setup(root: Path) -> tuple[Path, Path, Path]:
    """Converted tiny models, the projection and the training text under ``root``; returns
    ``(root, student tokenizer, teacher tokenizer)`` (shared with test_disaggregated)."""
    from megatron_xdistill.projection import BuildOptions, build_projection, save_projection

    s_tok, t_tok = ASSETS / "tokenizers" / "smollm2", ASSETS / "tokenizers" / "qwen2"
    student_hf = _tiny_hf(root / "student_hf", "llama", 49152, 1)
    # A peaked teacher (larger init) makes the KL O(1), so relative tolerances mean something.
    teacher_hf = _tiny_hf(root / "teacher_hf", "qwen2", 151936, 2, init_std=0.3)
    with RankPool(1) as pool:
        pool.run(_convert, str(student_hf), str(root / "student"))
        pool.run(_convert, str(teacher_hf), str(root / "teacher"))
    matrix = build_projection(str(s_tok), str(t_tok), BuildOptions())
    save_projection(matrix, str(root / "proj.safetensors"))
    lines = (ASSETS / "corpora" / "enwiki_val.jsonl").read_text().splitlines()[:3]
    data = root / "train.jsonl"
    data.write_text("\n".join(json.dumps({"text": json.loads(x)["text"][:6000]}) for x in lines))
    return root, s_tok, t_tok


def _argv(root: Path, s_tok: Path, t_tok: Path, name: str, extra: list[str]) -> list[str]:
    """A tiny run's flags: P-KL chunk top-16 unless ``extra`` names another ``--kd-loss``
    (whose payload flags are its own: a P-KL size beside it is refused)."""
    loss = extra[extra.index("--kd-loss") + 1] if "--kd-loss" in extra else "pkl"
    payload = ["--kd-loss", "pkl", "--kd-topk", "16"] if loss == "pkl" else []
    return [*payload, "--load", str(root / "student"), "--teacher-load", str(root / "teacher"),
            "--tokenizer-model", str(s_tok), "--teacher-tokenizer-model", str(t_tok),
            "--projection-path", str(root / "proj.safetensors"),
            "--data-path", str(root / "train.jsonl"), "--seq-length", "32",
            "--teacher-seq-length", "40", "--micro-batch-size", "1", "--global-batch-size", "4",
            "--train-iters", str(STEPS), "--lr", "1e-3",
            "--ce-weight", "0.5", "--num-workers", "0", "--metrics-file",
            str(root / f"{name}.jsonl"), "--data-cache-path", str(root / "cache"), *extra]


def _run_main(argv: list[str]) -> int:
    from megatron_xdistill.training.run import main

    return main(argv)


def refusal(argv: list[str], world: int = WORLD) -> str:
    """The one message ``pretrain_xdistill.py`` refuses ``argv`` with, from the checks it makes
    before anything is built (what rank 0 prints; its ranks then exit with code 2)."""
    from megatron_xdistill.training.arguments.checks import parse_args
    from megatron_xdistill.training.preflight import check_model_shapes, run_preflight
    from megatron_xdistill.training.user_errors import InputError

    args = parse_args(argv, world)
    with pytest.raises(InputError) as err:
        run_preflight(args, check_model_shapes(args))
    return str(err.value)


def _process_group_count() -> int:
    import torch.distributed as dist

    return len(dist.distributed_c10d._world.pg_map)


def _losses(root: Path, name: str) -> list[tuple[float, float]]:
    records = [json.loads(x) for x in (root / f"{name}.jsonl").read_text().splitlines()]
    return [(r["kd"], r["ce"]) for r in records if "kd" in r]


LAYOUTS = {
    "student_tp2_sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "student_pp2_recompute_teacher_tp2_sp": ["--pipeline-model-parallel-size", "2",
                                             "--recompute-granularity", "full",
                                             "--recompute-method", "uniform",
                                             "--recompute-num-layers", "1",
                                             "--teacher-tensor-model-parallel-size", "2",
                                             "--teacher-sequence-parallel"],
    # CP x PP on both sides: pipeline messages carry this CP rank's part of the sequence.
    "student_cp2_pp2_teacher_cp2_pp2": ["--context-parallel-size", "2",
                                        "--pipeline-model-parallel-size", "2",
                                        "--teacher-context-parallel-size", "2",
                                        "--teacher-pipeline-model-parallel-size", "2"],
    "student_tp2_teacher_pp2": ["--tensor-model-parallel-size", "2",
                                "--teacher-pipeline-model-parallel-size", "2"],
    "student_pp2_dp2_distopt_teacher_tp2": ["--pipeline-model-parallel-size", "2",
                                            "--use-distributed-optimizer",
                                            "--teacher-tensor-model-parallel-size", "2"],
    # Megatron-Core DDP's overlapped gradient reduce and parameter gather (bucket by bucket)
    # (small buckets: several per model, so each is reduced / gathered on its own)
    "student_dp4_distopt_overlap": ["--use-distributed-optimizer", "--overlap-grad-reduce",
                                    "--overlap-param-gather", "--ddp-bucket-size", "200000"],
    "student_pp2_dp2_overlap_grad_reduce": ["--pipeline-model-parallel-size", "2",
                                            "--overlap-grad-reduce", "--ddp-bucket-size",
                                            "200000"],
}


#: Every run that evaluates does it as the reference run: the training file, one global batch,
#: after every step (and before the first).
EVAL_EVERY_STEP = ["--eval-interval", "1", "--eval-iters", "1"]


def reference_losses(root: Path, s_tok: Path, t_tok: Path) -> list[tuple[float, float]]:
    """The single-rank (colocated) run's first losses: what every layout must reproduce. The run
    also evaluates after every step (:func:`_evals`; evaluation leaves training unchanged)."""
    with RankPool(1) as pool:
        pool.run(_run_main, _argv(root, s_tok, t_tok, "ref", [
            "--valid-data-path", str(root / "train.jsonl"), *EVAL_EVERY_STEP]))
    return _losses(root, "ref")


def _evals(root: Path, name: str) -> dict[int, float]:
    """Held-out CE by iteration of a run's metrics file."""
    records = [json.loads(x) for x in (root / f"{name}.jsonl").read_text().splitlines()]
    return {r["iteration"]: r["eval_ce"] for r in records if "eval_ce" in r}


def assert_losses_match(got: list, reference: list, name: str) -> None:
    """Every step's (kd, ce) equals the reference's (rel RTOL)."""
    assert len(got) == len(reference) == STEPS, name
    for step, ((kd, ce), (kd_ref, ce_ref)) in enumerate(zip(got, reference), 1):
        assert kd == pytest.approx(kd_ref, rel=RTOL), f"{name} step {step} kd"
        assert ce == pytest.approx(ce_ref, rel=RTOL), f"{name} step {step} ce"


# In `make test-slow` for the suite's 30-minute budget: the recompute layout (26 s; activation
# recomputation is checked against the unsharded model in test_megatron_base).
SLOW_LAYOUTS = {"student_pp2_recompute_teacher_tp2_sp"}


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=pytest.mark.slow) if name in SLOW_LAYOUTS else name
    for name in LAYOUTS])
def test_first_steps_match_reference(e2e_setup, e2e_reference, e2e_pool, name):
    root, s_tok, t_tok = e2e_setup
    groups_before = e2e_pool.run(_process_group_count)
    e2e_pool.run(_run_main, _argv(root, s_tok, t_tok, name, LAYOUTS[name]))
    assert_losses_match(_losses(root, name), e2e_reference, name)
    # The ranks live on (a pool): the run itself released its shared-memory payload slots and
    # its process groups (each gloo group keeps threads and sockets).
    assert not glob.glob("/dev/shm/xdistill_*"), "shared memory left behind by the run"
    assert e2e_pool.run(_process_group_count) == groups_before, "process groups left behind"


@pytest.mark.slow  # 80 s; Gemma 3's numerics are checked by the conversion tests by default
def test_gemma3_teacher_in_parallel_layouts_matches_single_rank(e2e_setup, e2e_pool, tmp_path):
    """A Gemma 3 teacher (262k SentencePiece vocabulary with byte fallback and <bos>; sliding
    and global layers with their own RoPE) in TP2 x CP2 with the student at PP2 x DP2 gives the
    single-rank run's losses."""
    import shutil

    from megatron_xdistill.projection import BuildOptions, build_projection, save_projection
    from megatron_xdistill.testing.tiny_models import make_tiny_model

    root, s_tok, _ = e2e_setup
    g_tok = ASSETS / "tokenizers" / "gemma3"
    (tmp_path / "student").symlink_to(root / "student")
    shutil.copy(root / "train.jsonl", tmp_path / "train.jsonl")
    hf = make_tiny_model("gemma3", str(tmp_path / "teacher_hf"), seed=5)
    with RankPool(1) as pool:
        pool.run(_convert, hf, str(tmp_path / "teacher"))
    save_projection(build_projection(str(s_tok), str(g_tok), BuildOptions()),
                    str(tmp_path / "proj.safetensors"))
    reference = reference_losses(tmp_path, s_tok, g_tok)
    assert all(kd > 0.05 for kd, _ in reference), reference  # a teacher worth matching
    layout = ["--pipeline-model-parallel-size", "2", "--teacher-tensor-model-parallel-size", "2",
              "--teacher-context-parallel-size", "2"]
    e2e_pool.run(_run_main, _argv(tmp_path, s_tok, g_tok, "gemma_layout", layout))
    assert_losses_match(_losses(tmp_path, "gemma_layout"), reference, "gemma3 teacher")


def test_resume_matches_uninterrupted_run(e2e_setup, e2e_pool, tmp_path):
    root, s_tok, t_tok = e2e_setup
    extra = ["--tensor-model-parallel-size", "2", "--save-interval", "1"]
    e2e_pool.run(_run_main, _argv(root, s_tok, t_tok, "full", extra + ["--save", str(tmp_path / "full")]))
    keep = ["--keep-last-checkpoints", "1"]  # the resumed run keeps its newest checkpoint only
    e2e_pool.run(_run_main, _argv(root, s_tok, t_tok, "part",
                                  extra + keep + ["--save", str(tmp_path / "part"),
                                                  "--exit-interval", "1"]))
    shutil.copytree(tmp_path / "part", tmp_path / "fresh_optimizer")
    e2e_pool.run(_run_main, _argv(root, s_tok, t_tok, "part",
                                  extra + keep + ["--save", str(tmp_path / "part")]))
    assert _losses(root, "part") == _losses(root, "full")
    assert sorted(p.name for p in (tmp_path / "part").glob("iter_*")) == ["iter_0000003"]
    assert sorted(p.name for p in (tmp_path / "full").glob("iter_*")) == [
        "iter_0000001", "iter_0000002", "iter_0000003"]
    # --no-load-optim / --no-load-rng (Megatron-LM's): the weights and the data position resume
    # (step 2's loss, taken before its update, is the uninterrupted run's), Adam and the LR
    # schedule start afresh (step 3 differs).
    e2e_pool.run(_run_main, _argv(root, s_tok, t_tok, "fresh_optimizer",
                                  extra + ["--save", str(tmp_path / "fresh_optimizer"),
                                           "--no-load-optim", "--no-load-rng"]))
    fresh, full = _losses(root, "fresh_optimizer"), _losses(root, "full")
    assert len(fresh) == 2 and fresh[0] == full[1] and fresh[1] != full[2]
    assert (tmp_path / "full" / "hf_files" / "config.json").is_file()  # export needs no template
    # What Megatron-LM's loader reads from the common state: args that describe the student,
    # the format version, the iteration and the LR schedule under its own key.
    from megatron.core import dist_checkpointing

    from megatron_xdistill.models import load_model_info
    from megatron_xdistill.models.megatron_lm import model_info_from_megatron_args

    common = dist_checkpointing.load_common_state_dict(str(tmp_path / "full" / "iter_0000003"))
    assert common["checkpoint_version"] == 3.0 and common["iteration"] == 3
    assert "opt_param_scheduler" in common
    assert common["args"].tensor_model_parallel_size == 2
    assert common["args"].consumed_train_samples == 3 * 4
    back = model_info_from_megatron_args(common["args"], "full")
    student = load_model_info(str(root / "student"))
    assert (back.num_layers, back.hidden_size, back.num_query_groups, back.tie_word_embeddings) \
        == (student.num_layers, student.hidden_size, student.num_query_groups,
            student.tie_word_embeddings)


def _lrs(root: Path, name: str) -> dict[int, float]:
    records = [json.loads(x) for x in (root / f"{name}.jsonl").read_text().splitlines()]
    return {r["iteration"]: r["lr"] for r in records if "lr" in r}


def test_a_resumed_run_with_another_schedule_follows_the_flag_or_is_refused(e2e_setup, e2e_pool,
                                                                            tmp_path):
    """A cosine run of 2 iterations, resumed with --train-iters 3 (its decay now spans 3: the
    learning-rate schedule differs from the checkpoint's). Without a flag it is refused before
    anything is built, naming the field and both of Megatron-LM's flags (it used to train
    iteration 3 at the old schedule's end, lr 0, without a word);
    --override-opt_param-scheduler trains iteration 3 at the 3-iteration cosine's lr (closed
    form), --use-checkpoint-opt_param-scheduler at the checkpoint's min lr, as asked."""
    import math

    root, s_tok, t_tok = e2e_setup
    saved = tmp_path / "run"
    e2e_pool.run(_run_main, _argv(root, s_tok, t_tok, "sched_first", [
        "--train-iters", "2", "--save", str(saved)]))
    assert _lrs(root, "sched_first") == {1: pytest.approx(1e-3), 2: pytest.approx(5e-4)}
    shutil.copytree(saved, tmp_path / "kept")
    longer = ["--train-iters", "3", "--save", str(saved)]
    argv = _argv(root, s_tok, t_tok, "sched_refused", longer)
    assert e2e_pool.run(_run_main, argv) == [2] * WORLD
    assert not (root / "sched_refused.jsonl").exists()  # refused before anything ran
    from megatron_xdistill.training.arguments.checks import parse_args
    from megatron_xdistill.training.preflight import check_resume

    with pytest.raises(ValueError, match=r"(?s)--save .*run: the learning-rate schedule .*"
                       r"decay_steps: checkpoint 8 samples \(2 iterations\), arguments 12 "
                       r"samples \(3 iterations\).*--override-opt_param-scheduler.*"
                       r"--use-checkpoint-opt_param-scheduler"):
        check_resume(parse_args(argv, WORLD))

    e2e_pool.run(_run_main, _argv(root, s_tok, t_tok, "sched_override",
                                  longer + ["--override-opt_param-scheduler"]))
    cosine_at_2_of_3 = 1e-3 * 0.5 * (1 + math.cos(math.pi * 2 / 3))
    assert _lrs(root, "sched_override") == {3: pytest.approx(cosine_at_2_of_3, rel=1e-9)}
    e2e_pool.run(_run_main, _argv(root, s_tok, t_tok, "sched_kept", [
        "--train-iters", "3", "--save", str(tmp_path / "kept"),
        "--use-checkpoint-opt_param-scheduler"]))
    assert _lrs(root, "sched_kept") == {3: 0.0}


@pytest.mark.parametrize("precision", [["--bf16"], ["--fp16", "--initial-loss-scale", "1024"]],
                         ids=["bf16", "fp16"])
def test_sixteen_bit_runs_follow_the_reference_save_and_resume(e2e_setup, e2e_reference,
                                                               e2e_pool, tmp_path, precision):
    """--bf16, and --fp16 with Megatron-Core's loss scaling: each step's losses are the fp32
    reference's to 16-bit precision, no step overflows at a scale of 1024, and a run stopped
    after step 1 and resumed gives the uninterrupted run's losses exactly (every --bf16 save
    failed before: the norms' weights stayed fp32, which Megatron's 16-bit optimizer does not
    checkpoint)."""
    root, s_tok, t_tok = e2e_setup
    name = precision[0][2:]
    e2e_pool.run(_run_main, _argv(root, s_tok, t_tok, f"{name}_whole",
                                  [*precision, "--save", str(tmp_path / "whole")]))
    part = [*precision, "--save", str(tmp_path / "part"), "--save-interval", "1"]
    e2e_pool.run(_run_main, _argv(root, s_tok, t_tok, f"{name}_part",
                                  part + ["--exit-interval", "1"]))
    e2e_pool.run(_run_main, _argv(root, s_tok, t_tok, f"{name}_part", part))
    whole = _losses(root, f"{name}_whole")
    assert _losses(root, f"{name}_part") == whole
    assert len(whole) == STEPS
    for step, ((kd, ce), (kd_ref, ce_ref)) in enumerate(zip(whole, e2e_reference), 1):
        assert kd == pytest.approx(kd_ref, rel=2e-2), f"{name} step {step} kd"
        assert ce == pytest.approx(ce_ref, rel=2e-3), f"{name} step {step} ce"
    records = [json.loads(x) for x in (root / f"{name}_whole.jsonl").read_text().splitlines()]
    assert all(r["skipped"] == 0 for r in records if "skipped" in r)
    if name == "fp16":
        assert [r["loss_scale"] for r in records if "loss_scale" in r] == [1024.0] * STEPS


def test_fp16_overflowing_steps_are_skipped_without_advancing_the_schedule(e2e_setup, e2e_pool):
    """--fp16 at Megatron-LM's first loss scale (2^32): the scaled gradients overflow, every
    step is skipped, the learning rate stays where the schedule starts (a skipped step does not
    advance it, as in Megatron-LM) and the scale backs off once the hysteresis (2) is spent."""
    root, s_tok, t_tok = e2e_setup
    e2e_pool.run(_run_main, _argv(root, s_tok, t_tok, "fp16_overflow", ["--fp16"]))
    records = [json.loads(x) for x in (root / "fp16_overflow.jsonl").read_text().splitlines()]
    steps = [r for r in records if "skipped" in r]
    assert [r["skipped"] for r in steps] == [1] * STEPS
    assert [r["lr"] for r in steps] == [1e-3] * STEPS
    assert [r["loss_scale"] for r in steps] == [2.0 ** 32, 2.0 ** 31, 2.0 ** 30]


@pytest.mark.slow  # 38 s, for the suite's 30-minute budget (resume: the test above)
def test_resume_into_another_layout_with_the_distributed_optimizer(e2e_setup, e2e_reference,
                                                                   e2e_pool, tmp_path):
    """A run saved at TP1 PP1 DP4 (distributed optimizer: Adam's state sharded over DP) resumes
    at TP2 PP2 DP1 and continues with the uninterrupted single-rank run's losses."""
    root, s_tok, t_tok = e2e_setup
    save = ["--save", str(tmp_path / "relayout"), "--save-interval", "1", "--use-distributed-optimizer"]
    e2e_pool.run(_run_main, _argv(root, s_tok, t_tok, "relayout", save + ["--exit-interval", "1"]))
    e2e_pool.run(_run_main, _argv(root, s_tok, t_tok, "relayout",
                                  save + ["--tensor-model-parallel-size", "2",
                                          "--pipeline-model-parallel-size", "2"]))
    assert_losses_match(_losses(root, "relayout"), e2e_reference, "resumed in another layout")


def test_ce_only_runs_no_teacher_and_trains_like_a_negligible_kd_weight(e2e_setup, e2e_pool):
    """--kd-weight 0 skips the teacher (not loaded, not run) and needs no projection; the
    student's CE per step equals a run that computes the teacher and KD but weighs it by 1e-30
    (below fp32 resolution)."""
    root, s_tok, t_tok = e2e_setup
    extra = ["--tensor-model-parallel-size", "2", "--ce-weight", "1.0"]
    argv = _argv(root, s_tok, t_tok, "ce_only", extra + ["--kd-weight", "0"])
    at = argv.index("--projection-path")
    del argv[at: at + 2]
    e2e_pool.run(_run_main, argv)
    e2e_pool.run(_run_main, _argv(root, s_tok, t_tok, "kd_tiny", extra + ["--kd-weight", "1e-30"]))
    ce_only, kd_tiny = _losses(root, "ce_only"), _losses(root, "kd_tiny")
    assert len(ce_only) == len(kd_tiny) == STEPS
    for step, ((kd, ce), (kd_ref, ce_ref)) in enumerate(zip(ce_only, kd_tiny), 1):
        assert ce == pytest.approx(ce_ref, rel=RTOL), f"step {step} ce"
        assert kd is None and kd_ref is not None, "CE alone reports no KD value (null)"
    records = [json.loads(x) for x in (root / "ce_only.jsonl").read_text().splitlines()]
    steps = [r for r in records if "kd" in r]
    assert steps and all(r["shipped_bytes_per_token"] == 0 and r["time_teacher"] == 0
                         and r["payload_bytes_per_token"] == 0 for r in steps)
    assert not any("teacher_fill" in r for r in steps), "no teacher ran: no fill to report"


def test_samples_per_epoch_repeats_the_plan(e2e_setup, e2e_reference, e2e_pool):
    """--samples-per-epoch 4 (one global batch) and --lr 0: every step trains on the same four
    samples with the same weights, so each step's losses are the reference's first step (a plan
    of train-iters x global-batch samples would show new text at steps 2 and 3)."""
    root, s_tok, t_tok = e2e_setup
    e2e_pool.run(_run_main, _argv(root, s_tok, t_tok, "one_sample_epoch", [
        "--samples-per-epoch", "4", "--lr", "0", "--tensor-model-parallel-size", "2"]))
    losses = _losses(root, "one_sample_epoch")
    assert len(losses) == STEPS
    for step, (kd, ce) in enumerate(losses, 1):
        assert kd == pytest.approx(e2e_reference[0][0], rel=RTOL), f"step {step} kd"
        assert ce == pytest.approx(e2e_reference[0][1], rel=RTOL), f"step {step} ce"
    assert e2e_reference[1] != pytest.approx(e2e_reference[0], rel=1e-3)  # new text differs


@pytest.mark.slow
def test_ray_launcher_matches_torchrun(e2e_setup):
    """xdistill-ray on a two-node local Ray cluster gives torchrun's losses (world size 4)."""
    pytest.importorskip("ray", reason="Ray is not installed")
    from ray_entry_harness import REPO, local_cluster, run_ray, run_torchrun

    from megatron_xdistill.launch import DEFAULT_ENTRY_POINT

    root, s_tok, t_tok = e2e_setup
    extra = ["--tensor-model-parallel-size", "2"]
    ref = run_torchrun([REPO / "pretrain_xdistill.py", *_argv(root, s_tok, t_tok, "torchrun", extra)],
                       nproc=4)
    assert ref.returncode == 0, ref.stderr
    with local_cluster():
        got = run_ray(_argv(root, s_tok, t_tok, "ray", extra), entry_point=DEFAULT_ENTRY_POINT)
    assert got.code == 0, got.err
    assert _losses(root, "ray") == _losses(root, "torchrun")


def test_teacher_length_is_derived_from_the_data(e2e_setup, e2e_pool):
    """Without --teacher-seq-length the run measures the tokenizers' ratio on its data and
    sizes the teacher sample to it; every step reports the teacher's fill (positions needed
    over positions run)."""
    root, s_tok, t_tok = e2e_setup
    argv = _argv(root, s_tok, t_tok, "derived_length", ["--tensor-model-parallel-size", "2",
                                                         "--train-iters", "2"])
    at = argv.index("--teacher-seq-length")
    del argv[at: at + 2]
    e2e_pool.run(_run_main, argv)
    fills = _fills(root, "derived_length")
    assert len(fills) == 2 and all(0.8 <= f <= 1.0 for f in fills), fills


def _fills(root: Path, name: str) -> list[float]:
    records = [json.loads(x) for x in (root / f"{name}.jsonl").read_text().splitlines()]
    return [r["teacher_fill"] for r in records if "kd" in r]


def test_the_teacher_runs_only_the_positions_its_text_needs(e2e_setup, e2e_reference, e2e_pool):
    """A teacher sample three times wider than the text (--teacher-seq-length 120 instead of
    the reference's 40) costs nothing: each teacher micro-batch runs as many positions as its
    longest sample needs (here rounded up to 2 for TP2 sequence parallelism), so the run trains
    like the reference and the teacher's fill (positions needed over positions run) stays near
    1 (a full-width forward filled about a third)."""
    root, s_tok, t_tok = e2e_setup
    argv = _argv(root, s_tok, t_tok, "wide_teacher", ["--teacher-tensor-model-parallel-size",
                                                       "2", "--teacher-sequence-parallel"])
    argv[argv.index("--teacher-seq-length") + 1] = "120"
    e2e_pool.run(_run_main, argv)
    assert_losses_match(_losses(root, "wide_teacher"), e2e_reference, "teacher 120 wide")
    assert _fills(root, "ref") == [1.0] * STEPS  # one sample a micro-batch, no rounding
    assert all(0.95 <= f <= 1.0 for f in _fills(root, "wide_teacher")), \
        _fills(root, "wide_teacher")


def _saved_parameters(path: str) -> tuple[dict, dict]:
    """The model's weights in the training checkpoint ``path`` and the optimizer's own copy of
    them (Megatron-Core's model-space keys ``optimizer.state.param.NAME``), read whole in this
    process (no torch.distributed world)."""
    import warnings

    import torch
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = FileSystemReader(path)
    tensors = {k: torch.empty(m.size, dtype=m.properties.dtype)
               for k, m in reader.read_metadata().state_dict_metadata.items()
               if isinstance(m, TensorStorageMetadata)}
    with warnings.catch_warnings():  # "torch.distributed is disabled ...": meant so here
        warnings.simplefilter("ignore", UserWarning)
        load(tensors, storage_reader=reader, no_dist=True)
    prefix = "optimizer.state.param."
    optimizer = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
    return {k: tensors[k] for k in optimizer}, optimizer


@pytest.mark.slow  # 40 s; in make test-slow for the suite's 30-minute budget
def test_overlapped_parameter_gather_evaluates_saves_and_resumes(e2e_setup, e2e_reference,
                                                                  e2e_pool, tmp_path):
    """With --overlap-param-gather a rank's optimizer step updates only its own shard of each
    bucket; the other ranks' shards arrive bucket by bucket during the next training forward.
    Evaluation and saves gather them whole first (StudentSide.whole_parameters), as Megatron-LM
    does. The run evaluates before step 1 and straight after the optimizer steps 2 and 3, saves
    after every step, stops after step 1 and resumes: its losses and evaluations are the
    single-rank reference's, and every checkpoint's model weights are the optimizer's own
    parameters. The checkpoint of step 1 follows its optimizer step with no forward between
    them, so only the save's own gather completes the shards of the other ranks (without it the
    saved embedding keeps 3/4 of its step-0 values: a model-only load, an export or
    --no-load-optim would read them; a resume does not, it restores the optimizer's copy)."""
    from megatron_xdistill.models.description import iteration_dir

    root, s_tok, t_tok = e2e_setup
    run = tmp_path / "overlap_run"
    common = ["--use-distributed-optimizer", "--valid-data-path", str(root / "train.jsonl"),
              "--eval-interval", "2", "--eval-iters", "1", "--overlap-grad-reduce",
              "--overlap-param-gather", "--ddp-bucket-size", "200000", "--save", str(run),
              "--save-interval", "1"]
    e2e_pool.run(_run_main, _argv(root, s_tok, t_tok, "overlap_run",
                                  common + ["--exit-interval", "1"]))
    e2e_pool.run(_run_main, _argv(root, s_tok, t_tok, "overlap_run", common))
    assert_losses_match(_losses(root, "overlap_run"), e2e_reference, "overlapped, resumed")
    got, want = _evals(root, "overlap_run"), _evals(root, "ref")
    assert sorted(got) == [0, 2, STEPS] and sorted(want) == list(range(STEPS + 1))
    for step in got:
        assert got[step] == pytest.approx(want[step], rel=RTOL), f"eval after step {step}"
    for step in range(1, STEPS + 1):
        model, optimizer = _saved_parameters(iteration_dir(str(run), step))
        assert len(model) == 8, sorted(model)  # embedding, final norm, 6 stacked layer weights
        for name, weight in model.items():
            assert weight.equal(optimizer[name]), f"checkpoint {step}: saved {name} is stale"


@pytest.mark.slow  # 36 s; --split's ranges and refusals stay in the default run (test_data)
def test_split_trains_and_evaluates_the_parts_megatron_would(e2e_setup, e2e_pool):
    """``--split 75,25`` of one file trains and evaluates exactly like the two files holding
    Megatron's parts of it (documents [0, round(0.75 n)) and the rest) given as --data-path and
    --valid-data-path."""
    root, s_tok, t_tok = e2e_setup
    lines = (ASSETS / "corpora" / "enwiki_val.jsonl").read_text().splitlines()
    texts = [json.loads(x)["text"][:3000] for x in lines if json.loads(x)["text"].strip()][:8]
    cut = round(0.75 * len(texts))

    def jsonl(name: str, docs: list[str]) -> str:
        path = root / name
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
        return str(path)

    whole, train, valid = (jsonl("split_all.jsonl", texts), jsonl("split_train.jsonl", texts[:cut]),
                           jsonl("split_valid.jsonl", texts[cut:]))
    steps = ["--train-iters", "2", *EVAL_EVERY_STEP]
    e2e_pool.run(_run_main, _argv(root, s_tok, t_tok, "split", [
        "--data-path", whole, "--split", "75,25", *steps]))
    e2e_pool.run(_run_main, _argv(root, s_tok, t_tok, "split_files", [
        "--data-path", train, "--valid-data-path", valid, *steps]))
    assert len(_losses(root, "split")) == 2
    assert _losses(root, "split") == _losses(root, "split_files")
    assert sorted(_evals(root, "split")) == [0, 1, 2]
    assert _evals(root, "split") == _evals(root, "split_files")
