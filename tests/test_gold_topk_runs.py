"""Compact gold / H-KL in training runs: ``--kd-loss hkl`` ships the compact payload by default
(``--kd-gold-topk 64 --kd-gold-uncommon-topk 256``); the teacher cache stores it under a key that
holds its sizes, a run reading the cache trains exactly like the online run, and a disaggregated
teacher (the payload through the streaming transport) gives the colocated losses.

Setup as test_e2e (tiny converted models, real SmolLM2 / Qwen2 tokenizers: M common pairs in the
thousands, so the defaults leave a bucket and a tail).
"""

from __future__ import annotations

import json

import pytest
import test_e2e
from scratch import scratch_dir
from test_e2e import _argv, _losses, _run_main, assert_losses_match
from test_teacher_cache import _reader_argv, _same

from megatron_xdistill.loss.definitions.common import UNCOMMON_TOPK

pytestmark = test_e2e.pytestmark
HKL = ["--kd-loss", "hkl"]


@pytest.fixture(scope="module")
def online(e2e_setup, e2e_pool, request, tmp_path_factory):
    """A colocated compact H-KL run that fills a teacher cache as it trains: (cache, losses)."""
    root, s_tok, t_tok = e2e_setup
    cache = scratch_dir(request, tmp_path_factory, "gold_topk_cache") / "online"
    e2e_pool.run(_run_main, _argv(root, s_tok, t_tok, "hkl_online",
                                  HKL + ["--teacher-cache", str(cache)]))
    return cache, _losses(root, "hkl_online")


def test_the_cache_holds_the_compact_payload_and_reproduces_the_run(e2e_setup, e2e_pool, online):
    root, s_tok, t_tok = e2e_setup
    cache, losses = online
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


def test_larger_compact_sizes_are_refused_by_the_cache(e2e_setup, e2e_pool, online):
    """More pairs than the cache holds (fewer would be narrowed on read)."""
    root, s_tok, t_tok = e2e_setup
    cache, _ = online
    argv = _reader_argv(root, s_tok, t_tok, "hkl_refused",
                        HKL + ["--teacher-cache", str(cache), "--kd-gold-topk", "128"])
    assert e2e_pool.run(_run_main, argv) == [2] * 4
    message = test_e2e.refusal(argv)
    assert "made for another configuration" in message and "payload.gold_topk" in message


def test_a_disaggregated_teacher_ships_it_like_a_colocated_one(e2e_setup, e2e_pool, online):
    root, s_tok, t_tok = e2e_setup
    _, losses = online
    name = "hkl_disaggregated"
    e2e_pool.run(_run_main, _argv(root, s_tok, t_tok, name, HKL + [
        "--teacher-placement", "disaggregated", "--teacher-ranks", "2",
        "--tensor-model-parallel-size", "2", "--teacher-tensor-model-parallel-size", "2"]))
    assert_losses_match(_losses(root, name), losses, name)
