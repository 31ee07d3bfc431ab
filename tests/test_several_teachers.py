"""Several teachers in one run, against dense references on HF transformers logits.

Two teachers teach the tiny student of test_e2e: ``qwen`` (the Qwen2-tokenizer teacher, through
the projection, chunk top-16) and ``peer`` (a second model with the student's own tokenizer: a
direct token-level KL, full vocabulary, checked against ``F.kl_div`` at every labelled position,
no alignment code involved). Each teacher has its own layout. The first step's per-teacher KD, the
CE, and one plain-SGD update equal the weighted sum of the single-teacher references on the same
batch; per-sample selection picks, for each sample, the teacher with the lowest CE on its text.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from scratch import scratch_dir
from shared_assets import needs_shared_assets
from test_e2e import _argv, _convert, _run_main, _tiny_hf
from test_trainer_reference import (
    LR,
    PLAIN,
    RTOL,
    SGD,
    _export,
    _hf,
    _padded,
    _sparse_projection,
)

from megatron_xdistill.testing.multirank import RankPool

pytestmark = needs_shared_assets
SEQ, QWEN_SEQ, GBS, SEED = 32, 40, 4, 1234
QWEN_TOPK = 16
WEIGHTS = {"qwen": 0.7, "peer": 0.3}
CE_WEIGHT = 0.5


@pytest.fixture(scope="module")
def setup(e2e_setup, request, tmp_path_factory):
    """(root of test_e2e's setup, student tokenizer, teacher tokenizer, the peer teacher's
    directory): the peer is a tiny Llama with the student's vocabulary and its own weights."""
    root, s_tok, t_tok = e2e_setup
    peer_root = scratch_dir(request, tmp_path_factory, "peer")
    peer_hf = _tiny_hf(peer_root / "peer_hf", "llama", 49152, 7, init_std=0.3)
    with RankPool(1) as pool:
        pool.run(_convert, str(peer_hf), str(peer_root / "peer"))
    return root, s_tok, t_tok, peer_root


def _teachers_yaml(path: Path, root: Path, s_tok: Path, t_tok: Path, peer_root: Path,
                   combination: str, qwen_layout: dict, peer_layout: dict) -> Path:
    """Both teachers; qwen's chunk top-16 unless ``qwen_layout`` sets its own ``kd_topk``."""
    import yaml

    path.write_text(yaml.safe_dump({"teachers": [
        {"name": "qwen", "load": str(root / "teacher"), "tokenizer_model": str(t_tok),
         "projection_path": str(root / "proj.safetensors"), "seq_length": QWEN_SEQ,
         "kd_topk": QWEN_TOPK, "weight": WEIGHTS["qwen"], **qwen_layout},
        {"name": "peer", "load": str(peer_root / "peer"), "tokenizer_model": str(s_tok),
         "kd_topk": 0, "weight": WEIGHTS["peer"], **peer_layout},
    ], "combination": combination}))
    return path


def _argv_two(root, s_tok, t_tok, peer_root, name: str, combination: str, qwen_layout: dict,
              peer_layout: dict, extra: list[str]) -> list[str]:
    config = _teachers_yaml(root / f"{name}_teachers.yaml", root, s_tok, t_tok, peer_root,
                            combination, qwen_layout, peer_layout)
    argv = _argv(root, s_tok, t_tok, name, ["--data-cache-path", str(root / f"{name}_cache"),
                                            "--teachers-config", str(config), *extra])
    argv[argv.index("--train-iters") + 1] = "1"
    for flag in ("--teacher-load", "--teacher-tokenizer-model", "--projection-path",
                 "--teacher-seq-length"):  # every teacher is in the YAML file
        i = argv.index(flag)
        del argv[i : i + 2]
    return argv


def _first_global_batch(root: Path, s_tok: Path, t_tok: Path, data: str = "train.jsonl") -> dict:
    """Step 1's samples as the two-teacher run packs them (cut points valid for both)."""
    from megatron_xdistill.align import load_tokenizer
    from megatron_xdistill.data.dataset import DistillationDataset, collate_samples
    from megatron_xdistill.data.packing import build_plan, load_documents
    from megatron_xdistill.data.sources import parse_data_path
    from megatron_xdistill.data.tokenizations import SampleTokenizers

    student = load_tokenizer(str(s_tok))
    tokenizers = SampleTokenizers(student, [load_tokenizer(str(t_tok)), student])
    assert tokenizers.same_tokenizer == [False, True]
    sources = parse_data_path([str(root / data)])
    documents, counts = load_documents(sources, "text")
    plan = build_plan(documents, sources, counts, tokenizers, SEQ, [QWEN_SEQ, SEQ], SEED, GBS,
                      log=lambda _: None)
    dataset = DistillationDataset(documents, plan, tokenizers, SEQ, [QWEN_SEQ, SEQ])
    return collate_samples([dataset[i] for i in range(GBS)])


def _per_sample_terms(root: Path, peer_root: Path, batch: dict, student,
                      qwen_topk: int = QWEN_TOPK):
    """Per sample: (qwen KL sum, qwen chunks, peer KL sum, peer positions, CE sum, CE tokens,
    qwen text nats, peer text nats), with autograd into ``student``. ``qwen_topk`` 0: qwen's
    exact P-KL over all of its vocabulary."""
    from megatron_xdistill.data.dataset import teacher_view
    from megatron_xdistill.loss.definitions.reference import kd_loss_details

    w, _ = _sparse_projection(root / "proj.safetensors")
    qwen = teacher_view(batch, 0)
    with torch.no_grad():
        q_logits = _hf(root / "teacher_hf")(qwen["teacher_tokens"][:, :-1]).logits.float()
        p_logits = _hf(peer_root / "peer_hf")(batch["tokens"][:, :-1]).logits.float()
    s_logits = student(batch["tokens"][:, :-1]).logits.float()
    labels = batch["tokens"][:, 1:].clone()
    labels[batch["loss_mask"] <= 0] = -100
    ce = F.cross_entropy(s_logits.transpose(1, 2), labels, ignore_index=-100, reduction="none")
    mask = (labels != -100).float()
    # peer: KL(p_t || p_s) at every labelled position, the student's own tokenization
    kl = F.kl_div(F.log_softmax(s_logits, -1), F.log_softmax(p_logits, -1), log_target=True,
                  reduction="none").sum(-1)
    p_nats = (F.cross_entropy(p_logits.transpose(1, 2), labels, ignore_index=-100,
                              reduction="none") * mask).sum(1)
    q_labels = qwen["teacher_tokens"][:, 1:].clone()
    q_positions = torch.arange(q_labels.shape[1]).unsqueeze(0)
    q_labels[q_positions >= qwen["teacher_length"].unsqueeze(1) - 1] = -100
    q_nats = F.cross_entropy(q_logits.transpose(1, 2), q_labels, ignore_index=-100,
                             reduction="none").sum(1)
    rows = []
    for b in range(GBS):
        one = slice(b, b + 1)
        details = kd_loss_details(
            _padded(s_logits[one]), _padded(q_logits[one]), qwen["student_chunk_id"][one],
            qwen["teacher_chunk_id"][one], qwen["chunk_valid"][one], qwen["chunk_exact"][one],
            w, chunk_topk=qwen_topk or None)
        rows.append((details.per_chunk.sum(), details.counted.sum().double(),
                     (kl[b] * mask[b]).sum(), mask[b].sum().double(), (ce[b] * mask[b]).sum(),
                     mask[b].sum().double(), q_nats[b].item(), p_nats[b].item()))
    return rows


def _metrics(root: Path, name: str) -> dict:
    records = [json.loads(x) for x in (root / f"{name}.jsonl").read_text().splitlines()]
    return [r for r in records if "kd" in r][0]


@pytest.fixture(scope="module")
def first_batch(setup):
    root, s_tok, t_tok, _ = setup
    return _first_global_batch(root, s_tok, t_tok)


@pytest.mark.parametrize("qwen_topk", [QWEN_TOPK, 0], ids=["qwen_chunk_topk", "qwen_exact"])
def test_two_teachers_step_equals_the_weighted_sum_of_single_teacher_references(
        setup, first_batch, tmp_path, qwen_topk):
    """Student DP2, qwen TP2, peer PP2 (each teacher its own layout), SGD: the first step's
    per-teacher KD, CE, and the parameter update against the dense references. qwen's chunk
    top-k call recomputes in its backward (made first, it writes over the logits last); with
    its exact P-KL every call writes its gradient in the forward (qwen's made last)."""
    root, s_tok, t_tok, peer_root = setup
    run_dir, name = tmp_path / "run", f"two_sum_k{qwen_topk}"
    argv = _argv_two(root, s_tok, t_tok, peer_root, name, "sum",
                     {"tensor_model_parallel_size": 2, "kd_topk": qwen_topk},
                     {"pipeline_model_parallel_size": 2},
                     [*PLAIN, *SGD, "--save", str(run_dir)])
    with RankPool(2) as pool:
        pool.run(_run_main, argv)
    with RankPool(1) as pool:
        pool.run(_export, run_dir, tmp_path / "hf")
    got = _metrics(root, name)

    student = _hf(root / "student_hf")
    before = {k: v.detach().clone() for k, v in student.state_dict().items()}
    rows = _per_sample_terms(root, peer_root, first_batch, student, qwen_topk)
    q_sum, q_n, p_sum, p_n, ce_sum, ce_n = (sum(r[i] for r in rows) for i in range(6))
    kd_q, kd_p, ce = q_sum / q_n, p_sum / p_n, ce_sum / ce_n
    assert kd_q.item() > 0.05 and kd_p.item() > 0.05  # KLs that are not ~0
    assert got["kd/qwen"] == pytest.approx(kd_q.item(), rel=RTOL)
    assert got["kd/peer"] == pytest.approx(kd_p.item(), rel=RTOL)
    assert got["ce"] == pytest.approx(ce.item(), rel=RTOL)
    loss = WEIGHTS["qwen"] * kd_q + WEIGHTS["peer"] * kd_p + CE_WEIGHT * ce
    assert got["kd"] == pytest.approx((WEIGHTS["qwen"] * kd_q + WEIGHTS["peer"] * kd_p).item(),
                                      rel=RTOL)
    assert got["chunks/qwen"] == int(q_n) and got["chunks/peer"] == int(p_n)
    loss.backward()

    after = _hf(tmp_path / "hf").state_dict()
    for key, param in student.named_parameters():
        update = LR * param.grad
        applied = before[key] - after[key]
        scale = update.abs().max().item()
        assert scale > 0, key
        err = (applied - update).abs().max().item()
        rounding = 2 * torch.finfo(torch.float32).eps * before[key].abs().max().item()
        assert err <= 1e-4 * scale + rounding, f"{key} step differs by {err:.3g} ({scale:.3g})"


def _two_step_run(setup, name: str, world: int, qwen: dict, peer: dict,
                  extra: list[str] = ()) -> list[dict]:
    """A two-step run of both teachers (sum, Adam); its records that carry losses."""
    root, s_tok, t_tok, peer_root = setup
    argv = _argv_two(root, s_tok, t_tok, peer_root, name, "sum", qwen, peer, list(extra))
    argv[argv.index("--train-iters") + 1] = "2"
    argv[argv.index("--data-cache-path") + 1] = str(root / "two_step_plans")
    with RankPool(world) as pool:
        pool.run(_run_main, argv)
    path = root / f"{name}.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if "kd/qwen" in x] \
        if path.exists() else []


@pytest.fixture(scope="module")
def colocated_two_steps(setup):
    """Both teachers colocated on one rank, online; qwen's payloads also go to its cache."""
    root = setup[0]
    return _two_step_run(setup, "two_coloc", 1, {"cache": str(root / "cache_qwen")}, {})


def _same_steps(got: list[dict], want: list[dict], rel: float) -> None:
    assert len(got) == len(want) == 2
    for g, w in zip(got, want, strict=True):
        for key in ("kd", "ce", "kd/qwen", "kd/peer", "chunks/qwen", "chunks/peer", "grad_norm"):
            assert g[key] == pytest.approx(w[key], rel=rel), (key, g, w)


def test_disaggregated_teachers_on_their_own_ranks_match_the_reference(setup, first_batch,
                                                                      colocated_two_steps):
    """Student on rank 0, qwen on rank 1, peer on rank 2 (each teacher its own 'ranks'), both
    streaming the next batch while the student trains: step 1 equals the dense reference, and
    both steps equal the colocated run."""
    root, _, _, peer_root = setup
    runs = _two_step_run(setup, "two_disagg", 3, {"ranks": 1}, {"ranks": 1},
                         ["--teacher-placement", "disaggregated"])
    with torch.no_grad():
        rows = _per_sample_terms(root, peer_root, first_batch, _hf(root / "student_hf"))
    q_sum, q_n, p_sum, p_n, ce_sum, ce_n = (sum(r[i] for r in rows) for i in range(6))
    assert runs[0]["kd/qwen"] == pytest.approx(float(q_sum / q_n), rel=RTOL)
    assert runs[0]["kd/peer"] == pytest.approx(float(p_sum / p_n), rel=RTOL)
    assert runs[0]["ce"] == pytest.approx(float(ce_sum / ce_n), rel=RTOL)
    _same_steps(runs, colocated_two_steps, RTOL)
    assert all(r["time_teacher/qwen"] > 0 and r["time_teacher/peer"] > 0 for r in runs)


def test_each_teacher_has_its_own_payload_cache(setup, colocated_two_steps):
    """Each teacher's 'cache'. The colocated run filled qwen's as it trained; a teacher-only
    pass over both caches skips qwen's (complete) and fills the peer's; a run reading both (no
    teacher is loaded or run) trains exactly as the run that computed the payloads online."""
    root = setup[0]
    caches = ({"cache": str(root / "cache_qwen")}, {"cache": str(root / "cache_peer")})
    def shards(teacher: str) -> list[str]:
        return sorted(p.name for p in (root / f"cache_{teacher}" / "shards").iterdir())

    def complete(teacher: str) -> bool:
        manifest = json.loads((root / f"cache_{teacher}" / "manifest.json").read_text())
        return manifest["complete"] and manifest["num_samples"] == 2 * GBS

    filled = shards("qwen")
    assert complete("qwen") and not (root / "cache_peer").exists()
    assert _two_step_run(setup, "two_pass", 1, *caches, ["--teacher-cache-only"]) == []
    assert complete("peer") and shards("qwen") == filled  # qwen's was not recomputed
    runs = _two_step_run(setup, "two_read", 1, *caches)
    _same_steps(runs, colocated_two_steps, 1e-6)
    assert all(r["time_teacher"] == 0.0 for r in runs)  # no teacher ran


# Chinese: the Qwen2 tokenizer takes about a third of SmolLM2's tokens for it, so the qwen
# teacher's text CE (a sum over its own tokens) is the lower one there, the peer's on English.
CHINESE = ("北京是中华人民共和国的首都，也是全国的政治、文化和国际交往中心。这座城市有三千多年的"
           "建城史，拥有故宫、天坛和长城等众多名胜古迹。")


def test_selection_takes_each_sample_from_its_lowest_ce_teacher(setup):
    """combination: select, on English and Chinese text. Each sample's KD comes from the
    teacher with the lowest nats on its text (computed by each teacher on its own tokens); the
    chosen chunks share one denominator; both teachers get samples."""
    root, s_tok, t_tok, peer_root = setup
    english = json.loads((root / "train.jsonl").read_text().splitlines()[0])["text"][:300]
    (root / "mixed.jsonl").write_text(
        "\n".join(json.dumps({"text": t}) for t in (english, CHINESE[:30])))
    argv = _argv_two(root, s_tok, t_tok, peer_root, "two_select", "select", {}, {}, [])
    argv[argv.index("--data-path") + 1] = str(root / "mixed.jsonl")
    with RankPool(1) as pool:
        pool.run(_run_main, argv)
    got = _metrics(root, "two_select")
    batch = _first_global_batch(root, s_tok, t_tok, "mixed.jsonl")
    with torch.no_grad():
        rows = _per_sample_terms(root, peer_root, batch, _hf(root / "student_hf"))
    choice = [0 if r[6] <= r[7] else 1 for r in rows]
    assert sorted(set(choice)) == [0, 1], [(r[6], r[7]) for r in rows]  # a real choice
    kl = [(r[0], r[1]) if c == 0 else (r[2], r[3]) for r, c in zip(rows, choice)]
    pooled = sum(n for _, n in kl)
    kd_q = sum(s for (s, _), c in zip(kl, choice) if c == 0) / pooled
    kd_p = sum(s for (s, _), c in zip(kl, choice) if c == 1) / pooled
    assert got["selected/qwen"] == pytest.approx(choice.count(0) / GBS)
    assert got["selected/peer"] == pytest.approx(choice.count(1) / GBS)
    assert got["kd/qwen"] == pytest.approx(float(kd_q), rel=RTOL, abs=1e-12)
    assert got["kd/peer"] == pytest.approx(float(kd_p), rel=RTOL, abs=1e-12)
    assert got["kd"] == pytest.approx(float(WEIGHTS["qwen"] * kd_q + WEIGHTS["peer"] * kd_p),
                                      rel=RTOL)


# ---------------------------------------------------------------- the teachers file, refused
def _parse(tmp_path: Path, config: dict, extra: list[str] = (), world: int = 1):
    import yaml

    from megatron_xdistill.training.arguments.checks import parse_args

    path = tmp_path / "teachers.yaml"
    path.write_text(yaml.safe_dump(config))
    tok = str(tmp_path)
    argv = ["--load", tok, "--tokenizer-model", tok, "--data-path", "x.jsonl", "--seq-length",
            "32", "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "1",
            "--lr", "1e-3",
            "--teachers-config", str(path), *extra]
    return parse_args(argv, world)


def _teacher(tmp_path: Path, **keys) -> dict:
    return {"load": str(tmp_path), "tokenizer_model": str(tmp_path), **keys}


@pytest.mark.parametrize("config, extra, world, message", [
    ({"teachers": [{"lod": "x"}]}, [], 1, "teachers[0]: unknown key(s) ['lod']"),
    ({"teachers": "x"}, [], 1, "expected a mapping with a 'teachers' list"),
    ({"teachers": [], "combination": "sum"}, [], 1, "'teachers' is empty"),
    ({"teacher": []}, [], 1, "expected a mapping with a 'teachers' list"),
    ("dup", [], 1, "name 'a' is used twice"),
    ("weight0", [], 1, "teacher 'b': weight 0.0 must be > 0"),
    ("bad_combination", [], 1, "combination must be one of ['sum', 'select']"),
    ("one_select", [], 1, "--teacher-combination select picks one of several teachers"),
    ("tp3", [], 2, "teacher 'b'"),
    ("two", ["--teacher-placement", "disaggregated", "--teacher-ranks", "1"], 2,
     "the teachers' ranks (1 + 1 = 2) leave no student rank in world size 2"),
    ("two", ["--teacher-placement", "disaggregated"], 3, "teacher 'teacher0' needs its own "
     "ranks"),
    ("topk_text", [], 1, "teachers[1]: kd_topk must be an integer"),
    ("same_cache", [], 1, "each teacher needs a cache directory of its own"),
    ("only_one_cache", ["--teacher-cache-only"], 1,
     "--teacher-cache-only fills each teacher's cache: teacher 'b' has none"),
])
def test_bad_teachers_files_are_named(tmp_path, config, extra, world, message):
    t = _teacher(tmp_path)
    configs = {
        "dup": {"teachers": [{**t, "name": "a"}, {**t, "name": "a"}]},
        "weight0": {"teachers": [{**t, "name": "a"}, {**t, "name": "b", "weight": 0}]},
        "bad_combination": {"teachers": [t, t], "combination": "vote"},
        "one_select": {"teachers": [t], "combination": "select"},
        "tp3": {"teachers": [{**t, "name": "a"},
                             {**t, "name": "b", "tensor_model_parallel_size": 3}]},
        "two": {"teachers": [t, t]},
        "topk_text": {"teachers": [t, {**t, "kd_topk": "many"}]},
        "same_cache": {"teachers": [{**t, "cache": str(tmp_path / "c")},
                                    {**t, "cache": str(tmp_path / "c")}]},
        "only_one_cache": {"teachers": [{**t, "name": "a", "cache": str(tmp_path / "c")},
                                        {**t, "name": "b"}]},
    }
    with pytest.raises(ValueError) as err:
        _parse(tmp_path, configs[config] if isinstance(config, str) else config, extra, world)
    assert message in str(err.value), str(err.value)


def test_teachers_file_defaults_come_from_the_flags(tmp_path):
    """A key an entry leaves out takes the run's flag; the flag form is the one-teacher case."""
    t = _teacher(tmp_path)
    args = _parse(tmp_path, {"teachers": [{**t, "name": "a", "kd_topk": 8}, {**t, "name": "b"}]},
                  ["--kd-loss", "pkl", "--kd-topk", "32", "--kd-temperature", "2",
                   "--teacher-combination", "select"])
    assert [s.kd_topk for s in args.teachers] == [8, 32]
    assert [s.kd_temperature for s in args.teachers] == [2.0, 2.0]
    assert args.teacher_combination == "select"
    view = args.teachers[0].view(args)
    assert view.kd_topk == 8 and view.teacher_load == str(tmp_path) and view.teacher_name == "a"


def test_each_teacher_takes_its_compact_gold_sizes(tmp_path):
    """kd_gold_topk / kd_gold_uncommon_topk per teacher, else the flags; each teacher's payload
    form follows its own (0 / 0: the full gold payload); negative sizes are refused."""
    from megatron_xdistill.training.kd_adapter import payload_form

    t = {**_teacher(tmp_path), "kd_loss": "hkl"}
    args = _parse(tmp_path, {"teachers": [
        {**t, "name": "a", "kd_gold_topk": 16},
        {**t, "name": "b", "kd_gold_topk": 0, "kd_gold_uncommon_topk": 0}]},
        ["--kd-gold-uncommon-topk", "128"])
    assert [(s.kd_gold_topk, s.kd_gold_uncommon_topk) for s in args.teachers] == [(16, 128),
                                                                                 (0, 0)]
    views = [s.view(args) for s in args.teachers]
    assert (views[0].kd_gold_topk, views[0].kd_gold_uncommon_topk) == (16, 128)
    assert [payload_form(v.kd_loss, v.kd_topk, v.kd_topk_mode, v.kd_gold_topk,
                         v.kd_gold_uncommon_topk) for v in views] == ["gold_topk", "gold"]
    with pytest.raises(ValueError, match="must be >= 0"):
        _parse(tmp_path, {"teachers": [{**t, "name": "a", "kd_gold_topk": -1},
                                       {**t, "name": "b"}]})


def test_disaggregated_teachers_get_ranks_of_their_own(tmp_path):
    """Disaggregated: the student's ranks first, then each teacher's own 'ranks', in order; a
    teacher's layout must fit its own ranks."""
    from megatron_xdistill.parallel.placement import Placement

    t = _teacher(tmp_path)
    disagg = ["--teacher-placement", "disaggregated"]
    config = {"teachers": [{**t, "name": "a", "ranks": 2, "tensor_model_parallel_size": 2},
                           {**t, "name": "b", "ranks": 1}]}
    args = _parse(tmp_path, config, disagg, world=4)
    placement = Placement.from_args(args, 4)
    assert placement.student_global_ranks() == [0]
    assert placement.teacher_global_ranks_of(0) == [1, 2]
    assert placement.teacher_global_ranks_of(1) == [3]
    assert [placement.is_teacher_of(3, k) for k in (0, 1)] == [False, True]
    config["teachers"][0]["ranks"] = 1  # TP 2 on one rank
    with pytest.raises(ValueError, match="teacher 'a'"):
        _parse(tmp_path, config, disagg, world=3)
    # one teacher in the file: its own 'ranks' count as --teacher-ranks (a key over the flag)
    one = {"teachers": [{**t, "name": "a", "ranks": 2, "tensor_model_parallel_size": 2}]}
    placement = Placement.from_args(_parse(tmp_path, one, disagg, world=3), 3)
    assert placement.student_global_ranks() == [0] and placement.teacher_global_ranks() == [1, 2]
    placement = Placement.from_args(_parse(tmp_path, one, [*disagg, "--teacher-ranks", "1"],
                                           world=3), 3)
    assert placement.teacher_global_ranks() == [1, 2]
