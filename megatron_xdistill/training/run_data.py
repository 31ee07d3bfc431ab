"""The run's data: tokenizers, the corpus read on rank 0, each teacher's sequence length, the
packing plans and each rank's share of the documents (``pretrain_xdistill.py``'s setup before
any model is built)."""

from __future__ import annotations

import os

import torch.distributed as dist

from megatron_xdistill.training.user_errors import SHARED_MARK


def log(message: str) -> None:
    """Print on rank 0."""
    if dist.get_rank() == 0:
        print(message, flush=True)


def load_tokenizers(args):
    """The student's and every teacher's tokenizer (each directory loaded once)."""
    from megatron_xdistill.align import load_tokenizer
    from megatron_xdistill.data.tokenizations import SampleTokenizers

    loaded: dict[str, object] = {}

    def get(path: str):
        if path not in loaded:
            loaded[path] = load_tokenizer(path)
        return loaded[path]

    return SampleTokenizers(get(args.tokenizer_model),
                            [get(spec.tokenizer_model) for spec in args.teachers])


def check_vocabularies(args, tokenizers) -> None:
    """Each checkpoint against its tokenizer, before anything is built."""
    from megatron_xdistill import models as models_api

    sides = [] if args.load is None else [  # no student in a --teacher-cache-only pass
        ("student", args.load, tokenizers.student_tokenizer, args.tokenizer_model)]
    several = len(args.teachers) > 1
    for spec, tokenizer in zip(args.teachers, tokenizers.teacher_tokenizers, strict=True):
        if spec.load is not None:
            sides.append((f"teacher {spec.name!r}" if several else "teacher", spec.load,
                          tokenizer, spec.tokenizer_model))
    for who, ckpt, tokenizer, tokenizer_path in sides:
        models_api.check_tokenizer_fits(models_api.load_model_info(ckpt), len(tokenizer), ckpt,
                                        tokenizer_path, who)


def _documents(args, paths, what: str):
    """``(sources, documents, documents per source)`` of ``--data-path`` / ``--valid-data-path``."""
    from megatron_xdistill.data.packing import load_documents
    from megatron_xdistill.data.sources import parse_data_path

    sources = parse_data_path(paths, "--data-path" if what == "train" else "--valid-data-path")
    return (sources, *load_documents(sources, args.text_field, data_tokenizer(args, sources)))


def data_tokenizer(args, sources) -> str | None:
    """The tokenizer that decodes the Megatron indexed datasets among ``sources`` (None when
    there are none): --data-tokenizer-model, else --tokenizer-model as in Megatron-LM."""
    from megatron_xdistill.data.indexed import is_indexed_prefix

    if not any(is_indexed_prefix(s.path) for s in sources):
        return None
    return args.data_tokenizer_model or args.tokenizer_model


def _derive_teacher_lengths(args, documents, tokenizers) -> list[int]:
    """Each teacher's sequence length: given, the student's for a teacher with the student's
    tokenizer, else derived from the data (rank 0, which holds the documents; :func:`read_corpus`
    hands the lengths to the others)."""
    from megatron_xdistill.data.lengths import teacher_length_from_data
    from megatron_xdistill.training.arguments.checks import sequence_multiple

    lengths = []
    several = len(args.teachers) > 1
    for k, spec in enumerate(args.teachers):
        aligner = tokenizers.aligners[k]
        if aligner is None:  # the student's tokenizer: the student's tokens, the student's length
            if spec.seq_length not in (None, args.seq_length):
                raise ValueError(
                    f"teacher {spec.name!r} uses the student's tokenizer, so it reads the "
                    f"student's tokens: its seq_length must be --seq-length {args.seq_length} "
                    f"(or unset), got {spec.seq_length}")
            lengths.append(args.seq_length)
        elif spec.seq_length is not None:
            lengths.append(spec.seq_length)
        else:
            view = spec.view(args)
            choice = teacher_length_from_data(documents, aligner, args.seq_length,
                                              multiple=sequence_multiple(view, "teacher"))
            lengths.append(choice.teacher_seq_length)
            log(f"> {'teacher ' + repr(spec.name) + ': ' if several else ''}"
                 f"{choice.describe()}")
    return lengths


def _set_teacher_lengths(args, lengths: list[int]) -> None:
    """Record each teacher's length in its spec (``--teacher-seq-length``: the first's),
    checked against its layout."""
    from megatron_xdistill.training.arguments.checks import check_sequence_length

    args.teachers = [spec.with_seq_length(n) for spec, n in zip(args.teachers, lengths,
                                                                strict=True)]
    args.teacher_seq_length = lengths[0]
    for spec in args.teachers:
        check_sequence_length(spec.view(args), "teacher", spec.seq_length)


def on_rank0(fn):
    """``fn()`` on rank 0; its result, or the error it raised on bad input, on every rank (the
    others wait in the broadcast instead of each reading the inputs themselves)."""
    import pickle

    box = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = ("ok", fn())
        except Exception as exc:  # noqa: BLE001 - every rank must leave the broadcast
            try:
                pickle.dumps(exc)
            except Exception:  # noqa: BLE001 - an error that cannot travel: its text does
                exc = RuntimeError(f"rank 0: {type(exc).__name__}: {exc}")
            box[0] = ("error", exc)
    dist.broadcast_object_list(box, src=0)
    status, value = box[0]
    if status == "error":
        setattr(value, SHARED_MARK, True)  # every rank raises it: rank 0 alone reports it
        raise value
    return value


def read_corpus(args, tokenizers) -> tuple[dict, object, object]:
    """Rank 0 reads ``--data-path`` (and ``--valid-data-path``) whole, splits it (``--split``)
    and derives the teacher's length; every rank gets the numbering of the planned documents.
    Returns (rank 0's documents for planning, or {} elsewhere; the training numbering; the
    validation numbering or None)."""
    from megatron_xdistill.data.document_share import DocumentNumbering
    from megatron_xdistill.data.sources import parse_data_path
    from megatron_xdistill.data.split import split_loaded, split_ranges

    loaded: dict = {}

    def read() -> dict:
        if args.on_policy:  # --data-path holds prompts (onpolicy.prompts), not documents
            valid = _documents(args, args.valid_data_path, "valid") \
                if args.valid_data_path else None
            loaded["train"], loaded["valid"] = None, valid
            return {"train": None, "valid": None if valid is None else valid[2],
                    "teacher_seq_lengths": _derive_teacher_lengths(args, [], tokenizers)}
        train = _documents(args, args.data_path, "train")
        loaded["train"], loaded["valid"] = train, None
        if args.split is not None:
            loaded["train"], loaded["valid"] = split_loaded(train, args.split)
            log(f"> --split {args.split}: {len(loaded['train'][1])} training and "
                 f"{len(loaded['valid'][1])} validation documents of --data-path")
        elif args.valid_data_path:
            loaded["valid"] = _documents(args, args.valid_data_path, "valid")
        lengths = _derive_teacher_lengths(args, loaded["train"][1], tokenizers)
        valid = loaded["valid"]
        return {"train": train[2], "valid": None if args.split or valid is None else valid[2],
                "teacher_seq_lengths": lengths}

    meta = on_rank0(read)
    _set_teacher_lengths(args, meta["teacher_seq_lengths"])
    if args.split is not None:
        sources = parse_data_path(args.data_path)
        parts = [split_ranges(args.split, c) for c in meta["train"]]
        train = DocumentNumbering(sources, [p[0] or (0, 0) for p in parts])
        valid = DocumentNumbering(sources, [p[1] or (0, 0) for p in parts])
        return loaded, train, valid
    train = None if args.on_policy else DocumentNumbering.whole(parse_data_path(args.data_path),
                                                                meta["train"])
    valid = None if meta["valid"] is None else DocumentNumbering.whole(
        parse_data_path(args.valid_data_path, "--valid-data-path"), meta["valid"])
    return loaded, train, valid


def packing_plan(args, numbering, tokenizers, num_samples: int, what: str, loaded=None):
    """Packing plan of the documents of ``numbering``: rank 0 builds it from ``loaded`` (its
    documents, read whole) or finds it in the cache, and writes it; the others read it."""
    from megatron_xdistill.data.packing import build_plan, load_plan, plan_key, save_plan

    sources = numbering.sources
    key = plan_key(sources, args.text_field, args.tokenizer_model,
                   [spec.tokenizer_model for spec in args.teachers], args.seq_length,
                   teacher_lengths(args), args.seed, num_samples,
                   data_tokenizer(args, sources), args.split)
    cache = args.data_cache_path
    path = os.path.join(cache, f"{what}_plan_{key}.npz")
    if dist.get_rank() == 0:
        plan = load_plan(path, key)
        if plan is None:
            _, documents, counts = loaded
            log(f"> packing {what} data ({len(documents)} documents) into {num_samples} samples")
            plan = build_plan(documents, sources, counts, tokenizers, args.seq_length,
                              teacher_lengths(args), args.seed, num_samples, key=key,
                              log=log)
            save_plan(plan, path)
    dist.barrier()
    plan = load_plan(path, key)
    if plan is None:
        raise RuntimeError(f"rank {dist.get_rank()}: packing plan {path} missing after rank 0 "
                           f"wrote it (is {cache} on a shared file system?)")
    return plan


def plan_size(args) -> int:
    """Samples of the training plan (training wraps around it): --samples-per-epoch, default
    --train-iters x --global-batch-size, or the plan of the teachers' complete caches (which
    must agree with each other and with --samples-per-epoch), which a run reading them trains
    on."""
    from megatron_xdistill.teacher_cache import TeacherCache

    sizes = {}
    for spec in args.teachers:
        if spec.cache is not None:
            cache = TeacherCache(spec.cache)
            if cache.reading:
                sizes[spec.cache] = cache.manifest.num_samples
    if len(set(sizes.values())) > 1:
        raise ValueError(f"the teachers' complete caches hold plans of different sizes "
                         f"({sizes}): they were not filled for the same run; refill one")
    wanted = args.samples_per_epoch
    if sizes and wanted is not None and wanted not in sizes.values():
        path, held = next(iter(sizes.items()))
        raise ValueError(f"--samples-per-epoch {wanted} differs from the plan of the complete "
                         f"teacher cache {path} ({held} samples): give --samples-per-epoch "
                         f"{held} (or drop it), or fill a new cache for {wanted} samples")
    if sizes:
        return next(iter(sizes.values()))
    return wanted if wanted is not None else args.train_iters * args.global_batch_size


def teacher_lengths(args) -> list[int]:
    return [spec.seq_length for spec in args.teachers]


def document_share(args, numbering, plan, samples, loaded=None):
    """This rank's documents: those the plan cuts ``samples`` from (see document_share), read
    from their files, or taken from ``loaded`` (rank 0's documents, read whole to plan)."""
    from megatron_xdistill.data.document_share import DocumentShare, documents_of_samples

    ids = documents_of_samples(plan, samples)
    if loaded is not None:
        share = DocumentShare.take(loaded[1], ids)
    else:
        share = DocumentShare.read(numbering, ids, args.text_field,
                                   data_tokenizer(args, numbering.sources))
    log(f"> rank 0 holds {len(share)} of {share.total} documents")
    return share
