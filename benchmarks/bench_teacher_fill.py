"""Teacher padding on the shared corpora: the share of teacher positions a forward runs that
predict real tokens (the ``teacher_fill`` metric), with the teacher length a run derives.

For each corpus and tokenizer pair: the run's derived ``--teacher-seq-length``, the packing
plan and the samples of a run, then per teacher micro-batch size the fill of a forward over the
full teacher width (what every step paid before) and of one that runs only the positions its
micro-batch's longest sample needs (``parallel.teacher_batches``, what runs now). No model is
run: the fill is a count over the samples' real teacher tokens. Also the student's fill (a
sample whose text the teacher length cannot hold ends early; its text moves on to the next
sample, none is dropped).

  python benchmarks/bench_teacher_fill.py [--seq-length 255] [--samples 256]
      [--micro-batch-sizes 1 2 4 8] [--multiple 1]

Prints a table and keeps its rows as a result file under ``benchmarks/results/``
(``benchmarks/results.py``); the docs' tables are generated from those files
(``tools/docs_tables.py``).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from results import write_rows

PAIRS = [("enwiki_train.jsonl", "smollm2", "qwen2"), ("enwiki_train.jsonl", "smollm2", "gemma3"),
         ("shakespeare.jsonl", "mistral", "smollm2"), ("enwiki_val.jsonl", "llama3", "qwen2"),
         ("stdlib", "smollm2", "qwen2")]  # stdlib: the demo's CPython standard library


def _fills(corpus: Path, student: str, teacher: str, tokenizers_dir: Path, seq_length: int,
           samples: int, micro_batch_sizes: list[int], multiple: int,
           quantile: float | None) -> list[dict]:
    from megatron_xdistill.align import TokenAligner, load_tokenizer
    from megatron_xdistill.data.dataset import DistillationDataset
    from megatron_xdistill.data.lengths import teacher_length_from_data
    from megatron_xdistill.data.packing import build_plan, load_documents
    from megatron_xdistill.data.sources import parse_data_path
    from megatron_xdistill.data.tokenizations import SampleTokenizers
    from megatron_xdistill.parallel.teacher_batches import TeacherBatching

    name = corpus.name
    s_tok = load_tokenizer(str(tokenizers_dir / student))
    t_tok = load_tokenizer(str(tokenizers_dir / teacher))
    with tempfile.TemporaryDirectory() as tmp:
        if corpus.name == "stdlib":
            from megatron_xdistill.demo.corpus import write_stdlib_corpus

            corpus, _ = write_stdlib_corpus(Path(tmp) / "stdlib")
        path = Path(tmp) / "data.jsonl"  # at most 200 documents: enough for `samples`
        path.write_text("\n".join(corpus.read_text().splitlines()[:200]))
        sources = parse_data_path([str(path)])
        documents, counts = load_documents(sources, "text")
    choice = teacher_length_from_data(documents, TokenAligner(s_tok, t_tok), seq_length,
                                      multiple=multiple, **({} if quantile is None
                                                            else {"quantile": quantile}))
    width = choice.teacher_seq_length
    tokenizers = SampleTokenizers(s_tok, [t_tok])
    plan = build_plan(documents, sources, counts, tokenizers, seq_length, [width], seed=1,
                      num_samples=samples, log=lambda _: None)
    dataset = DistillationDataset(documents, plan, tokenizers, seq_length, [width])
    items = [dataset[i] for i in range(len(dataset))]
    lengths = [it["teachers"][0]["teacher_length"] for it in items]
    student_fill = sum(it["student_length"] for it in items) / (len(items) * (seq_length + 1))
    needed = sum(max(n - 1, 0) for n in lengths)
    rows = []
    for mbs in micro_batch_sizes:
        batching = TeacherBatching(len(lengths), 1, mbs, width, multiple=multiple)
        rows.append({"corpus": name, "student": student, "teacher": teacher,
                     "teacher_len": width, "student_fill": student_fill, "mbs": mbs,
                     "fill_full": needed / (len(lengths) * width),
                     "fill_now": needed / batching.positions_run(lengths)})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-length", type=int, default=255)
    parser.add_argument("--samples", type=int, default=256,
                        help="samples per corpus (a multiple of every micro-batch size)")
    parser.add_argument("--micro-batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--multiple", type=int, default=1,
                        help="what widths are rounded up to (2 x CP, x TP with sequence "
                             "parallelism)")
    parser.add_argument("--assets", type=Path,
                        default=Path(__file__).resolve().parents[2] / "shared" / "assets")
    parser.add_argument("--quantile", type=float, default=None,
                        help="the derivation's quantile of the window ratio (default: a run's)")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    bad = [m for m in args.micro_batch_sizes if args.samples % m]
    if bad:
        parser.error(f"--samples {args.samples} is not a multiple of micro-batch sizes {bad}")
    rows = []
    print(f"{'corpus':<20}{'student':<9}{'teacher':<9}{'teacher len':>12}{'student fill':>14}"
          f"{'mbs':>5}{'fill full width':>17}{'fill now':>10}", flush=True)
    for corpus, student, teacher in PAIRS:
        for r in _fills(args.assets / "corpora" / corpus, student, teacher,
                        args.assets / "tokenizers", args.seq_length, args.samples,
                        args.micro_batch_sizes, args.multiple, args.quantile):
            rows.append(r)
            print(f"{r['corpus']:<20}{r['student']:<9}{r['teacher']:<9}{r['teacher_len']:>12}"
                  f"{100 * r['student_fill']:>13.1f}%{r['mbs']:>5}{100 * r['fill_full']:>16.1f}%"
                  f"{100 * r['fill_now']:>9.1f}%", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    write_rows("bench_teacher_fill", rows,
               params={"seq_length": args.seq_length, "samples": args.samples,
                       "multiple": args.multiple, "quantile": args.quantile})


if __name__ == "__main__":
    main()
