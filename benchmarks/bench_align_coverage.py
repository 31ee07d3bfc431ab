"""Coverage of exact chunks for every pair of the shared tokenizers on every shared corpus.

    python benchmarks/bench_align_coverage.py [--max-chars N]

Prints, per corpus and tokenizer pair, the share of characters and of each side's tokens that
lie in exact chunks (the issue's bar: >= 99% of characters), and whether the offset path and the
DP path gave identical chunks for every document.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from pathlib import Path

import numpy as np
from results import write_rows

from megatron_xdistill.align import TokenAligner, load_tokenizer
from megatron_xdistill.align.coverage import CoverageStats

ASSETS = Path(
    os.environ.get("XDISTILL_SHARED_ASSETS")
    or Path(__file__).resolve().parents[2] / "shared" / "assets"
)
NAMES = ["smollm2", "qwen2", "gemma3", "llama3", "gpt2", "mistral"]
CORPORA = ["enwiki_train", "enwiki_val", "shakespeare"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-chars", type=int, default=0, help="cut each document (0: whole)")
    args = ap.parse_args()
    toks = {n: load_tokenizer(ASSETS / "tokenizers" / n) for n in NAMES}
    print(f"{'corpus':13} | {'student':8} | {'teacher':8} | {'chars %':>8} | {'student tok %':>13} "
          f"| {'teacher tok %':>13} | {'inexact chunks':>14} | paths agree")
    print("-" * 107)
    worst = 1.0
    rows = []
    t0 = time.perf_counter()
    for corpus in CORPORA:
        with open(ASSETS / "corpora" / f"{corpus}.jsonl", encoding="utf-8") as f:
            texts = [json.loads(line)["text"] for line in f]
        if args.max_chars:
            texts = [t[: args.max_chars] for t in texts]
        encoded = {n: TokenAligner(toks[n], toks[n]).encode_texts(texts)[1] for n in NAMES}
        for s, t in itertools.combinations(NAMES, 2):
            aligner = TokenAligner(toks[s], toks[t])
            fast = aligner.align_encoded(texts, encoded[s], encoded[t], "offsets")
            slow = aligner.align_encoded(texts, encoded[s], encoded[t], "dp")
            agree = all(np.array_equal(x.chunks_array, y.chunks_array) for x, y in zip(fast, slow))
            cov = CoverageStats()
            for text, al in zip(texts, fast):
                cov.add(text, al, aligner.student_table)
            worst = min(worst, cov.char_coverage)
            print(f"{corpus:13} | {s:8} | {t:8} | {100 * cov.char_coverage:8.3f} | "
                  f"{100 * cov.student_token_coverage:13.3f} | "
                  f"{100 * cov.teacher_token_coverage:13.3f} | {cov.chunks - cov.exact_chunks:14d} | "
                  f"{'yes' if agree else 'NO'}")
            rows.append({"corpus": corpus, "student": s, "teacher": t,
                         "chars_pct": 100 * cov.char_coverage,
                         "student_tokens_pct": 100 * cov.student_token_coverage,
                         "teacher_tokens_pct": 100 * cov.teacher_token_coverage,
                         "inexact_chunks": cov.chunks - cov.exact_chunks, "paths_agree": agree})
    print(f"lowest character coverage {100 * worst:.3f}% ({time.perf_counter() - t0:.0f} s)")
    write_rows("bench_align_coverage", rows, params={"max_chars": args.max_chars})


if __name__ == "__main__":
    main()
