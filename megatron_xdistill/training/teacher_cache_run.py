"""``--teacher-cache`` in a run: open and check the cache before anything is built, and the
teacher-only pass (``--teacher-cache-only``) that fills it."""

from __future__ import annotations

import time

import torch.distributed as dist


def open_teacher_cache(args, tokenizers, log=print, k: int = 0,
                       num_samples: int | None = None):
    """``(cache, teacher ModelInfo, samples of the plan)`` of teacher ``k`` (``args``: the run's
    arguments as that teacher sees them, ``TeacherSpec.view``). Every rank compares the cache's
    key with this run's before any model is built or any collective runs, so a mismatch stops
    all ranks alike with the differing fields named. ``tokenizers``: the run's
    ``data.tokenizations.SampleTokenizers``. ``num_samples``: the plan's size when another
    teacher's complete cache decides it."""
    from megatron_xdistill import models as models_api
    from megatron_xdistill.data.sources import parse_data_path
    from megatron_xdistill.loss import payload_spec
    from megatron_xdistill.loss.definitions.payload import GOLD_FORMS
    from megatron_xdistill.projection.vocab import vocab_hash
    from megatron_xdistill.teacher_cache import TeacherCache, checkpoint_fingerprint
    from megatron_xdistill.teacher_cache.key import run_key
    from megatron_xdistill.training.kd_adapter import (
        gold_topk_sizes,
        load_or_build_projection,
        payload_columns,
        payload_form,
    )

    cache = TeacherCache(args.teacher_cache, teacher=k)
    reading = cache.reading
    several = len(tokenizers.teacher_tokenizers) > 1
    who = f"teacher {args.teacher_name!r} " if several else ""
    log(f"> {who}teacher cache {args.teacher_cache}: " + (
        "complete, reading payloads (the teacher is not loaded)" if reading
        else "filling it with this run's payloads"))
    teacher_info = (models_api.ModelInfo.from_dict(cache.manifest.teacher_model) if reading
                    else models_api.load_model_info(args.teacher_load))
    # A reading run trains on the cache's plan (epochs wrap around it).
    if reading:
        num_samples = cache.manifest.num_samples
    elif num_samples is None:
        num_samples = args.train_iters * args.global_batch_size
    form = payload_form(args.kd_loss, args.kd_topk, args.kd_topk_mode, args.kd_gold_topk,
                        args.kd_gold_uncommon_topk)
    common = None  # the teacher ids of the payload's fixed columns (gold / image forms)
    if form in (*GOLD_FORMS, "image"):
        if tokenizers.same_tokenizer[k] and args.load is None:
            raise ValueError(
                f"--teacher-cache-only without --load: {who.strip() or 'the teacher'} uses the "
                f"student's tokenizer, and its {form} payload's columns depend on the student "
                f"model's vocabulary: give --load STUDENT_CHECKPOINT")
        shared = (min(teacher_info.vocab_size, models_api.load_model_info(args.load).vocab_size)
                  if tokenizers.same_tokenizer[k] else None)
        common = payload_columns(form, load_or_build_projection(
            args.projection_path, args.tokenizer_model, args.teacher_tokenizer_model, log,
            shared), args.kd_loss)
    # the student's vocabulary as the run's KDObjective sees it (compact gold: the ranks n)
    student_vocab = (models_api.load_model_info(args.load).vocab_size if args.load is not None
                     else len(tokenizers.student_tokenizer))
    spec = payload_spec(form, args.seq_length + 1, teacher_info.vocab_size,
                        topk=args.kd_topk or None,
                        num_common=None if common is None or form not in GOLD_FORMS
                        else len(common),
                        num_image=None if common is None or form != "image" else len(common),
                        **gold_topk_sizes(args, student_vocab))
    teacher = (checkpoint_fingerprint(args.teacher_load) if args.teacher_load is not None
               else cache.manifest.key["teacher"]["checkpoint"])  # reading without a teacher
    key = run_key(
        teacher_checkpoint=teacher, bf16=args.bf16, fp16=bool(getattr(args, "fp16", False)),
        student_vocab_hash=vocab_hash(tokenizers.student_tokenizer),
        teacher_vocab_hash=vocab_hash(tokenizers.teacher_tokenizers[k]),
        sources=parse_data_path(args.data_path, "--data-path"), text_field=args.text_field,
        seq_length=args.seq_length, teacher_seq_length=args.teacher_seq_length, seed=args.seed,
        num_samples=num_samples, form=form, topk=args.kd_topk, temperature=args.kd_temperature,
        numel=spec.numel + int(getattr(args, "teacher_combination", "sum") == "select"),
        common_teacher_ids=common, split=args.split,
        gold_topk=((spec.width, spec.uncommon, spec.span, spec.pairs) if form == "gold_topk"
                   else None),
        packed_with=[(vocab_hash(t), s.seq_length) for t, s in zip(
            tokenizers.teacher_tokenizers, args.teachers, strict=True)] if several else None)
    cache.check(key)
    return cache, teacher_info, num_samples


def fill_teacher_cache(args, distiller, caches, dataset, log=print) -> int:
    """Each teacher over every step of the plan that its cache does not hold yet (a killed pass
    resumes at each cache's first incomplete step); progress on rank 0. Exit code 0 once every
    cache is complete."""
    from megatron_xdistill.data.loader import StepBatches, StepSampler

    gbs = args.global_batch_size
    plan_steps = -(-len(dataset) // gbs)  # one pass over the plan (--samples-per-epoch)
    for lane, cache in zip(distiller.lanes, caches, strict=True):
        lane.fill_from = cache.first_incomplete_step(gbs)
    start = min(lane.fill_from for lane in distiller.lanes)
    distiller.step = start
    served = [(lane.groups.coords["dp"], lane.layout) for lane in distiller.lanes]
    sampler = StepSampler(len(dataset), start, gbs, args.micro_batch_size, None,
                          distiller.student_layout, more_teachers=served)
    steps = StepBatches(dataset, sampler, args.num_workers)
    if start:
        log(f"> teacher cache: resuming at step {start + 1} ({start * gbs} samples held)")
    last = time.perf_counter()
    try:
        for step in range(start, plan_steps):
            distiller.train_step(next(steps))
            done = step + 1
            if done % args.log_interval == 0 or done == plan_steps:
                now = time.perf_counter()
                log(f"teacher cache step {done}/{plan_steps} | samples "
                    f"{min(done * gbs, len(dataset))}/{len(dataset)} | "
                    f"{args.log_interval * gbs / (now - last):.2f} samples/s | time_teacher "
                    f"{distiller.times.reset()['time_teacher']:.2f} s")
                last = now
            if args.exit_interval and done % args.exit_interval == 0:
                log(f"> exiting at step {done} (--exit-interval); rerun to continue")
                break
        complete = all([cache.close(dist.get_rank(), dist.barrier, log=log)
                        for cache in caches])
    finally:
        distiller.close()
    return 0 if complete else 1
