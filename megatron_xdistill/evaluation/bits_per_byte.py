"""Bits per byte of a causal LM on text files: one scale for models with different tokenizers.

    python -m megatron_xdistill.evaluation --load CKPT --data-path held_out.jsonl [--tokenizer DIR]
    python -m megatron_xdistill.evaluation --hf-dir DIR --data-path held_out.jsonl

``--load`` takes a converted checkpoint (``xdistill-convert hf-to-mcore``) or a training run
(its latest iteration) and runs the Megatron GPTModel in one process on the CPU (fp32, gloo);
``--hf-dir`` runs the Hugging Face model with ``transformers``. Both give the same number for the
same weights.

Definition (what makes the number comparable across tokenizers): every document is tokenised
without special tokens and prefixed by one start token (the tokenizer's BOS when it adds one by
itself, else its EOS, the token that separates documents in packed training data; BOS when it has
no EOS); the sequence is cut into windows of ``--seq-length`` predictions so that every text
token is predicted exactly once (window k's inputs end with the token window k+1 starts from);
bits per byte = total negative log-likelihood (nats) / ln 2 / total UTF-8 bytes of the documents.
The byte count depends only on the text, so a model with a coarser tokenizer is not favoured.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

#: logits of a [batch, length] id tensor: [batch, length, real vocabulary] (float).
LogitsFn = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class EvalResult:
    """Totals over the documents and the two per-unit numbers derived from them."""

    documents: int
    tokens: int  # predicted text tokens (= text tokens of all documents)
    bytes: int  # UTF-8 bytes of all documents
    nats: float  # total negative log-likelihood
    ce_per_token: float
    bits_per_byte: float
    seconds: float = 0.0
    model: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def start_token(tokenizer) -> int:
    """The token each document is conditioned on (see the module docstring)."""
    probe = tokenizer("a", add_special_tokens=True)["input_ids"]
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    if bos is not None and probe and probe[0] == bos:
        return int(bos)
    if eos is not None:
        return int(eos)
    if bos is not None:
        return int(bos)
    raise ValueError(f"tokenizer {tokenizer.name_or_path!r} has neither a BOS nor an EOS token")


def document_windows(ids: Sequence[int], start: int, seq_length: int) -> list[list[int]]:
    """Windows of ``start + ids``: each is ``inputs + [last target]`` with at most
    ``seq_length`` predictions; consecutive windows share one token, so every id is a target
    exactly once."""
    sequence = [start, *ids]
    return [sequence[k : k + seq_length + 1] for k in range(0, len(sequence) - 1, seq_length)]


def read_texts(paths: Sequence[str], text_field: str = "text", max_docs: int | None = None,
               max_chars: int | None = None, data_tokenizer: str | None = None) -> list[str]:
    """Documents of the files in order (``max_docs`` first ones, each cut to ``max_chars``);
    ``data_tokenizer`` decodes Megatron indexed datasets (``PREFIX.bin/.idx``)."""
    from megatron_xdistill.data.sources import read_documents

    docs: list[str] = []
    for path in paths:
        docs.extend(read_documents(path, text_field, data_tokenizer))
        if max_docs is not None and len(docs) >= max_docs:
            break
    docs = docs[:max_docs] if max_docs is not None else docs
    if max_chars is not None:
        docs = [d[:max_chars] for d in docs]
    docs = [d for d in docs if d]
    if not docs:
        raise ValueError(f"no (non-empty) documents in {list(paths)}")
    return docs


def score(logits_fn: LogitsFn, windows: list[list[int]], micro_batch_size: int, pad_id: int,
          progress: Callable[[int, int], None] | None = None) -> tuple[float, int]:
    """Total NLL (nats, float64) and predicted-token count over ``windows``.

    Windows are right-padded within a micro-batch; a causal model's predictions at real
    positions do not see the padding, and padded targets are not counted.
    """
    order = sorted(range(len(windows)), key=lambda i: -len(windows[i]))  # little padding
    nats, count = 0.0, 0
    for start in range(0, len(order), micro_batch_size):
        batch = [windows[i] for i in order[start : start + micro_batch_size]]
        width = max(len(w) for w in batch) - 1
        inputs = torch.full((len(batch), width), pad_id, dtype=torch.long)
        targets = torch.full((len(batch), width), -100, dtype=torch.long)
        for row, window in enumerate(batch):
            inputs[row, : len(window) - 1] = torch.tensor(window[:-1])
            targets[row, : len(window) - 1] = torch.tensor(window[1:])
        with torch.no_grad():
            logits = logits_fn(inputs).float()
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-100,
                reduction="sum")
        nats += float(loss.double())
        count += int((targets != -100).sum())
        if progress is not None:
            progress(min(start + micro_batch_size, len(order)), len(order))
    return nats, count


def evaluate_texts(logits_fn: LogitsFn, tokenizer, documents: Sequence[str], seq_length: int = 512,
                   micro_batch_size: int = 4, log: Callable[[str], None] | None = None,
                   model: str = "") -> EvalResult:
    """Bits per byte of ``logits_fn`` on ``documents`` (see the module docstring)."""
    if seq_length < 1:
        raise ValueError(f"--seq-length must be >= 1, got {seq_length}")
    t0 = time.perf_counter()
    start = start_token(tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else start
    windows: list[list[int]] = []
    num_bytes = 0
    for text in documents:
        ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
        windows.extend(document_windows(ids, start, seq_length))
        num_bytes += len(text.encode("utf-8"))
    last = [0.0]

    def progress(done: int, total: int) -> None:
        now = time.perf_counter()
        if log is not None and (now - last[0] > 30 or done == total):
            last[0] = now
            log(f"  {done}/{total} windows ({now - t0:.0f} s)")

    nats, tokens = score(logits_fn, windows, micro_batch_size, pad, progress)
    return EvalResult(documents=len(documents), tokens=tokens, bytes=num_bytes, nats=nats,
                      ce_per_token=nats / max(tokens, 1),
                      bits_per_byte=nats / (math.log(2) * max(num_bytes, 1)),
                      seconds=round(time.perf_counter() - t0, 2), model=model)


# ---------------------------------------------------------------------------------- models
def hf_logits_fn(hf_dir: str, dtype: torch.dtype = torch.float32) -> LogitsFn:
    """A Hugging Face causal LM (eager attention) as a logits function."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype, attn_implementation="eager")
    model.eval()

    def logits(tokens: torch.Tensor) -> torch.Tensor:
        return model(tokens, use_cache=False).logits

    return logits


def single_process_world() -> bool:
    """A one-rank gloo world unless one exists; returns whether it was created here."""
    import torch.distributed as dist

    from megatron_xdistill.mcore import compat as mcore_compat

    mcore_compat.install()
    if dist.is_initialized():
        return False
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return True


def quiet_loading() -> None:
    """Silence notes that say nothing here: torch DCP's single-process / argument-order notes and
    GPTModel's deprecation notice."""
    import logging
    import warnings

    logging.getLogger("megatron.core.models.gpt.gpt_model").setLevel(logging.ERROR)
    for pattern in (r".*torch.distributed is disabled.*", r".*argument order of load.*"):
        warnings.filterwarnings("ignore", message=pattern)


def single_process_model(load: str, dtype: torch.dtype = torch.float32):
    """A Megatron checkpoint (converted or a training run) as GPTModel at TP = PP = 1 in this
    process, in eval mode: ``(model, groups, model info)``. Needs a one-rank torch.distributed
    world (see :func:`single_process_world`)."""
    import torch.distributed as dist

    from megatron_xdistill.models import (
        build_model_for_layout,
        load_megatron_checkpoint,
        load_model_info,
    )
    from megatron_xdistill.parallel.layout import ParallelLayout, build_model_parallel_groups

    if dist.get_world_size() != 1:
        raise RuntimeError("megatron_xdistill.evaluation runs in one process (world size 1)")
    quiet_loading()
    info = load_model_info(load)
    groups = build_model_parallel_groups(ParallelLayout.for_world(1, who="evaluate"))
    model, _ = build_model_for_layout(info, groups, dtype, use_te=False,
                                      perform_initialization=False, use_cpu_initialization=True)
    load_megatron_checkpoint(model, load, groups.pg_collection)
    model.eval()
    return model, groups, info


def megatron_logits_fn(load: str, dtype: torch.dtype = torch.float32) -> LogitsFn:
    """A Megatron checkpoint (converted or a training run) as a logits function
    (:func:`single_process_model`; :func:`evaluate` creates the one-rank world when none
    exists)."""
    model, _, info = single_process_model(load, dtype)
    vocab = info.vocab_size  # columns past it are Megatron's vocabulary padding

    def logits(tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.size(1)).expand_as(tokens)
        return model(tokens, positions, None)[..., :vocab]

    return logits


def model_tokenizer_dir(load: str | None, hf_dir: str | None, tokenizer: str | None) -> str:
    if tokenizer is not None:
        return tokenizer
    if hf_dir is not None:
        return hf_dir
    from megatron_xdistill.models import hf_files_dir

    found = hf_files_dir(load)
    if found is None or not os.path.isfile(os.path.join(found, "tokenizer_config.json")):
        raise ValueError(f"{load} carries no tokenizer files (hf_files/); pass --tokenizer-model DIR "
                         "(the model's HF tokenizer directory)")
    return found


def check_inputs(data: Sequence[str], load: str | None, hf_dir: str | None) -> None:
    """Refuse a missing model folder or data file as missing, before a tokenizer or model is
    looked for in it (a missing --load would read as one without tokenizer files)."""
    from megatron_xdistill.data.indexed import is_indexed_prefix
    from megatron_xdistill.storage import require_directory, require_file

    if load is not None:
        require_directory(load, "--load")
    if hf_dir is not None:
        require_directory(hf_dir, "--hf-dir")
    for path in data:
        if not is_indexed_prefix(path):  # PREFIX.bin/.idx: the prefix itself is no file
            require_file(path, "--data-path")


def evaluate(data: Sequence[str], load: str | None = None, hf_dir: str | None = None,
             tokenizer: str | None = None, text_field: str = "text", seq_length: int = 512,
             micro_batch_size: int = 4, max_docs: int | None = None,
             max_chars: int | None = None, log: Callable[[str], None] | None = None,
             data_tokenizer: str | None = None) -> EvalResult:
    """Bits per byte of a Megatron checkpoint (``load``) or an HF folder (``hf_dir``).
    ``data_tokenizer``: decodes Megatron indexed datasets (default: the model's tokenizer)."""
    if (load is None) == (hf_dir is None):
        raise ValueError("give exactly one of --load and --hf-dir")
    check_inputs(data, load, hf_dir)
    from megatron_xdistill.align import load_tokenizer

    tokenizer_dir = model_tokenizer_dir(load, hf_dir, tokenizer)
    tok = load_tokenizer(tokenizer_dir)
    documents = read_texts(data, text_field, max_docs, max_chars, data_tokenizer or tokenizer_dir)
    what = load if load is not None else hf_dir
    if log is not None:
        log(f"loading {what}")
    created = load is not None and single_process_world()
    try:
        fn = megatron_logits_fn(load) if load is not None else hf_logits_fn(hf_dir)
        if log is not None:
            log(f"scoring {len(documents)} documents (windows of {seq_length} tokens)")
        return evaluate_texts(fn, tok, documents, seq_length, micro_batch_size, log=log,
                              model=os.path.abspath(what))
    finally:
        if created:
            import torch.distributed as dist

            dist.destroy_process_group()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="xdistill-evaluate",
                                description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--load", help="Megatron checkpoint: converted model or training run")
    which.add_argument("--hf-dir", help="Hugging Face model folder")
    p.add_argument("--data-path", "--data", dest="data", nargs="+", required=True,
                   help="text files: .jsonl/.parquet/.arrow (field --text-field) or .txt")
    p.add_argument("--text-field", default="text")
    p.add_argument("--tokenizer-model", "--tokenizer", dest="tokenizer", default=None,
                   help="HF tokenizer directory (default: the checkpoint's hf_files/ or --hf-dir)")
    p.add_argument("--data-tokenizer-model", default=None,
                   help="tokenizer that made the Megatron indexed datasets (PREFIX.bin/.idx) "
                        "among --data-path (default: the model's tokenizer)")
    p.add_argument("--seq-length", type=int, default=512, help="predictions per window")
    p.add_argument("--micro-batch-size", type=int, default=4, help="windows per forward")
    p.add_argument("--max-docs", type=int, default=None, help="only the first N documents")
    p.add_argument("--max-chars", type=int, default=None,
                   help="cut each document to its first N characters")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--json", default=None, help="also write the result to this file")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    def log(message: str) -> None:
        print(f"[evaluate] {message}", file=sys.stderr, flush=True)

    try:
        result = evaluate(args.data, load=args.load, hf_dir=args.hf_dir, tokenizer=args.tokenizer,
                          text_field=args.text_field, seq_length=args.seq_length,
                          micro_batch_size=args.micro_batch_size, max_docs=args.max_docs,
                          max_chars=args.max_chars, log=log,
                          data_tokenizer=args.data_tokenizer_model)
    except (ValueError, FileNotFoundError, NotADirectoryError) as exc:
        print(f"evaluate: error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # a damaged checkpoint (its module is loaded when it is raised)
        from megatron_xdistill.models import CheckpointError

        if not isinstance(exc, CheckpointError):
            raise
        print(f"evaluate: error: {exc}", file=sys.stderr)
        return 2
    print(f"documents {result.documents}  tokens {result.tokens}  bytes {result.bytes}  "
          f"CE/token {result.ce_per_token:.4f} nats  bits/byte {result.bits_per_byte:.4f}  "
          f"({result.seconds:.1f} s)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result.to_dict(), fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
