"""A study that can decide: CE-only vs cross-tokenizer distillation, several seeds, two held-outs.

    python examples/cross_tokenizer_distillation/study.py [experiment=signal|real] [overrides]

*signal* (a): a Llama-shaped student from random init (its own tokenizer, study.yaml) learns from
a real pretrained teacher with another tokenizer on Shakespeare + English Wikipedia; held out:
four Shakespeare works and the Wikipedia validation articles. Seeds change the student's
initialisation; the data order is the same for every run, so each seed is a paired comparison.
*real* (b): the demo pair (pretrained SmolLM2-135M, Qwen2.5-Coder-0.5B teacher) on the CPython
standard library split by module; seeds change the data order. Held out: the stdlib modules not
trained on (which both models may have seen in pretraining) and ``data/fresh_code.jsonl``, 16
modules of this repository written in 2026, after both models were trained.

The teacher runs once per payload form: ``pretrain_xdistill.py --teacher-cache-only`` fills a
payload cache that every run of that form reads (``--teacher-cache``), so a variant costs a
student's training only. A variant with ``extra_teachers`` distils from several teachers at once
(``--teachers-config``, weights 1/n summed); each teacher fills its own cache in one pass.
Every stage is resumable: runs continue from their last checkpoint, teacher passes from their last committed shard, finished stages are skipped; a run recorded in ``results/<exp>.json`` beside this file (kept with
the example, so a study can span machines) with the same settings is not run again. ``REPORT-<exp>.md``
(mean +- std over seeds per held-out set, differences to CE-only called real only beyond twice
the seed spread, paired training curves) is rewritten from ``work_dir/results.json``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for path in (REPO, HERE):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from run import _digest, machine, say  # noqa: E402
from study_report import write_report  # noqa: E402
from study_setup import setup  # noqa: E402

from megatron_xdistill.demo import provenance  # noqa: E402
from megatron_xdistill.demo.workflow import (  # noqa: E402
    ModelPair,
    build_projection,
    convert_to_megatron,
    cpu_env,
    pretrain_command,
    read_metrics,
    run_command,
)

# --------------------------------------------------------------------------- training
# The held-out set of each experiment's in-training curve (--valid-data-path). It is part of
# every run's settings: another set would start every run over.
IN_LOOP = {"signal": "enwiki", "real": "stdlib"}


def _options(cfg, data: dict, variant: dict, seed: int) -> dict:
    """``pretrain_xdistill.py`` arguments shared by a run and its teacher pass."""
    exp = cfg[cfg.experiment]
    return {
        "data-path": str(data["train"]), "valid-data-path": str(data[IN_LOOP[cfg.experiment]]),
        "seq-length": exp.seq_length, "teacher-seq-length": exp.teacher_seq_length,
        "micro-batch-size": exp.micro_batch_size, "global-batch-size": exp.global_batch_size,
        "train-iters": exp.steps, "lr": exp.lr, "min-lr": exp.min_lr,
        "lr-warmup-iters": exp.lr_warmup_iters, "lr-decay-style": "cosine",
        "weight-decay": exp.weight_decay, "clip-grad": 1.0,
        # signal: one data order for every seed (the seed is the student's initialisation)
        "seed": 1234 if cfg.experiment == "signal" else seed,
        "kd-loss": variant["kd_loss"], "kd-weight": variant["kd_weight"],
        "ce-weight": variant["ce_weight"], **_kd(cfg, variant), **_epochs(variant),
        "eval-interval": exp.eval_interval, "eval-iters": exp.eval_iters,
        "log-interval": 10, "num-workers": 1,
    }


def _epochs(variant: dict) -> dict:
    """A variant's ``samples_per_epoch``: its steps make passes over that many samples (the
    same text again, as when fine-tuning on a small set) instead of new text every step."""
    n = variant.get("samples_per_epoch")
    return {} if n is None else {"samples-per-epoch": int(n)}


def _kd(cfg, variant: dict) -> dict:
    """The payload and KD settings of a variant: the shared ``kd`` block, overridden by the
    variant's own ``topk`` / ``topk_mode`` / ``temperature`` / ``dynamic_scaling`` /
    ``skip_student_split`` / ``first_token`` (the last three are student-side: the teacher
    cache is shared). Gold / H-KL: the compact payload's ``gold_topk`` /
    ``gold_uncommon_topk``, 0 / 0 (the full payload) where the variant sets none."""
    get = lambda key: variant.get(key, cfg.kd.get(key))  # noqa: E731
    out = {"kd-temperature": get("temperature")}
    if variant["kd_loss"] in ("gold", "hkl"):  # each loss takes its own payload flags only
        out["kd-gold-topk"] = int(variant.get("gold_topk", 0))
        out["kd-gold-uncommon-topk"] = int(variant.get("gold_uncommon_topk", 0))
    else:
        out |= {"kd-topk": get("topk"), "kd-topk-mode": get("topk_mode")}
    if get("dynamic_scaling"):
        out["kd-dynamic-scaling"] = True
    if get("skip_student_split"):
        out["kd-skip-student-split-chunks"] = True
    if get("first_token"):
        out["kd-first-token"] = True
    return out


def _form(cfg, variant: dict, seed: int) -> str:
    """The payload form of a variant (what its teacher cache holds)."""
    from megatron_xdistill.training.kd_adapter import payload_form

    order = "" if cfg.experiment == "signal" else f"-seed{seed}"
    kd = _kd(cfg, variant)
    plan = _epochs(variant).get("samples-per-epoch")
    # the gold form ships every common pair (no top-k): the payload top-k is not part of it
    form = payload_form(variant["kd_loss"], kd.get("kd-topk"), kd.get("kd-topk-mode"),
                        kd.get("kd-gold-topk", 0), kd.get("kd-gold-uncommon-topk", 0))
    columns = ("" if form == "gold" else
               f"-g{kd['kd-gold-topk']}u{kd['kd-gold-uncommon-topk']}" if form == "gold_topk"
               else f"-top{kd['kd-topk']}{kd['kd-topk-mode']}")
    return (f"{variant['kd_loss']}{columns}-T{kd['kd-temperature']}{order}"
            f"{'' if plan is None else f'-plan{plan}'}")


def _cache_variant(cfg, variant: dict) -> dict:
    """The variant whose teacher cache ``variant`` reads: a chunk top-k below the shared
    ``kd.topk`` (same temperature) reads the shared cache, narrowed on read, so the payload
    top-k knob costs no teacher pass. A compact gold / H-KL variant at most
    ``compact_gold_cache``'s sizes reads that cache, narrowed likewise."""
    own = _kd(cfg, variant)
    big = cfg.get("compact_gold_cache")
    if big is not None and own.get("kd-gold-topk") and own.get("kd-gold-uncommon-topk"):
        if (own["kd-gold-topk"] <= big.gold_topk
                and own["kd-gold-uncommon-topk"] <= big.gold_uncommon_topk):
            return {**variant, "gold_topk": big.gold_topk,
                    "gold_uncommon_topk": big.gold_uncommon_topk}
        return variant
    shared = _kd(cfg, {"kd_loss": "pkl"})
    if (own.get("kd-topk-mode") == shared["kd-topk-mode"] == "chunk"
            and own["kd-temperature"] == shared["kd-temperature"]
            and 0 < own["kd-topk"] < shared["kd-topk"]):
        return {**variant, "topk": shared["kd-topk"]}
    return variant


def _cache_dir(cfg, work: Path, variant: dict, seed: int) -> Path:
    return work / "teacher_cache" / _form(cfg, variant, seed)


def teacher_names(cfg, variant: dict) -> list[str]:
    """The teachers of a variant: the experiment's teacher, then the variant's
    ``extra_teachers`` (two or more make a ``--teachers-config`` run)."""
    return [cfg[cfg.experiment].teacher, *variant.get("extra_teachers", [])]


def teacher_models(cfg, pair: ModelPair, names: list[str]) -> list[ModelPair]:
    """``pair`` with each named teacher in its place: fetched, converted and projected onto the
    student's tokenizer (all cached)."""
    from megatron_xdistill.demo.assets import fetch_model

    student = (cfg.signal.student_tokenizer if cfg.experiment == "signal" else pair.student)
    out = []
    for name in names:
        if name == pair.teacher:
            out.append(pair)
            continue
        hf = fetch_model(name, log=say)
        out.append(ModelPair(name, pair.student, hf, pair.student_hf,
                             convert_to_megatron(name, hf, say), pair.student_ckpt,
                             build_projection(student, name, pair.student_hf, hf, say)))
    return out


def teachers_file(cfg, work: Path, pair: ModelPair, variant: dict, seed: int
                  ) -> tuple[Path, list[Path]]:
    """The ``--teachers-config`` of a several-teacher variant (each teacher's checkpoint,
    tokenizer, projection, its own payload cache, and weight 1/n; combination: sum) and the
    caches it names. Every teacher decides the packing cuts, so its cache is named with the
    whole set."""
    import yaml

    names = teacher_names(cfg, variant)
    group = "+".join(names)
    form = _form(cfg, variant, seed)
    teachers = [{"name": model.teacher.split("-")[0].split(".")[0],
                 "load": str(model.teacher_ckpt), "tokenizer_model": str(model.teacher_hf),
                 "projection_path": str(model.projection), "weight": 1.0 / len(names),
                 "cache": str(work / "teacher_cache" / f"{form}-{model.teacher}-with-{group}")}
                for model in teacher_models(cfg, pair, names)]
    path = work / "teacher_cache" / f"{form}-{group}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump({"teachers": teachers, "combination": "sum"}, sort_keys=False)
    if not path.is_file() or path.read_text() != text:
        path.write_text(text)
    return path, [Path(t["cache"]) for t in teachers]


def teacher_pass(cfg, work: Path, pair: ModelPair, data: dict, variant: dict, seed: int) -> dict:
    """Fill the payload cache(s) of a variant's form (skipped when complete; resumes otherwise):
    the ``pretrain_xdistill.py`` options that read them (``--teacher-cache`` or, for several
    teachers, ``--teachers-config`` whose teachers each name their cache)."""
    from megatron_xdistill.teacher_cache import cache_is_complete

    if len(teacher_names(cfg, variant)) > 1:
        config, caches = teachers_file(cfg, work, pair, variant, seed)
        reading = {"teachers-config": str(config)}
        log = config.with_suffix(".log")
    else:
        caches = [_cache_dir(cfg, work, variant, seed)]
        reading = {"teacher-cache": str(caches[0])}
        log = caches[0].parent / f"{caches[0].name}.log"
    if all(cache_is_complete(cache) for cache in caches):
        return reading
    say(f"teacher pass -> {', '.join(cache.name for cache in caches)}")
    options = {**_options(cfg, data, variant, seed), **reading, "teacher-cache-only": True,
               "kd-weight": 1.0, "log-interval": 10,
               "data-cache-path": str(work / "data_cache")}
    options.pop("valid-data-path"), options.pop("eval-interval")
    log.parent.mkdir(parents=True, exist_ok=True)
    run_command(pretrain_command(pair, cfg.nproc, options), say,
                env=cpu_env(cfg.threads_per_rank), stdout_path=log)
    return reading


def _finished(ckpt: Path) -> int:
    tracker = ckpt / "latest_checkpointed_iteration.txt"
    text = tracker.read_text().strip() if tracker.is_file() else ""
    return int(text) if text.isdigit() else 0


# Options that decide nothing of a run's result: a stamp that differs only in them is the same
# run (changing how often it saves must not start it over).
_NEUTRAL_OPTIONS = ("save-interval", "keep-last-checkpoints")


def _deciding(settings: dict) -> dict:
    """A run's stamp without the options that do not change its result (JSON round trip)."""
    settings = json.loads(json.dumps(settings))
    for key in _NEUTRAL_OPTIONS:
        settings.get("options", {}).pop(key, None)
    return settings


def train_run(cfg, work: Path, pair: ModelPair, data: dict, name: str, seed: int) -> Path:
    """One (variant, seed) run; resumes from its checkpoints, skipped once finished."""
    variant = dict(cfg.variants[name])
    run_dir = work / "runs" / f"{name}-seed{seed}"
    options = {**_options(cfg, data, variant, seed),
               "metrics-file": str(run_dir / "metrics.jsonl"),
               "data-cache-path": str(work / "data_cache"), "save": str(run_dir / "ckpt"),
               "save-interval": cfg.save_interval, "keep-last-checkpoints": 1}
    if variant["kd_weight"] > 0:
        options.update(teacher_pass(cfg, work, pair, data, _cache_variant(cfg, variant), seed))
    stamp = run_dir / "settings.json"
    settings = {"options": options, "student": str(pair.student_ckpt)}
    if stamp.is_file() and _deciding(json.loads(stamp.read_text())) != _deciding(settings):
        say(f"{run_dir.name}: settings changed; starting over")
        shutil.rmtree(run_dir)
    steps = cfg[cfg.experiment].steps
    if _finished(run_dir / "ckpt") >= steps:
        return run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    stamp.write_text(json.dumps(settings, indent=1))
    say(f"training {run_dir.name} ({cfg.variants[name].label}, seed {seed}; from step "
        f"{_finished(run_dir / 'ckpt')})")
    start = time.time()
    run_command(pretrain_command(pair, cfg.nproc, options), say,
                env=cpu_env(cfg.threads_per_rank), stdout_path=run_dir / "train.log")
    with open(run_dir / "seconds.txt", "a") as fh:
        fh.write(f"{time.time() - start:.1f}\n")
    return run_dir


def evaluate(cfg, work: Path, label: str, model_args: list[str], heldout: Path,
             stamp: str, known: Sequence[dict | None] = ()) -> dict:
    """Held-out bits per byte (``megatron_xdistill.evaluation``; cached by model and settings,
    also across machines and labels through ``known``: earlier evaluations, of which one with
    the same model, held-out text and settings is taken instead of running it again)."""
    args = [*model_args, "--data-path", str(heldout), "--seq-length", str(cfg.eval.seq_length),
            "--micro-batch-size", str(cfg.eval.micro_batch_size), "--max-chars",
            str(cfg.eval.max_chars)]
    key = _digest([args, stamp])
    out = work / "eval" / f"{label}.json"
    if out.is_file() and json.loads(out.read_text()).get("key") == key:
        return json.loads(out.read_text())
    for earlier in known:
        if earlier and earlier.get("key") == key:
            return earlier
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    run_command([sys.executable, "-m", "megatron_xdistill.evaluation", *args, "--json", str(tmp),
                 "--threads", str(cfg.nproc * cfg.threads_per_rank)], say)
    result = {**json.loads(tmp.read_text()), "key": key}
    out.write_text(json.dumps(result, indent=1))
    tmp.unlink()
    say(f"{label}: {result['bits_per_byte']:.4f} bits/byte")
    return result


# --------------------------------------------------------------------------- the study
def published_results(cfg) -> Path:
    """The results kept with the example (committed): a study spans machines and sessions, and
    a run whose settings are recorded there is not run again."""
    return HERE / "results" / f"{cfg.experiment}.json"


def run_settings(cfg, name: str, seed: int) -> str:
    """Digest of what decides a run's result (variant, experiment block, payload, seed), free
    of machine paths: equal digests are the same run."""
    from omegaconf import OmegaConf

    def plain(node):
        return OmegaConf.to_container(node, resolve=True)

    return _digest([cfg.experiment, plain(cfg.variants[name]), plain(cfg[cfg.experiment]),
                    plain(cfg.kd), plain(cfg.eval), seed])


def publishes(cfg) -> bool:
    """Whether this invocation's runs go to the published results: only when every variant to
    run has the settings ``study.yaml`` gives it. A quick look (``steps=20``, an overridden
    variant or evaluation) keeps its numbers in its work directory and never replaces the
    published runs or held-out scores of the study itself."""
    from omegaconf import OmegaConf

    defaults = OmegaConf.merge(OmegaConf.load(HERE / "study.yaml"),
                               {"experiment": cfg.experiment})
    return all(name in defaults.variants
               and run_settings(cfg, name, 1) == run_settings(defaults, name, 1)
               for name in cfg.variants_to_run)


def _write_results(cfg, work: Path, results: dict, publish: bool) -> None:
    text = json.dumps(results, indent=1)
    targets = [work / "results.json"] + ([published_results(cfg)] if publish else [])
    for path in targets:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(path)


def run_study(cfg) -> dict:
    from omegaconf import OmegaConf

    work = Path(cfg.work_dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    unknown = [v for v in cfg.variants_to_run if v not in cfg.variants]
    if unknown:
        raise ValueError(f"variants_to_run: unknown {unknown}; defined: {list(cfg.variants)}")
    exp = cfg[cfg.experiment]
    if exp.lr_warmup_iters >= exp.steps:
        raise ValueError(f"{cfg.experiment}.lr_warmup_iters ({exp.lr_warmup_iters}) must be "
                         f"smaller than {cfg.experiment}.steps ({exp.steps})")
    publish = publishes(cfg)
    if not publish:
        say(f"settings differ from study.yaml's: results stay in {work / 'results.json'}, "
            f"{published_results(cfg)} is left as it is")
    pairs, data = setup(cfg, work)
    heldouts = [k for k in data if k != "train"]
    results: dict = {"config": OmegaConf.to_container(cfg, resolve=True), "machine": machine(),
                     "runs": {}, "evals": {}}
    # Earlier invocations' runs (other variants or seeds, here or on another machine) stay
    # reported; the published copy is the one that travels with the example.
    for earlier in (published_results(cfg), work / "results.json"):
        if earlier.is_file():
            old = json.loads(earlier.read_text())
            if "provenance" in old:  # how the runs kept before this invocation were made
                results["provenance"] = old["provenance"]
            results["runs"].update(old.get("runs", {}))
            results["evals"].update(old.get("evals", {}))
    evals = results["evals"]
    first = pairs[cfg.seeds[0]]
    for name in heldouts:  # the teacher, and each seed's student before training
        evals[f"teacher/{name}"] = evaluate(
            cfg, work, f"teacher-{name}", ["--load", str(first.teacher_ckpt), "--tokenizer-model",
                                           str(first.teacher_hf)], data[name], "teacher",
            [evals.get(f"teacher/{name}")])
    extras = {t for v in cfg.variants_to_run for t in teacher_names(cfg, cfg.variants[v])[1:]}
    for model in teacher_models(cfg, first, sorted(extras)):  # the other teachers of the runs
        for name in heldouts:
            key = f"teacher-{model.teacher}/{name}"
            evals[key] = evaluate(
                cfg, work, key.replace("/", "-"), ["--load", str(model.teacher_ckpt),
                                                   "--tokenizer-model", str(model.teacher_hf)],
                data[name], "teacher", [evals.get(key)])
    for seed in cfg.seeds:  # seed-major: every variant of seed 1 first (early paired results)
        pair = pairs[seed]
        for name in heldouts:
            # a pretrained student is the same model for every seed (the seed orders the data):
            # another seed's evaluation of it is taken (the key compares checkpoint and settings)
            earlier = [e for k, e in evals.items() if k.startswith("before-s")
                       and k.endswith(f"/{name}")]
            evals[f"before-s{seed}/{name}"] = evaluate(
                cfg, work, f"before-s{seed}-{name}",
                ["--load", str(pair.student_ckpt), "--tokenizer-model", str(pair.student_hf)],
                data[name], f"before:{pair.student_ckpt}", earlier)
        for variant in cfg.variants_to_run:
            key = f"{variant}-s{seed}"
            settings = run_settings(cfg, variant, seed)
            done = results["runs"].get(key, {})
            if done.get("settings") == settings and all(f"{key}/{n}" in evals for n in heldouts):
                say(f"{key}: in the results with these settings; not run again")
                continue
            run_dir = train_run(cfg, work, pair, data, variant, seed)
            results["runs"][key] = {"variant": variant, "seed": seed, "settings": settings,
                                    **provenance.record(),  # the commit and command of this run
                                    "metrics": read_metrics(run_dir / "metrics.jsonl")}
            tracker = run_dir / "ckpt" / "latest_checkpointed_iteration.txt"
            for name in heldouts:
                evals[f"{key}/{name}"] = evaluate(
                    cfg, work, f"{key}-{name}", ["--load", str(run_dir / "ckpt")], data[name],
                    f"{run_dir}:{tracker.stat().st_mtime}")
            _write_results(cfg, work, results, publish)
    write_report(results, Path(cfg.report_dir).resolve())
    return results


def main() -> None:
    import hydra

    @hydra.main(config_path=str(HERE), config_name="study", version_base=None)
    def _main(cfg) -> None:
        run_study(cfg)

    _main()


if __name__ == "__main__":
    try:
        main()
    except subprocess.CalledProcessError as exc:
        say(f"failed: {' '.join(map(str, exc.cmd))} (exit {exc.returncode})")
        sys.exit(1)
