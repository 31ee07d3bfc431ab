"""What the compact gold / H-KL payload merges on a real teacher: per teacher position, the share
of its common-vocabulary mass outside its top-k common pairs (the bucket) and the share of its n
largest uncommon probabilities past rank k' (the tail), median and 90th percentile.

The study's random-init pair: SmolLM2-135M teacher, Mistral student tokenizer (W built from the
tokenizers), English Wikipedia validation text (shared assets). Per position, not per chunk: a
chunk's mean over several positions is flatter, so these shares are a lower bound of a chunk's.

  python benchmarks/bench_gold_topk_mass.py [--docs 4] [--tokens 256]

Needs the SmolLM2-135M folder of ``fetch_models.sh`` (``$XDISTILL_ASSETS`` or
``~/.cache/xdistill-assets``). Prints a table and keeps its rows as a result file under
``benchmarks/results/`` (``benchmarks/results.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from results import write_rows

REPO = Path(__file__).resolve().parents[1]
ASSETS = REPO.parent / "shared" / "assets"
MODELS = Path(os.environ.get("XDISTILL_ASSETS", Path.home() / ".cache" / "xdistill-assets"))


def shares(logp: torch.Tensor, common_teacher: torch.Tensor, span_cap: int, vs: int,
           ks: tuple[int, ...], ks_unc: tuple[int, ...]) -> dict:
    """Median and p90 over positions of the bucket's and the tail's shares (``logp`` [N, V_t])."""
    vt = logp.shape[1]
    m = common_teacher.numel()
    p = logp.exp()
    pc = p[:, common_teacher].sort(1, descending=True).values
    unc = torch.ones(vt, dtype=torch.bool)
    unc[common_teacher] = False
    n = min(span_cap, vs - m, vt - m)
    pu = p[:, unc].topk(n, dim=1).values
    q = torch.tensor([0.5, 0.9])
    row = {"pairs": m, "ranks": n, "common_mass": pc.sum(1).median().item()}
    total = pc.sum(1)
    for k in ks:
        share = ((total - pc[:, :k].sum(1)) / total).quantile(q).tolist()
        row[f"bucket_{k}_median"], row[f"bucket_{k}_p90"] = share
    unc_total = pu.sum(1)
    for k in ks_unc:
        share = (pu[:, k:].sum(1) / unc_total).quantile(q).tolist()
        row[f"tail_{k}_median"], row[f"tail_{k}_p90"] = share
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=256)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_xdistill.loss import UNCOMMON_TOPK
    from megatron_xdistill.projection import BuildOptions, build_projection

    teacher = MODELS / "models" / "smollm2-135m"
    if not teacher.is_dir():
        print(f"no teacher at {teacher}: run `bash ../shared/assets/fetch_models.sh "
              f"smollm2-135m` first")
        return 1
    matrix = build_projection(str(ASSETS / "tokenizers" / "mistral"),
                              str(ASSETS / "tokenizers" / "smollm2"), BuildOptions())
    tok = AutoTokenizer.from_pretrained(teacher)
    model = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32).eval()
    lines = (ASSETS / "corpora" / "enwiki_val.jsonl").read_text().splitlines()[: args.docs]
    ids = torch.stack([torch.tensor(tok(json.loads(x)["text"])["input_ids"][: args.tokens])
                       for x in lines])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits.float(), -1).reshape(ids.numel(), -1)
    ks, ks_unc = (16, 64, 256), (64, 256, 1024)
    rows = []
    for loss, rule in (("gold", "strict"), ("hkl", "xtoken")):
        common = torch.as_tensor(matrix.common_vocab(rule)[1], dtype=torch.int64)
        rows.append({"loss": loss, **shares(logp[:, : matrix.teacher_vocab_size], common,
                                            UNCOMMON_TOPK, matrix.student_vocab_size, ks,
                                            ks_unc)})
    print(f"{'loss':<5} {'M':>7} {'n':>5} " + " ".join(f"{f'bucket k={k}':>14}" for k in ks)
          + " " + " ".join(f"{f'tail k={k}':>14}" for k in ks_unc))
    for row in rows:
        cells = [f"{row[f'bucket_{k}_median']:.3f}/{row[f'bucket_{k}_p90']:.3f}" for k in ks]
        cells += [f"{row[f'tail_{k}_median']:.3f}/{row[f'tail_{k}_p90']:.3f}" for k in ks_unc]
        print(f"{row['loss']:<5} {row['pairs']:>7,} {row['ranks']:>5} "
              + " ".join(f"{c:>14}" for c in cells))
    write_rows("bench_gold_topk_mass", rows, params=vars(args), argv=argv,
               notes="shares of the teacher's common mass in the bucket and of its sorted "
                     "uncommon mass in the tail, median and p90 over positions")
    return 0


if __name__ == "__main__":
    sys.exit(main())
