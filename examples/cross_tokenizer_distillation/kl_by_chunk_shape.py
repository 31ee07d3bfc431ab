"""Where a pretrained pair's P-KL comes from: per-chunk KL grouped by chunk shape.

A chunk pairs a run of student tokens with a run of teacher tokens that spell the same text. Its
shape, student tokens : teacher tokens, decides what P-KL can do with it. 1:1 chunks compare
two next-token distributions. In an n:1 chunk the student spells the teacher's one token in
several pieces (student 'de' + 'f', teacher 'def'): the teacher's mass sits on a token that no
student token projects to, since W maps a student token to the teacher tokens that spell it.
Such a chunk's KL cannot fall, and its gradient favours other spellings of the text than the
student's own. This prints, per shape: the share of the chunks, the mean KL (chunk top-k + tail
payload and the exact form over all of V_t), the top-1 agreement, the share of the KL and the
teacher's mass out of the student's reach. It
runs on HF transformers logits of both models (``loss.reference``, the dense reference), over
the first characters of each held-out document:

  python examples/cross_tokenizer_distillation/kl_by_chunk_shape.py \\
      --data-path runs/study/real/data/valid.jsonl --documents 6

Measured 2026-11-27 (SmolLM2-135M student, Qwen2.5-Coder-0.5B teacher, 6 CPython stdlib
held-out modules, 1,500 characters each: 2,427 student tokens, 2,030 counted chunks):

  shape  chunks  share  KL top-64  KL exact   top-1  share of the KL  outside W  KL at starts  top-1
  1:1      1631  80.3%      2.021     2.144   54.4%            49.7%       5.9%         0.973  58.6%
  1:2        36   1.8%     -0.019    -0.012    8.3%            -0.0%       0.1%             -      -
  2:1       205  10.1%     15.166    15.411    4.9%            44.9%      65.0%         1.024  67.8%
  2:2       129   6.4%      0.113     0.117    0.8%             0.2%       0.1%             -      -
  2:3         1   0.0%     -0.012    -0.006  100.0%            -0.0%       0.1%             -      -
  3:1        26   1.3%     13.656    13.808    0.0%             5.1%      61.6%         1.043  57.7%
  3:2         2   0.1%      0.005     0.006    0.0%             0.0%       0.1%             -      -

"Outside W" ("teacher mass outside W" in the output): the chunk's teacher probability on
teacher tokens that no student token projects to (W's image excludes them), which no student can
match. (Shapes of 3 or more tokens on a side are counted as 3. Chunks whose teacher side has more
tokens hold a chunk-mean of teacher log-probs, left unnormalised as in NeMo-RL: their KL is ~0.)
Hence ``--kd-skip-student-split-chunks``. The last two columns are ``--kd-first-token``'s form
(chunk top-64 at chunk starts, the teacher's mass moved to the student's first piece; chunks of
one teacher token): the split chunks' KL falls from 15 to 1 nat, that of 1:1 chunks from 2.0 to
1.0 (the teacher's mass on tokens like ');\n' now counts for the student's ');'), and the top-1
agreement is 58-68% in every shape.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch


def _sparse_projection(path: Path) -> tuple[torch.Tensor, int, int]:
    from megatron_xdistill.projection import load_projection

    matrix = load_projection(str(path))
    return matrix.to_sparse(), matrix.student_vocab_size, matrix.teacher_vocab_size


def chunk_ids(chunks: np.ndarray, n_student: int, n_teacher: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """[1, n] chunk index of each token of both sides (-1: none) from an alignment's chunks."""
    s = torch.full((1, n_student), -1, dtype=torch.int64)
    t = torch.full((1, n_teacher), -1, dtype=torch.int64)
    for c, (a, b, p, q, _) in enumerate(chunks.tolist()):
        s[0, a:b], t[0, p:q] = c, c
    return s, t


def main(argv: list[str] | None = None) -> None:
    from transformers import AutoModelForCausalLM

    from megatron_xdistill.align import TokenAligner, load_tokenizer
    from megatron_xdistill.demo.assets import fetch_model
    from megatron_xdistill.demo.workflow import build_projection
    from megatron_xdistill.loss.definitions.chunk_starts import (
        chunk_start_ids,
        single_teacher_token_chunks,
    )
    from megatron_xdistill.loss.definitions.reference import kd_loss_details
    from megatron_xdistill.projection.first_token import first_token_heads

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--student", default="smollm2-135m")
    parser.add_argument("--teacher", default="qwen2.5-coder-0.5b")
    parser.add_argument("--data-path", required=True, help="jsonl with a 'text' field")
    parser.add_argument("--documents", type=int, default=6)
    parser.add_argument("--chars", type=int, default=1500, help="characters per document")
    parser.add_argument("--topk", type=int, default=64, help="the chunk top-k payload's k")
    parser.add_argument("--projection", default=None, help="W's file (default: the demo's, "
                        "built with xdistill-projection's defaults)")
    args = parser.parse_args(argv)

    student_hf, teacher_hf = fetch_model(args.student), fetch_model(args.teacher)
    w, vs, vt = _sparse_projection(Path(args.projection) if args.projection else
                                   build_projection(args.student, args.teacher, student_hf,
                                                    teacher_hf))
    aligner = TokenAligner(load_tokenizer(student_hf), load_tokenizer(teacher_hf))
    models = [AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval()
              for p in (student_hf, teacher_hf)]
    heads = torch.from_numpy(first_token_heads(load_tokenizer(student_hf),
                                               load_tokenizer(teacher_hf), vt))
    in_image = torch.zeros(vt, dtype=torch.bool)
    in_image[w.indices()[1]] = True  # teacher columns some student token projects to
    outside = defaultdict(list)  # shape -> the teacher's chunk mass outside W's image
    kl = defaultdict(lambda: defaultdict(list))  # payload -> shape -> [(kl, top1)]
    tokens = 0
    with open(args.data_path) as fh:
        docs = [json.loads(line)["text"][: args.chars] for line in fh][: args.documents]
    for k, text in enumerate(docs):
        al = aligner.align_text(text)
        s_ids = torch.as_tensor(al.student_ids)[None]
        t_ids = torch.as_tensor(al.teacher_ids)[None]
        s_chunk, t_chunk = chunk_ids(al.chunks_array, s_ids.shape[1], t_ids.shape[1])
        with torch.no_grad():
            zs = models[0](s_ids).logits[..., :vs]
            zt = models[1](t_ids).logits[..., :vt]
        logp_t = torch.log_softmax(zt[0].float(), -1)
        for a, b, p, q, _ in al.chunks_array.tolist():
            if p >= 1 and q > p:  # predicting positions p-1 .. q-2 (as loss.reference)
                mean = logp_t[p - 1: q - 1].mean(0).exp()
                outside[f"{min(b - a, 3)}:{min(q - p, 3)}"].append(float(mean[~in_image].sum()))
        valid = torch.ones(1, len(al.chunks_array), dtype=torch.bool)
        exact = torch.as_tensor(al.chunks_array[:, 4])[None].bool()
        starts = (chunk_start_ids(s_chunk), t_chunk,
                  valid & single_teacher_token_chunks(t_chunk, valid.shape[1]), exact, w)
        for name, inputs, payload in (
                (f"top-{args.topk}", (s_chunk, t_chunk, valid, exact, w),
                 {"chunk_topk": args.topk}),
                ("exact", (s_chunk, t_chunk, valid, exact, w), {}),
                ("starts", starts, {"chunk_topk": args.topk, "teacher_heads": heads})):
            d = kd_loss_details(zs, zt, *inputs, **payload)
            for c, (a, b, p, q, _) in enumerate(al.chunks_array.tolist()):
                if d.counted[0, c]:
                    shape = f"{min(b - a, 3)}:{min(q - p, 3)}"
                    kl[name][shape].append((float(d.per_chunk[0, c]), bool(d.top1[0, c])))
        tokens += s_ids.shape[1]
        print(f"  document {k + 1}/{len(docs)}: {s_ids.shape[1]} student tokens", flush=True)
    top, exact_kl, at_starts = kl[f"top-{args.topk}"], kl["exact"], kl["starts"]
    n = sum(len(v) for v in exact_kl.values())
    total = sum(x for v in exact_kl.values() for x, _ in v)
    print(f"\n{args.student} <- {args.teacher}: {len(docs)} documents, {tokens} student tokens, "
          f"{n} counted chunks")
    print(f"{'shape':<6} {'chunks':>7} {'share':>7} {'KL top-' + str(args.topk):>10} "
          f"{'KL exact':>9} {'top-1':>6} {'share of the KL':>16} {'teacher mass outside W':>23}"
          f" {'KL at starts':>13} {'top-1':>6}")
    for shape in sorted(exact_kl):
        rows, first = exact_kl[shape], at_starts.get(shape, [])
        print(f"{shape:<6} {len(rows):>7} {len(rows) / n:>7.1%} "
              f"{np.mean([x for x, _ in top[shape]]):>10.3f} {np.mean([x for x, _ in rows]):>9.3f} "
              f"{np.mean([t for _, t in rows]):>6.1%} {sum(x for x, _ in rows) / total:>16.1%} "
              f"{np.mean(outside[shape]) if outside[shape] else float('nan'):>23.1%} "
              + (f"{np.mean([x for x, _ in first]):>13.3f} {np.mean([t for _, t in first]):>6.1%}"
                 if first else f"{'-':>13} {'-':>6}"))


if __name__ == "__main__":
    main()
