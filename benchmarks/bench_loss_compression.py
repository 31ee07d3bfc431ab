"""How far the compact teacher payloads move the KD loss from the exact one, on real models.

A real teacher and student (``megatron_xdistill.demo.assets``: qwen2.5-coder-0.5b -> smollm2-135m by
default) run on held-out Python source (the CPython standard library); both tokenisations are
aligned and the P-KL loss is evaluated (the training implementation, single process) with the
exact payload (all V_t teacher columns), NeMo-RL's microbatch-global top-k and our per-chunk
top-k + tail, and gold / H-KL for reference. Reported per form: payload bytes per student token,
the loss, its relative deviation from exact and the cosine similarity of the student gradients.

  python benchmarks/bench_loss_compression.py [--docs 8] [--chars 2000] [--ks 8 32 128 512]

Prints a table and keeps its rows as a result file under ``benchmarks/results/``
(``benchmarks/results.py``); the docs' tables are generated from those files
(``tools/docs_tables.py``).
"""

from __future__ import annotations

import argparse
import time

import torch
from results import write_rows


def _load(args):
    from transformers import AutoModelForCausalLM

    from megatron_xdistill.align import TokenAligner, load_tokenizer
    from megatron_xdistill.demo.assets import fetch_model, stdlib_python_files
    from megatron_xdistill.demo.workflow import build_projection
    from megatron_xdistill.projection.runtime import load_projection

    s_dir, t_dir = fetch_model(args.student), fetch_model(args.teacher)
    s_tok, t_tok = load_tokenizer(s_dir), load_tokenizer(t_dir)
    path = build_projection(args.student, args.teacher, s_dir, t_dir)  # cached
    projection = load_projection(path, s_tok, t_tok)
    files = [p for p in stdlib_python_files() if p.stat().st_size > args.chars]
    step = max(1, len(files) // args.docs)
    texts = [f.read_text(encoding="utf-8", errors="replace")[: args.chars]
             for f in files[::step][: args.docs]]
    models = [AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
              for d in (s_dir, t_dir)]
    return TokenAligner(s_tok, t_tok), projection, texts, models


def _batch(aligner, texts):
    from megatron_xdistill.align import pack_alignments

    als = aligner.align_texts(texts)
    ls = [len(a.student_ids) for a in als]
    lt = [len(a.teacher_ids) for a in als]
    packed = pack_alignments([a.chunks_array for a in als], ls, lt)
    s_ids = torch.zeros(len(als), max(ls), dtype=torch.int64)
    t_ids = torch.zeros(len(als), max(lt), dtype=torch.int64)
    for i, a in enumerate(als):
        s_ids[i, : ls[i]] = torch.from_numpy(a.student_ids)
        t_ids[i, : lt[i]] = torch.from_numpy(a.teacher_ids)
    return s_ids, t_ids, packed


@torch.no_grad()
def _logits(model, ids):
    return torch.cat([model(ids[i: i + 1]).logits.float() for i in range(ids.shape[0])])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--student", default="smollm2-135m")
    p.add_argument("--teacher", default="qwen2.5-coder-0.5b")
    p.add_argument("--docs", type=int, default=6)
    p.add_argument("--chars", type=int, default=1500)
    p.add_argument("--ks", type=int, nargs="+", default=[8, 32, 128, 512])
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    from megatron_xdistill.loss import (
        parallel_kd_loss,
        payload_spec,
        predicting_chunk_id,
        teacher_payload,
    )

    aligner, projection, texts, (student, teacher) = _load(args)
    s_ids, t_ids, packed = _batch(aligner, texts)
    t0 = time.perf_counter()
    z, u = _logits(student, s_ids), _logits(teacher, t_ids)
    print(f"{len(texts)} documents, {s_ids.numel()} student / {t_ids.numel()} teacher tokens; "
          f"forwards {time.perf_counter() - t0:.1f} s")
    vs, vt = projection.student_vocab_size, projection.teacher_vocab_size
    z, u = z[..., :vs].contiguous(), u[..., :vt].contiguous()
    s_pred = predicting_chunk_id(packed["student_chunk_id"])
    t_pred = predicting_chunk_id(packed["teacher_chunk_id"])
    valid, exact = packed["chunk_valid"], packed["chunk_exact"]
    n_tokens = int((s_pred >= 0).sum())
    rows = (projection.indices, projection.weights)

    def run(mode, form, topk=None):
        common = (None, None) if mode == "pkl" else projection.common_vocab(
            "strict" if mode == "gold" else "xtoken")
        spec = payload_spec(form, valid.shape[1], vt, topk=topk,
                            num_common=None if common[0] is None else common[0].numel())
        payload = teacher_payload(u, t_pred, spec, vocab_size=vt, common_teacher_ids=common[1])
        x = z.clone().requires_grad_(True)
        terms = parallel_kd_loss(x, payload, s_pred, valid, exact, rows, student_vocab_size=vs,
                                 mode=mode, common_student_ids=common[0])
        loss = terms.kd_sum / terms.kd_count
        loss.backward()
        return loss.item(), x.grad.flatten(), spec.nbytes * len(texts) / n_tokens

    forms = [("pkl", "full", None)] + [("pkl", "chunk_topk", k) for k in args.ks]
    forms += [("pkl", "topk", k) for k in args.ks] + [("gold", "gold", None), ("hkl", "gold", None)]
    exact_loss, exact_grad, _ = run("pkl", "full")
    kept = []
    print(f"\n{'mode':5} {'payload':14} {'bytes/token':>12} {'loss':>9} {'rel. dev':>9} "
          f"{'grad cos':>9}")
    for mode, form, k in forms:
        loss, grad, bpt = run(mode, form, k)
        name = form if k is None else f"{form}-{k}"
        dev = f"{(loss - exact_loss) / exact_loss:+9.2e}" if mode == "pkl" else f"{'-':>9}"
        cos = min(1.0, float(torch.nn.functional.cosine_similarity(grad, exact_grad, dim=0)))
        print(f"{mode:5} {name:14} {bpt:12.0f} {loss:9.4f} {dev} {cos:9.4f}")
        kept.append({"mode": mode, "payload": name, "bytes_per_token": bpt, "loss": loss,
                     "rel_dev": (loss - exact_loss) / exact_loss if mode == "pkl" else None,
                     "grad_cos": cos})
    write_rows("bench_loss_compression", kept,
               params={"student": args.student, "teacher": args.teacher, "docs": len(texts),
                       "chars": args.chars, "student_tokens": n_tokens})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
