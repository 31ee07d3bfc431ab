"""Throughput of the token aligner, per core, on the shared enwiki corpus.

    python benchmarks/bench_align.py [--corpus enwiki_train] [--repeat 3] [--cpu 0]

Runs pinned to one CPU with one tokenizer/numba thread. Tokens/s counts the tokens of both sides
(student + teacher) that one core aligns per second; tokenisation is timed separately. Rows:
offsets (fast path), dp (the same ids from canonical bytes only), dp with 1% of student ids
replaced by random ids (exercises anchors + Needleman-Wunsch), and the offset path on the
corpus cut into 2,000-character documents (per-document overhead).
"""

from __future__ import annotations

import os

os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("NUMBA_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
from results import write_rows  # noqa: E402

from megatron_xdistill.align import TokenAligner, load_tokenizer  # noqa: E402

ASSETS = Path(
    os.environ.get("XDISTILL_SHARED_ASSETS")
    or Path(__file__).resolve().parents[2] / "shared" / "assets"
)
PAIRS = [("qwen2", "smollm2"), ("gemma3", "llama3")]  # teacher -> student


def _best(repeat: int, fn, *args) -> float:
    """Best wall time of ``fn(*args)`` over ``repeat`` runs."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn(*args)
        best = min(best, time.perf_counter() - t0)
    return best


def _align_all_ids(aligner: TokenAligner, student: list, teacher: list) -> None:
    for s_ids, t_ids in zip(student, teacher):
        aligner.align_ids(s_ids, t_ids)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", default="enwiki_train")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--cpu", type=int, default=None, help="core to pin to (default: first allowed)")
    args = ap.parse_args()
    if hasattr(os, "sched_setaffinity"):
        cpu = args.cpu if args.cpu is not None else min(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpu})
    path = ASSETS / "corpora" / f"{args.corpus}.jsonl"
    with open(path, encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f]
    short = [t[k:k + 2000] for t in texts for k in range(0, len(t), 2000)]
    print(f"corpus {path.name}: {len(texts)} documents, {sum(map(len, texts)):,} characters; "
          f"1 core, best of {args.repeat}")
    rows = []
    for teacher_name, student_name in PAIRS:
        student = load_tokenizer(ASSETS / "tokenizers" / student_name)
        teacher = load_tokenizer(ASSETS / "tokenizers" / teacher_name)
        aligner = TokenAligner(student, teacher)
        t0 = time.perf_counter()
        clean, s_enc, t_enc = aligner.encode_texts(texts)
        t_tok = time.perf_counter() - t0
        n_s = sum(len(ids) for ids, _ in s_enc)
        n_t = sum(len(ids) for ids, _ in t_enc)
        pair = f"{teacher_name} -> {student_name}"
        rows.append((pair, "tokenise both (HF, for scale)", len(texts), n_s, n_t, t_tok))
        for method in ("offsets", "dp"):
            aligner.align_encoded(clean, s_enc, t_enc, method)  # compile / load the cache
            sec = _best(args.repeat, aligner.align_encoded, clean, s_enc, t_enc, method)
            rows.append((pair, method, len(texts), n_s, n_t, sec))

        rng = np.random.default_rng(0)
        corrupted = []
        for ids, _ in s_enc:
            ids = ids.copy()
            k = rng.choice(len(ids), size=max(1, len(ids) // 100), replace=False)
            ids[k] = rng.integers(0, student.vocab_size, size=len(k))
            corrupted.append(ids)
        sec = _best(args.repeat, _align_all_ids, aligner, corrupted, [ids for ids, _ in t_enc])
        rows.append((pair, "dp, 1% student ids corrupted", len(texts), n_s, n_t, sec))

        s_clean, s_enc2, t_enc2 = aligner.encode_texts(short)
        n_s2 = sum(len(ids) for ids, _ in s_enc2)
        n_t2 = sum(len(ids) for ids, _ in t_enc2)
        sec = _best(args.repeat, aligner.align_encoded, s_clean, s_enc2, t_enc2)
        rows.append((pair, "offsets, 2k-char documents", len(short), n_s2, n_t2, sec))

    head = ("pair (teacher -> student)", "path", "docs", "student tok", "teacher tok", "seconds",
            "tokens/s/core")
    table = [head] + [
        (p, m, str(d), f"{s:,}", f"{t:,}", f"{sec:.3f}", f"{(s + t) / sec:,.0f}")
        for p, m, d, s, t, sec in rows
    ]
    widths = [max(len(r[k]) for r in table) for k in range(len(head))]
    for k, r in enumerate(table):
        print(" | ".join(c.ljust(w) if j < 2 else c.rjust(w) for j, (c, w) in
                         enumerate(zip(r, widths))))
        if k == 0:
            print("-|-".join("-" * w for w in widths))
    write_rows("bench_align", [
        {"pair": p, "path": m, "docs": d, "student_tokens": s, "teacher_tokens": t,
         "seconds": sec, "tokens_per_s_core": (s + t) / sec} for p, m, d, s, t, sec in rows],
        params={"corpus": args.corpus, "repeat": args.repeat})


if __name__ == "__main__":
    main()
