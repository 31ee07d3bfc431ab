"""``xdistill-align``: look at, dump and measure token alignments between two tokenizers.

  xdistill-align show  --tokenizer-model DIR --teacher-tokenizer-model DIR --text "..."
  xdistill-align dump  --tokenizer-model DIR --teacher-tokenizer-model DIR --data-path F.jsonl --out O.jsonl
  xdistill-align stats --tokenizer-model DIR --teacher-tokenizer-model DIR --data-path F.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TextIO

from .api import METHODS, TokenAligner, load_tokenizer
from .canonical import TokenTable
from .chunks import Alignment
from .coverage import CoverageStats

__all__ = ["main"]


class CliError(Exception):
    """A user-facing error: printed as ``error: ...`` with exit status 2."""


# -- input ------------------------------------------------------------------------------------------
def iter_docs(path: str, text_field: str, max_docs: int | None,
              on_bad: str) -> Iterator[tuple[object, str]]:
    """``(id, text)`` per JSONL line; bad lines raise :class:`CliError` or are skipped."""
    p = Path(path)
    if not p.is_file():
        raise CliError(f"data file {path!r} does not exist")
    n = 0
    with p.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            if max_docs is not None and n >= max_docs:
                return
            if not raw.strip():
                continue
            try:
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise ValueError(f"not valid UTF-8 at byte {e.start}") from None
                try:
                    doc = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"not valid JSON ({e.msg})") from None
                if not isinstance(doc, dict) or not isinstance(doc.get(text_field), str):
                    raise ValueError(f"expected an object with a string field {text_field!r}")
                text = doc[text_field]
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError as e:
                    raise ValueError(f"text holds a lone surrogate at index {e.start}") from None
            except ValueError as e:
                if on_bad == "skip":
                    print(f"warning: {path}:{lineno}: {e}; skipped", file=sys.stderr)
                    continue
                raise CliError(f"{path}:{lineno}: {e} (use --on-bad-line skip to skip it)") from None
            yield doc.get("id", lineno - 1), text
            n += 1


def batched(items: Iterator, size: int) -> Iterator[list]:
    """Lists of up to ``size`` items."""
    batch: list = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


# -- show -------------------------------------------------------------------------------------------
def _piece(table: TokenTable, tok_id: int, tokenizer: object) -> str:
    """Readable canonical text of one token (whitespace made visible)."""
    b = table.token_bytes(tok_id)
    if b is None:
        return str(tokenizer.convert_ids_to_tokens(int(tok_id)))  # type: ignore[attr-defined]
    text = b.decode("utf-8", errors="backslashreplace")
    return text.replace(" ", "·").replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r")


def show(aligner: TokenAligner, al: Alignment, out: TextIO | None = None) -> None:
    """Print chunks side by side: student pieces | teacher pieces | exact?"""
    out = sys.stdout if out is None else out
    rows = []
    for a, b, p, q, ex in al.chunks:
        s = " ".join(f"[{_piece(aligner.student_table, i, aligner.student_tokenizer)}]"
                     for i in al.student_ids[a:b].tolist())
        t = " ".join(f"[{_piece(aligner.teacher_table, i, aligner.teacher_tokenizer)}]"
                     for i in al.teacher_ids[p:q].tolist())
        rows.append((f"{a}:{b}", s, f"{p}:{q}", t, "yes" if ex else "NO"))
    head = ("s span", "student pieces", "t span", "teacher pieces", "exact")
    widths = [max(len(r[k]) for r in [head, *rows]) for k in range(5)]
    for r in [head, tuple("-" * w for w in widths), *rows]:
        print(" | ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip(), file=out)
    n_ex = al.num_exact
    print(f"{len(al.chunks)} chunks, {n_ex} exact; student {len(al.student_ids)} tokens, "
          f"teacher {len(al.teacher_ids)} tokens", file=out)


# -- main -------------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="xdistill-align", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--tokenizer-model", "--student-tokenizer", dest="student_tokenizer",
                        required=True, help="student HF tokenizer directory")
    common.add_argument("--teacher-tokenizer-model", "--teacher-tokenizer",
                        dest="teacher_tokenizer", required=True,
                        help="teacher HF tokenizer directory")
    common.add_argument("--method", choices=METHODS, default="offsets",
                        help="offsets: fast path from character offsets; dp: from token bytes")
    data = argparse.ArgumentParser(add_help=False)
    data.add_argument("--data-path", "--data", dest="data", required=True,
                      help="JSON Lines file, one document per line")
    data.add_argument("--text-field", default="text")
    data.add_argument("--max-docs", type=int, default=None)
    data.add_argument("--batch-size", type=int, default=64)
    data.add_argument("--on-bad-line", choices=("error", "skip"), default="error",
                      help="bad line (not UTF-8 / JSON / no text field): stop or skip it")

    p = sub.add_parser("show", parents=[common], help="print one text's chunks side by side")
    p.add_argument("--text", required=True)
    p = sub.add_parser("dump", parents=[common, data], help="write ids and chunks per document")
    p.add_argument("--out", required=True)
    sub.add_parser("stats", parents=[common, data], help="coverage and throughput")
    return ap


def _stats(aligner: TokenAligner, args: argparse.Namespace) -> None:
    cov = CoverageStats()
    aligner.align_texts(["warm up the compiled aligners"], args.method)  # not timed
    t_tok = t_align = 0.0
    for batch in batched(iter_docs(args.data, args.text_field, args.max_docs, args.on_bad_line),
                         args.batch_size):
        texts = [t for _, t in batch]
        t0 = time.perf_counter()
        clean, s_enc, t_enc = aligner.encode_texts(texts)
        t1 = time.perf_counter()
        als = aligner.align_encoded(clean, s_enc, t_enc, args.method)
        t2 = time.perf_counter()
        t_tok += t1 - t0
        t_align += t2 - t1
        for text, al in zip(clean, als):
            cov.add(text, al, aligner.student_table)
    tokens = cov.student_tokens + cov.teacher_tokens
    print(f"documents          {cov.docs}")
    print(f"characters         {cov.chars}")
    print(f"student tokens     {cov.student_tokens}   in exact chunks "
          f"{100 * cov.student_token_coverage:.3f}%")
    print(f"teacher tokens     {cov.teacher_tokens}   in exact chunks "
          f"{100 * cov.teacher_token_coverage:.3f}%")
    print(f"characters in exact chunks {100 * cov.char_coverage:.3f}%")
    print(f"chunks             {cov.chunks}   exact {cov.exact_chunks}")
    print("chunk sizes (student:teacher tokens)   count   share")
    for key, k in cov.sizes.most_common():
        print(f"  {key:>6}   {k:>10}   {100 * k / max(cov.chunks, 1):7.3f}%")
    align_rate = tokens / t_align if t_align > 0 else float("inf")
    total_rate = tokens / (t_tok + t_align) if t_tok + t_align > 0 else float("inf")
    print(f"throughput ({args.method}, both sides' tokens, one process): align only "
          f"{align_rate:,.0f} tokens/s; with tokenisation {total_rate:,.0f} tokens/s")


def _dump(aligner: TokenAligner, args: argparse.Namespace) -> None:
    out = Path(args.out)
    if not out.parent.is_dir():
        raise CliError(f"output directory {str(out.parent)!r} does not exist")
    n = 0
    with out.open("w", encoding="utf-8") as f:
        for batch in batched(iter_docs(args.data, args.text_field, args.max_docs,
                                       args.on_bad_line), args.batch_size):
            als = aligner.align_texts([t for _, t in batch], args.method)
            for (doc_id, _), al in zip(batch, als):
                rec = {"id": doc_id, "student_ids": al.student_ids.tolist(),
                       "teacher_ids": al.teacher_ids.tolist(),
                       "chunks": [[a, b, p, q, bool(e)] for a, b, p, q, e in
                                  al.chunks_array.tolist()]}
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
                n += 1
    print(f"wrote {n} documents to {out}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``xdistill-align``; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        if getattr(args, "max_docs", None) is not None and args.max_docs < 0:
            raise CliError(f"--max-docs must be >= 0, got {args.max_docs}")
        if getattr(args, "batch_size", 1) < 1:
            raise CliError(f"--batch-size must be >= 1, got {args.batch_size}")
        try:
            student = load_tokenizer(args.student_tokenizer)
            teacher = load_tokenizer(args.teacher_tokenizer)
        except (FileNotFoundError, ValueError) as e:
            raise CliError(str(e)) from None
        aligner = TokenAligner(student, teacher)
        if args.cmd == "show":
            try:
                al = aligner.align_text(args.text, args.method)
            except ValueError as e:
                raise CliError(f"--text: {e}") from None
            show(aligner, al)
        elif args.cmd == "dump":
            _dump(aligner, args)
        else:
            _stats(aligner, args)
    except CliError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
