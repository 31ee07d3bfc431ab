"""``xdistill-projection``: build, inspect and convert projection files (W) for a tokenizer pair.

xdistill-projection build --tokenizer-model DIR --teacher-tokenizer-model DIR [--top-k 4]
    [--reverse-pass] [--special-tokens] --out FILE.safetensors
xdistill-projection inspect FILE [--tokenizer-model DIR --teacher-tokenizer-model DIR] [--examples 30]
xdistill-projection convert-nemo-rl IN.pt --tokenizer-model DIR --teacher-tokenizer-model DIR
    --out FILE.safetensors
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence

from .fileio import metadata_json


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="xdistill-projection",
        description="Projection matrix W between a student and a teacher vocabulary.",
    )
    sub = p.add_subparsers(dest="command", required=True)

    b = sub.add_parser("build", help="build W for a tokenizer pair and write it")
    b.add_argument("--tokenizer-model", "--student-tokenizer", dest="student_tokenizer",
                   required=True, help="student HF tokenizer directory")
    b.add_argument("--teacher-tokenizer-model", "--teacher-tokenizer",
                   dest="teacher_tokenizer", required=True, help="teacher HF tokenizer directory")
    b.add_argument("--top-k", type=int, default=4, help="entries kept per student row (4)")
    b.add_argument("--reverse-pass", action="store_true", help="add teacher->student entries")
    b.add_argument("--special-tokens", action="store_true", help="map BOS/EOS/pad/chat markers")
    b.add_argument("--no-multi-token", action="store_true", help="exact matches only")
    b.add_argument("--max-pieces", type=int, default=4, help="teacher pieces per row (4)")
    b.add_argument("--decay", type=float, default=0.1, help="weight ratio between pieces (0.1)")
    b.add_argument("--reverse-weight", type=float, default=0.05, help="reverse entry weight")
    b.add_argument("--out", required=True, help="output .safetensors file")
    b.add_argument("--quiet", action="store_true", help="no progress bars")

    i = sub.add_parser("inspect", help="print coverage and sample rows of a projection file")
    i.add_argument("file", help="projection .safetensors (or NeMo-RL .pt) file")
    i.add_argument("--tokenizer-model", "--student-tokenizer", dest="student_tokenizer",
                   help="show rows as text and check the vocab hash")
    i.add_argument("--teacher-tokenizer-model", "--teacher-tokenizer",
                   dest="teacher_tokenizer", help="show rows as text and check the vocab hash")
    i.add_argument("--examples", type=int, default=30, help="sample rows to print (30)")
    i.add_argument("--rows", type=int, nargs="*", default=[], help="also print these rows")
    i.add_argument("--seed", type=int, default=0, help="sampling seed")

    c = sub.add_parser("convert-nemo-rl", help="convert a NeMo-RL .pt projection to safetensors")
    c.add_argument("input", help="NeMo-RL projection .pt file")
    c.add_argument("--tokenizer-model", "--student-tokenizer", dest="student_tokenizer",
                   required=True, help="student HF tokenizer directory")
    c.add_argument("--teacher-tokenizer-model", "--teacher-tokenizer",
                   dest="teacher_tokenizer", required=True, help="teacher HF tokenizer directory")
    c.add_argument("--top-k", type=int, default=None, help="cut rows to k (default: keep all)")
    c.add_argument("--renormalize", action="store_true", help="scale each row to sum to 1")
    c.add_argument("--out", required=True, help="output .safetensors file")
    c.add_argument(
        "--force", action="store_true", help="convert even if W looks built for other tokenizers"
    )
    return p


def _build(args: argparse.Namespace) -> int:
    from .build import BuildOptions, build_projection
    from .runtime import save_projection

    options = BuildOptions(
        top_k=args.top_k,
        multi_token=not args.no_multi_token,
        max_pieces=args.max_pieces,
        decay=args.decay,
        reverse_pass=args.reverse_pass,
        reverse_weight=args.reverse_weight,
        special_tokens=args.special_tokens,
    )
    start = time.perf_counter()
    matrix = build_projection(
        args.student_tokenizer, args.teacher_tokenizer, options, progress=not args.quiet
    )
    save_projection(matrix, args.out)
    print(f"wrote {args.out} in {time.perf_counter() - start:.1f}s")
    print(json.dumps(matrix.coverage()))
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from .report import TokenNames, classify_rows, coverage_lines, format_row, sample_rows
    from .runtime import load_projection
    from .vocab import load_tokenizer

    student = teacher = None
    s_names, t_names = TokenNames(), TokenNames()
    if args.student_tokenizer or args.teacher_tokenizer:
        from ..align.canonical import token_bytes_table

        if args.student_tokenizer:
            student = load_tokenizer(args.student_tokenizer)
            s_names = TokenNames(student, token_bytes_table(student))
        if args.teacher_tokenizer:
            teacher = load_tokenizer(args.teacher_tokenizer)
            t_names = TokenNames(teacher, token_bytes_table(teacher))
    matrix = load_projection(args.file, student, teacher)
    meta = matrix.metadata
    print(f"file: {args.file}")
    for side in ("student", "teacher"):
        print(
            f"{side}: {meta.get(f'{side}_tokenizer', '<unrecorded>')}  "
            f"vocab {getattr(matrix, f'{side}_vocab_size')}  "
            f"hash {meta.get(f'{side}_vocab_hash', '<none>')}"
        )
    if "source" in meta:
        print(f"source: {meta['source']}")
    options = metadata_json(meta, "builder_options")
    if options is not None:
        print(f"builder options: {json.dumps(options, sort_keys=True)}")
    kinds = matrix.row_kind
    if kinds is None and s_names.table is not None and t_names.table is not None:
        kinds = classify_rows(matrix, s_names.table, t_names.table)
    print("coverage:")
    for line in coverage_lines(matrix, kinds):
        print(f"  {line}")
    rows = sample_rows(matrix, args.examples, kinds, seed=args.seed) if args.examples > 0 else []
    rows = list(dict.fromkeys([*args.rows, *rows]))
    if rows:
        print("rows:")
    for r in rows:
        if not 0 <= r < matrix.student_vocab_size:
            print(f"  [{r}] out of range [0, {matrix.student_vocab_size})")
            continue
        tag = "" if kinds is None else f"  ({_kind_name(int(kinds[r]))})"
        print(f"  [{r}] {format_row(matrix, r, s_names, t_names)}{tag}")
    return 0


def _kind_name(value: int) -> str:
    from .fileio import RowKind

    try:
        return RowKind(value).name.lower()
    except ValueError:
        return str(value)


def _convert(args: argparse.Namespace) -> int:
    import torch

    from ..align.canonical import token_bytes_table
    from .report import classify_rows
    from .runtime import ProjectionMatrix, load_projection, save_projection, tokenizer_metadata
    from .sparse_rows import pack_rows, unpack_rows
    from .vocab import load_tokenizer

    student = load_tokenizer(args.student_tokenizer)
    teacher = load_tokenizer(args.teacher_tokenizer)
    loaded = load_projection(args.input, student, teacher)
    indices, weights = loaded.indices, loaded.weights
    if args.top_k is not None or args.renormalize:
        r, c, v = unpack_rows(indices.numpy(), weights.numpy())
        i_np, w_np = pack_rows(
            r, c, v, loaded.student_vocab_size, k=args.top_k, renormalize=args.renormalize
        )
        indices, weights = torch.from_numpy(i_np), torch.from_numpy(w_np)
    metadata = tokenizer_metadata(student, teacher)
    metadata["source"] = loaded.metadata.get("source", "nemo-rl")
    metadata["builder_options"] = json.dumps(
        {"converted_from": str(args.input), "top_k": args.top_k, "renormalize": args.renormalize}
    )
    matrix = ProjectionMatrix(
        indices, weights, loaded.student_vocab_size, loaded.teacher_vocab_size, metadata
    )
    matrix.row_kind = classify_rows(matrix, token_bytes_table(student), token_bytes_table(teacher))
    _check_plausible(matrix, args)
    save_projection(matrix, args.out)
    print(f"wrote {args.out}")
    print(json.dumps(matrix.coverage()))
    return 0


def _check_plausible(matrix: object, args: argparse.Namespace) -> None:
    """A NeMo-RL file has no vocab hashes; refuse tokenizers under which its one-hot rows mostly
    map tokens to tokens of other text (a file built for other tokenizers), unless ``--force``."""
    from .fileio import RowKind

    one_hot = int(((matrix.indices >= 0).sum(dim=1) == 1).sum())
    exact = int((matrix.row_kind == int(RowKind.EXACT)).sum())
    if one_hot >= 100 and exact < 0.5 * one_hot and not args.force:
        raise ValueError(
            f"{args.input}: only {exact} of {one_hot} one-hot rows map a student token of "
            f"'{args.student_tokenizer}' to a teacher token of '{args.teacher_tokenizer}' with the "
            "same text; the file was probably built for other tokenizers (--force converts anyway)"
        )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``xdistill-projection`` console script."""
    args = _parser().parse_args(argv)
    handlers = {"build": _build, "inspect": _inspect, "convert-nemo-rl": _convert}
    try:
        return handlers[args.command](args)
    except (FileNotFoundError, ValueError) as e:
        print(f"xdistill-projection {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
