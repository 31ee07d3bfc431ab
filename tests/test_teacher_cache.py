"""Teacher payload cache end to end: runs that read a cache train exactly like the online runs.

Setup and reference as test_e2e (tiny converted models, real SmolLM2 / Qwen2 tokenizers). An
online run fills the cache as it trains; runs in two student layouts read it without the teacher
(no --teacher-load) and reproduce the online losses of the same layout (rel 1e-6); a teacher-only
pass in another teacher layout, interrupted and resumed, fills an equal cache; runs configured
differently are refused naming the field. Compact gold / H-KL (``--kd-loss hkl`` ships it by
default: ``--kd-gold-topk 64 --kd-gold-uncommon-topk 256``) through the cache and through a
disaggregated teacher's transport.
"""

from __future__ import annotations

import json
import re

import pytest
from scratch import scratch_dir
from test_e2e import STEPS, _argv, _losses, _run_main, assert_losses_match, refusal

from megatron_xdistill.loss.definitions.common import UNCOMMON_TOPK

EXACT = 1e-6
STUDENT_TP2 = ["--tensor-model-parallel-size", "2"]
STUDENT_PP2_DP2 = ["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer"]


def _reader_argv(root, s_tok, t_tok, name, extra):
    """A run that reads the cache: no teacher checkpoint at all."""
    argv = _argv(root, s_tok, t_tok, name, extra)
    at = argv.index("--teacher-load")
    del argv[at: at + 2]
    return argv


def _same(got, want, name, rel=EXACT):
    assert len(got) == len(want) == STEPS, name
    for step, ((kd, ce), (kd_ref, ce_ref)) in enumerate(zip(got, want), 1):
        assert kd == pytest.approx(kd_ref, rel=rel), f"{name} step {step} kd"
        assert ce == pytest.approx(ce_ref, rel=rel), f"{name} step {step} ce"


@pytest.fixture(scope="module")
def online_cache(e2e_setup, e2e_reference, e2e_pool, request, tmp_path_factory):
    """An online run (student TP2) that fills the cache as it trains: (cache, its losses)."""
    root, s_tok, t_tok = e2e_setup
    cache = scratch_dir(request, tmp_path_factory, "teacher_cache") / "online"
    e2e_pool.run(_run_main, _argv(root, s_tok, t_tok, "cache_online_tp2",
                                  STUDENT_TP2 + ["--teacher-cache", str(cache)]))
    losses = _losses(root, "cache_online_tp2")
    assert_losses_match(losses, e2e_reference, "online run that writes the cache")
    return cache, losses


def test_online_run_completes_the_cache(online_cache):
    cache, _ = online_cache
    manifest = json.loads((cache / "manifest.json").read_text())
    assert manifest["complete"] and manifest["num_samples"] == STEPS * 4
    assert manifest["key"]["payload"]["form"] == "chunk_topk"
    assert manifest["key"]["payload"]["topk"] == 16


def test_reading_the_cache_reproduces_the_online_run(e2e_setup, e2e_pool, online_cache):
    root, s_tok, t_tok = e2e_setup
    cache, online_tp2 = online_cache
    e2e_pool.run(_run_main, _reader_argv(root, s_tok, t_tok, "cache_read_tp2",
                                         STUDENT_TP2 + ["--teacher-cache", str(cache)]))
    _same(_losses(root, "cache_read_tp2"), online_tp2, "read, student TP2")
    records = [json.loads(x) for x in (root / "cache_read_tp2.jsonl").read_text().splitlines()]
    assert all(r["time_teacher"] == 0 for r in records if "kd" in r)  # no teacher ran


@pytest.mark.slow  # 30 s, for the suite's 30-minute budget (the default run reads at TP2)
def test_reading_the_cache_in_another_layout(e2e_setup, e2e_pool, online_cache):
    root, s_tok, t_tok = e2e_setup
    cache, _ = online_cache
    e2e_pool.run(_run_main, _argv(root, s_tok, t_tok, "online_pp2_dp2", STUDENT_PP2_DP2))
    e2e_pool.run(_run_main, _reader_argv(root, s_tok, t_tok, "cache_read_pp2_dp2",
                                         STUDENT_PP2_DP2 + ["--teacher-cache", str(cache)]))
    _same(_losses(root, "cache_read_pp2_dp2"), _losses(root, "online_pp2_dp2"),
          "read, student PP2 x DP2 with the distributed optimizer")


def test_teacher_only_pass_interrupted_and_resumed(e2e_setup, e2e_pool, online_cache,
                                                  tmp_path):
    """--teacher-cache-only in the teacher's TP2 x DP2 layout, stopped after one step and rerun
    without --load (no student is built: none is needed): it resumes at step 2 (the cache's key
    is the same without the student's checkpoint) and completes a cache whose readers train
    like the online run."""
    root, s_tok, t_tok = e2e_setup
    cache = tmp_path / "filled"
    fill = _argv(root, s_tok, t_tok, "unused", ["--teacher-cache", str(cache),
                                                "--teacher-cache-only",
                                                "--teacher-tensor-model-parallel-size", "2"])
    e2e_pool.run(_run_main, fill + ["--exit-interval", "1"])
    manifest = json.loads((cache / "manifest.json").read_text())
    assert not manifest["complete"]
    held = sorted(p.name for p in (cache / "shards").iterdir())
    assert held and all(name.endswith(".arrow") for name in held)
    at = fill.index("--load")
    assert e2e_pool.run(_run_main, fill[:at] + fill[at + 2:]) == [0] * 4
    assert json.loads((cache / "manifest.json").read_text())["complete"]
    e2e_pool.run(_run_main, _reader_argv(root, s_tok, t_tok, "cache_read_filled",
                                         STUDENT_TP2 + ["--teacher-cache", str(cache)]))
    # The teacher ran at TP2 here and at TP1 online: equal up to reduction order.
    assert_losses_match(_losses(root, "cache_read_filled"), online_cache[1], "teacher-only pass")


def test_epochs_over_the_cache(e2e_setup, e2e_pool, online_cache):
    """Twice the cache's steps at --lr 0: the second pass reads the same payloads for the same
    samples (steps 4..6 equal steps 1..3) and the first step is the online run's. A
    --samples-per-epoch that differs from the cache's plan is refused with both sizes."""
    root, s_tok, t_tok = e2e_setup
    cache, online_tp2 = online_cache
    held = STEPS * 4
    argv = _reader_argv(root, s_tok, t_tok, "cache_two_epochs", STUDENT_TP2 + [
        "--teacher-cache", str(cache), "--samples-per-epoch", str(held), "--lr", "0"])
    argv[argv.index("--train-iters") + 1] = str(2 * STEPS)
    e2e_pool.run(_run_main, argv)
    losses = [value for step in _losses(root, "cache_two_epochs") for value in step]  # kd, ce
    assert len(losses) == 2 * 2 * STEPS
    assert losses[:2] == pytest.approx(online_tp2[0], rel=EXACT)
    assert losses[2 * STEPS:] == pytest.approx(losses[:2 * STEPS], rel=EXACT)
    assert losses[2:4] != pytest.approx(losses[:2], rel=1e-3)  # each step of a pass is new text
    argv[argv.index("--samples-per-epoch") + 1] = str(held - 4)
    assert e2e_pool.run(_run_main, argv) == [2] * 4  # refused before anything is built
    assert re.search(f"--samples-per-epoch {held - 4} differs from the plan of the complete "
                     f"teacher cache .* \\({held} samples\\)", refusal(argv))


def test_a_cache_filled_over_several_epochs_holds_each_sample_once(e2e_setup, e2e_reference,
                                                                  e2e_pool, tmp_path):
    """An online run over three passes of a one-batch plan (--samples-per-epoch 4) and a
    teacher-only pass for that plan each leave a complete cache of the 4 samples, each row
    once; a run reading it at --lr 0 sees the reference's first batch at every step."""
    import pyarrow as pa

    root, s_tok, t_tok = e2e_setup
    epochs = ["--samples-per-epoch", "4"]
    online, filled = tmp_path / "online", tmp_path / "filled"
    e2e_pool.run(_run_main, _argv(root, s_tok, t_tok, "unused_online", STUDENT_TP2 + epochs + [
        "--teacher-cache", str(online), "--teacher-cache-commit-seconds", "1e-9"]))  # a shard a row
    e2e_pool.run(_run_main, _argv(root, s_tok, t_tok, "unused_fill", epochs + [
        "--teacher-cache", str(filled), "--teacher-cache-only"]))
    for cache in (online, filled):
        manifest = json.loads((cache / "manifest.json").read_text())
        assert manifest["complete"] and manifest["num_samples"] == 4
        ids = [i for shard in sorted((cache / "shards").iterdir())
               for i in pa.ipc.open_file(shard).read_all().column("sample").to_pylist()]
        assert sorted(ids) == [0, 1, 2, 3], f"{cache.name}: rows {ids}"
    e2e_pool.run(_run_main, _reader_argv(root, s_tok, t_tok, "cache_read_epochs", STUDENT_TP2
                                         + epochs + ["--teacher-cache", str(filled), "--lr", "0"]))
    for step, (kd, ce) in enumerate(_losses(root, "cache_read_epochs"), 1):
        assert (kd, ce) == pytest.approx(e2e_reference[0], rel=1e-5), f"step {step}"


def test_a_smaller_chunk_topk_reads_the_cache(e2e_setup, e2e_pool, online_cache):
    """A run at --kd-topk 8 reads the top-16 cache (each chunk's first 8 columns, the rest in
    the tail) and trains like the online top-8 run (the tail's sum order differs: rel 1e-5)."""
    root, s_tok, t_tok = e2e_setup
    cache, _ = online_cache
    top8 = STUDENT_TP2 + ["--kd-topk", "8"]
    e2e_pool.run(_run_main, _argv(root, s_tok, t_tok, "online_top8", top8))
    e2e_pool.run(_run_main, _reader_argv(root, s_tok, t_tok, "cache_read_top8",
                                         top8 + ["--teacher-cache", str(cache)]))
    _same(_losses(root, "cache_read_top8"), _losses(root, "online_top8"), "top-8 from top-16",
          rel=1e-5)


@pytest.mark.parametrize("change,field", [
    (["--kd-temperature", "2.0"], "payload.temperature: cache 1.0, this run 2.0"),
    (["--kd-topk", "32"], "payload.topk: cache 16, this run 32"),  # more than it holds
    pytest.param(["--teacher-seq-length", "48"], "data.teacher_seq_length: cache 40, this run 48",
                 marks=pytest.mark.slow),  # 37 s; the refusal by field stays in the default run
    pytest.param(["--bf16"], "teacher.precision: cache 'fp32', this run 'bf16'",
                 marks=pytest.mark.slow),  # 31 s; for the suite's 30-minute budget
])
def test_a_differently_configured_run_is_refused(e2e_setup, e2e_pool, online_cache, change,
                                                field):
    root, s_tok, t_tok = e2e_setup
    cache, _ = online_cache
    argv = _reader_argv(root, s_tok, t_tok, "refused",
                        STUDENT_TP2 + ["--teacher-cache", str(cache), *change])
    assert e2e_pool.run(_run_main, argv) == [2] * 4  # refused before anything is built
    message = refusal(argv)
    assert "made for another configuration" in message and field in message


# ----------------------------------------------------------------- compact gold / H-KL
HKL = ["--kd-loss", "hkl"]


@pytest.fixture(scope="module")
def compact_online(e2e_setup, e2e_pool, request, tmp_path_factory):
    """A colocated compact H-KL run that fills a teacher cache as it trains: (cache, losses)."""
    root, s_tok, t_tok = e2e_setup
    cache = scratch_dir(request, tmp_path_factory, "gold_topk_cache") / "online"
    e2e_pool.run(_run_main, _argv(root, s_tok, t_tok, "hkl_online",
                                  HKL + ["--teacher-cache", str(cache)]))
    return cache, _losses(root, "hkl_online")


def test_the_cache_holds_the_compact_payload_and_reproduces_the_run(e2e_setup, e2e_pool,
                                                                   compact_online):
    root, s_tok, t_tok = e2e_setup
    cache, losses = compact_online
    key = json.loads((cache / "manifest.json").read_text())["key"]["payload"]
    assert key["form"] == "gold_topk"
    k, k_unc, span, pairs = key["gold_topk"]
    assert (k, k_unc, span) == (64, 256, UNCOMMON_TOPK) and pairs > k
    chunks = 32 + 1  # a chunk slot per student position (--seq-length 32)
    assert key["numel"] == chunks * (2 * k + k_unc + 3)
    assert all(kd > 0 for kd, _ in losses)
    records = [json.loads(x) for x in (root / "hkl_online.jsonl").read_text().splitlines()]
    shipped = [r["payload_bytes_per_token"] for r in records if "payload_bytes_per_token" in r]
    assert shipped and all(b == pytest.approx(4 * key["numel"] / 32, abs=0.1) for b in shipped)
    e2e_pool.run(_run_main, _reader_argv(root, s_tok, t_tok, "hkl_read",
                                         HKL + ["--teacher-cache", str(cache)]))
    _same(_losses(root, "hkl_read"), losses, "compact H-KL read from the cache")


def test_larger_compact_sizes_are_refused_by_the_cache(e2e_setup, e2e_pool,
                                                      compact_online):
    """More pairs than the cache holds (fewer would be narrowed on read)."""
    root, s_tok, t_tok = e2e_setup
    cache, _ = compact_online
    argv = _reader_argv(root, s_tok, t_tok, "hkl_refused",
                        HKL + ["--teacher-cache", str(cache), "--kd-gold-topk", "128"])
    assert e2e_pool.run(_run_main, argv) == [2] * 4
    message = refusal(argv)
    assert "made for another configuration" in message and "payload.gold_topk" in message


def test_a_disaggregated_teacher_ships_it_like_a_colocated_one(e2e_setup, e2e_pool,
                                                              compact_online):
    root, s_tok, t_tok = e2e_setup
    _, losses = compact_online
    name = "hkl_disaggregated"
    e2e_pool.run(_run_main, _argv(root, s_tok, t_tok, name, HKL + [
        "--teacher-placement", "disaggregated", "--teacher-ranks", "2",
        "--tensor-model-parallel-size", "2", "--teacher-tensor-model-parallel-size", "2"]))
    assert_losses_match(_losses(root, name), losses, name)
