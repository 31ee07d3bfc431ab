"""Teacher cache files: shards round-trip, refuse damage by name, and the manifest's key check."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from megatron_xdistill.teacher_cache import (
    CacheError,
    Manifest,
    ShardReader,
    ShardWriter,
    TeacherCache,
    cache_is_complete,
    checkpoint_fingerprint,
    committed_samples,
    key_differences,
    load_manifest,
    sample_check,
)
from megatron_xdistill.teacher_cache.manifest import check_key, save_manifest
from megatron_xdistill.teacher_cache.store import SHARD_DIR, list_shards

NUMEL = 37


def _sample(i: int) -> dict:
    rng = np.random.default_rng(i)
    return {"index": i, "tokens": rng.integers(0, 100, 9), "teacher_tokens": rng.integers(0, 90, 11),
            "chunks": rng.integers(0, 9, (4, 5)), "student_length": 9, "teacher_length": 11}


def _payload(i: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(i))


def _write(root, ids, writer=0, shard_bytes=1 << 20):
    out = ShardWriter(root, writer, NUMEL, shard_bytes)
    for i in ids:
        out.add(i, sample_check(_sample(i)), _payload(i))
    return out


def test_rows_round_trip_exactly_across_writers_and_shards(tmp_path):
    a = _write(tmp_path, [0, 2, 4, 6], writer=0, shard_bytes=2 * 4 * NUMEL)  # 2 rows a shard
    b = _write(tmp_path, [7, 5, 3, 1], writer=1)
    a.flush(), b.flush()
    assert len(list_shards(tmp_path)) == 3
    assert committed_samples(tmp_path).tolist() == list(range(8))
    reader = ShardReader(tmp_path, NUMEL)
    got = reader.read((i, sample_check(_sample(i))) for i in [6, 1, 3, 0])
    for i, payload in got.items():
        assert torch.equal(payload, _payload(i))


def test_an_unflushed_writer_leaves_nothing_a_reader_lists(tmp_path):
    _write(tmp_path, [0, 1])  # never flushed: as if killed
    (tmp_path / SHARD_DIR / ".payloads-w00000-s0000000000-0000000001.123.tmp").write_bytes(b"x")
    assert list_shards(tmp_path) == [] and committed_samples(tmp_path).size == 0
    ShardWriter(tmp_path, 0, NUMEL)  # the same writer restarting removes its own leftovers
    assert not list((tmp_path / SHARD_DIR).glob("*.tmp"))


def test_a_slow_writer_commits_on_time_whatever_the_size(tmp_path, monkeypatch):
    """A killed pass loses at most commit_seconds of teacher work, even when its shard size
    would take hours of a slow teacher to fill."""
    from megatron_xdistill.teacher_cache import store

    now = [0.0]
    monkeypatch.setattr(store.time, "monotonic", lambda: now[0])
    out = ShardWriter(tmp_path, 0, NUMEL, shard_bytes=1 << 30, commit_seconds=10.0)
    for sample, at in [(0, 0.0), (1, 5.0)]:
        now[0] = at
        out.add(sample, sample_check(_sample(sample)), _payload(sample))
    assert committed_samples(tmp_path).size == 0  # the oldest row is 5 s old
    now[0] = 10.0
    out.add(2, sample_check(_sample(2)), _payload(2))
    assert committed_samples(tmp_path).tolist() == [0, 1, 2]
    now[0] = 15.0  # the clock restarts with the next queued row
    out.add(3, sample_check(_sample(3)), _payload(3))
    assert committed_samples(tmp_path).tolist() == [0, 1, 2]


def test_truncated_shard_is_refused_by_name(tmp_path):
    shard = _write(tmp_path, [0, 1, 2]).flush()
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CacheError, match=rf"{shard.name}.*truncated or corrupt"):
        ShardReader(tmp_path, NUMEL).read([(1, sample_check(_sample(1)))])
    with pytest.raises(CacheError, match=shard.name):
        committed_samples(tmp_path)


def test_flipped_payload_bits_fail_the_crc(tmp_path):
    import pyarrow as pa

    shard = _write(tmp_path, [0, 1]).flush()
    table = pa.ipc.open_file(pa.memory_map(str(shard))).read_all()
    values = table.column("payload").combine_chunks().values.to_numpy().copy()
    values[NUMEL + 3] += 1.0  # sample 1's fourth value
    bad = table.set_column(3, "payload", pa.FixedSizeListArray.from_arrays(pa.array(values),
                                                                           NUMEL))
    with pa.OSFile(str(shard), "wb") as sink, pa.ipc.new_file(sink, bad.schema) as out:
        out.write_table(bad)
    reader = ShardReader(tmp_path, NUMEL)
    assert torch.equal(reader.read([(0, sample_check(_sample(0)))])[0], _payload(0))
    with pytest.raises(CacheError, match=r"corrupt \(sample 1 fails its CRC32\)"):
        reader.read([(1, sample_check(_sample(1)))])


def test_other_tokens_and_missing_samples_are_refused(tmp_path):
    _write(tmp_path, [0, 1]).flush()
    reader = ShardReader(tmp_path, NUMEL)
    other = _sample(1)
    other["tokens"] = other["tokens"] + 1
    with pytest.raises(CacheError, match="sample 1 .* other tokens"):
        reader.read([(1, sample_check(other))])
    with pytest.raises(CacheError, match="no payload for sample 5"):
        reader.read([(5, 0)])
    with pytest.raises(CacheError, match="holds payloads of 37 values, this run's payload form "
                                         "needs 38"):
        ShardReader(tmp_path, NUMEL + 1).read([(0, sample_check(_sample(0)))])


def test_sample_check_sees_every_input():
    base = sample_check(_sample(3))
    for key in ("tokens", "teacher_tokens", "chunks"):
        changed = _sample(3)
        changed[key] = changed[key].copy()
        changed[key].flat[-1] += 1
        assert sample_check(changed) != base, key
    changed = _sample(3)
    changed["teacher_length"] = 10
    assert sample_check(changed) != base


KEY = {"teacher": {"checkpoint": "sha256:aa", "precision": "fp32"},
       "data": {"files": [["train.jsonl", 100, 1.0]], "seq_length": 32, "num_samples": 12},
       "payload": {"form": "chunk_topk", "topk": 16, "temperature": 1.0}}


def test_key_differences_name_each_field_and_both_values():
    run = json.loads(json.dumps(KEY))
    run["payload"]["temperature"] = 2.0
    run["data"]["files"][0][1] = 101
    assert key_differences(KEY, run) == [
        "data.files: cache [['train.jsonl', 100, 1.0]], this run [['train.jsonl', 101, 1.0]]",
        "payload.temperature: cache 1.0, this run 2.0"]
    run = json.loads(json.dumps(KEY))
    run["data"]["num_samples"] = 24  # a reader trains on the cache's plan, in epochs
    manifest = Manifest(KEY, {}, 12, NUMEL)
    check_key("c", manifest, run, reading=True)
    with pytest.raises(CacheError, match="data.num_samples: cache 12, this run 24"):
        check_key("c", manifest, run, reading=False)


def test_manifest_and_completeness(tmp_path):
    assert load_manifest(tmp_path) is None and not cache_is_complete(tmp_path)
    cache = TeacherCache(tmp_path)
    assert cache.mode == "write"
    cache.check(KEY)
    cache.attach({"vocab_size": 5}, 6, NUMEL, rank=0, writer=True, reader=False,
                 barrier=lambda: None)
    for i in range(4):
        cache.record({i: _sample(i)}, {i: _payload(i)})
    assert not cache.close(0, lambda: None, log=lambda m: None)
    assert cache.first_incomplete_step(2) == 2 and cache.missing().tolist() == [4, 5]
    for i in (4, 5):
        cache.record({i: _sample(i)}, {i: _payload(i)})
    assert cache.close(0, lambda: None, log=lambda m: None)
    assert cache_is_complete(tmp_path)
    reread = TeacherCache(tmp_path)
    assert reread.reading and reread.manifest.teacher_model == {"vocab_size": 5}
    reread.check(KEY)
    reread.attach({}, 6, NUMEL, rank=0, writer=False, reader=True, barrier=lambda: None)
    with pytest.raises(CacheError, match="holds payloads of 37 values, this run needs 38"):
        reread.attach({}, 6, NUMEL + 1, rank=0, writer=False, reader=True, barrier=lambda: None)
    got = reread.fetch({7: _sample(5)}, [7], torch.device("cpu"))
    assert torch.equal(got[7], _payload(5))
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(CacheError, match="manifest.json is not valid JSON"):
        TeacherCache(tmp_path)
    save_manifest(tmp_path, Manifest(KEY, {}, 6, NUMEL))
    data = json.loads((tmp_path / "manifest.json").read_text())
    data["version"] = 99
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(CacheError, match="version 99"):
        load_manifest(tmp_path)
    # version 1: its image payloads held log P (refilled); its other forms are read as they are
    data["version"] = 1
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    assert load_manifest(tmp_path).key == KEY
    data["key"] = {**KEY, "payload": {**KEY.get("payload", {}), "form": "image"}}
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(CacheError, match="version 1 of an image payload"):
        load_manifest(tmp_path)


def test_checkpoint_fingerprint_follows_files_and_metadata(tmp_path):
    (tmp_path / "iter_0000001").mkdir()
    (tmp_path / "iter_0000001" / "weights.distcp").write_bytes(b"\0" * 64)
    (tmp_path / "xdistill_model.json").write_text('{"a": 1}')
    first = checkpoint_fingerprint(tmp_path)
    assert checkpoint_fingerprint(tmp_path) == first
    (tmp_path / "xdistill_model.json").write_text('{"a": 2}')
    second = checkpoint_fingerprint(tmp_path)
    assert second != first
    (tmp_path / "iter_0000001" / "weights.distcp").write_bytes(b"\0" * 65)
    assert checkpoint_fingerprint(tmp_path) != second
    with pytest.raises(CacheError, match="is not a directory"):
        checkpoint_fingerprint(tmp_path / "nope")


def _chunk_topk(mean: torch.Tensor, k: int, has: torch.Tensor):
    """Dense reference: each chunk's k most probable columns and the rest's mass (fp64)."""
    from megatron_xdistill.loss.definitions.payload import PayloadSpec, TeacherPayload

    vals, cols = mean.topk(k, dim=-1)
    rest = mean.double().exp().sum(-1) - vals.double().exp().sum(-1)
    zero = lambda t: torch.where(has[..., None] if t.dim() == 3 else has, t, 0)  # noqa: E731
    return TeacherPayload(PayloadSpec("chunk_topk", mean.shape[1], k), zero(vals), has,
                          zero(cols), zero(rest.log().float()))


def test_a_chunk_topk_payload_narrows_to_what_a_smaller_k_ships():
    """The first k of a top-K payload's columns and its tail grown by the dropped mass equal
    the top-k payload computed from the dense chunk distributions (rows without a teacher stay
    zeros); other forms and larger k are refused."""
    torch.manual_seed(0)
    mean = torch.randn(2, 5, 300).mul(3).log_softmax(-1)
    has = torch.tensor([[True, True, False, True, True], [True] * 5])
    got = _chunk_topk(mean, 16, has).narrowed(4)
    want = _chunk_topk(mean, 4, has)
    assert got.spec == want.spec
    assert torch.equal(got.columns, want.columns) and torch.equal(got.logprobs, want.logprobs)
    assert torch.allclose(got.tail_logprob, want.tail_logprob, rtol=1e-6, atol=1e-6)
    assert torch.equal(got.tail_logprob[~has], torch.zeros(1))
    with pytest.raises(ValueError, match="cannot narrow a top-4 payload to top-8"):
        want.narrowed(8)
    from megatron_xdistill.teacher_cache.narrowing import Narrowing

    big = _chunk_topk(mean, 16, has)
    flat = torch.cat([big.to_flat(), torch.tensor([[7.0], [8.0]])], 1)  # + a trailing extra
    rows = Narrowing(big.spec, want.spec, extra=1)(flat)
    assert torch.allclose(rows, torch.cat([want.to_flat(), flat[:, -1:]], 1), atol=1e-6)


def test_a_reading_run_at_a_smaller_chunk_topk_is_narrowed_else_refused():
    """The key check lets a reader take fewer chunk top-k columns than the cache holds (its
    rows narrowed on read), never more, and never another form."""
    from megatron_xdistill.loss.definitions.payload import PayloadSpec
    from megatron_xdistill.teacher_cache.narrowing import narrowing

    def key(form, topk, extra=0):
        numel = PayloadSpec(form, 9, topk).numel + extra
        return {"data": {"seq_length": 8}, "payload": {"form": form, "topk": topk,
                                                       "numel": numel}}

    held = key("chunk_topk", 64)
    plan = narrowing(held, key("chunk_topk", 8), held["payload"]["numel"])
    assert plan is not None and plan.run.width == 8 and plan.extra == 0
    check_key("c", Manifest(held, {}, 4, held["payload"]["numel"], True), key("chunk_topk", 8),
              reading=True, narrowed=True)
    select = key("chunk_topk", 64, extra=1)  # several teachers' selection CE rides along
    assert narrowing(select, key("chunk_topk", 8, extra=1), select["payload"]["numel"]).extra == 1
    assert narrowing(held, key("chunk_topk", 128), held["payload"]["numel"]) is None
    assert narrowing(held, key("topk", 8), held["payload"]["numel"]) is None
    assert narrowing(select, key("chunk_topk", 8), select["payload"]["numel"]) is None
    with pytest.raises(CacheError, match="payload.topk: cache 64, this run 128"):
        check_key("c", Manifest(held, {}, 4, held["payload"]["numel"], True),
                  key("chunk_topk", 128), reading=True)


def test_a_teacher_pass_covers_the_plan_once_whatever_the_epochs(monkeypatch):
    """``--teacher-cache-only`` with --samples-per-epoch 8 (two steps of 4) and --train-iters 6:
    the teacher runs over the plan's two steps, not six (later epochs repeat the samples)."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from megatron_xdistill.parallel.shape import ParallelLayout
    from megatron_xdistill.training.teacher_cache_run import fill_teacher_cache

    seen = []
    layout = ParallelLayout(tp=1, pp=1, cp=1, dp=1)
    distiller = SimpleNamespace(
        lanes=[SimpleNamespace(groups=SimpleNamespace(coords={"dp": 0}), layout=layout)],
        student_layout=layout, step=0, times=SimpleNamespace(reset=lambda: {"time_teacher": 0}),
        train_step=lambda batch: seen.append(sorted(s["index"] for s in batch.values())),
        close=lambda: None)
    cache = SimpleNamespace(first_incomplete_step=lambda gbs: 0,
                            close=lambda rank, barrier, log: True)
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "barrier", lambda: None)
    args = SimpleNamespace(global_batch_size=4, micro_batch_size=1, num_workers=0,
                           train_iters=6, log_interval=1, exit_interval=None)
    dataset = [{"index": i} for i in range(8)]
    assert fill_teacher_cache(args, distiller, [cache], dataset, log=lambda m: None) == 0
    assert seen == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_a_later_epoch_does_not_write_a_held_sample_again(tmp_path):
    """An online run over several epochs records each sample's payload once (a repeat would
    land in another shard as a duplicate row)."""
    cache = TeacherCache(tmp_path / "c")
    cache.check({"k": 1})
    cache.attach({}, 2, NUMEL, rank=0, writer=True, reader=False, barrier=lambda: None)
    import pyarrow as pa

    steps = [[0], [1], [0, 1]]  # epoch 1 in two steps, epoch 2 in one: other shard bounds
    for step in steps:
        cache.record({i: _sample(i) for i in step}, {i: _payload(i) for i in step})
        cache.flush()
    rows = [i for s in list_shards(tmp_path / "c")
            for i in pa.ipc.open_file(s.path).read_all().column("sample").to_pylist()]
    assert sorted(rows) == [0, 1]
