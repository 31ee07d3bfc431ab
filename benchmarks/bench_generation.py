"""Greedy decoding throughput of the project's KV-cached generation by batch size.

SmolLM2-135M (fetched and converted to Megatron once, as the demo does; fp32) completes HumanEval prompts the
way the ``xdistill_humaneval`` task does: greedy, at most 512 new tokens, stopped by HumanEval's
stop strings. A finished sequence leaves its batch, so a batch costs what its unfinished
sequences cost; the rows say how much a larger batch buys on this machine, and that every batch
size gives the same responses (fp32: greedy choices agree).

  python benchmarks/bench_generation.py [--problems 24] [--batch-sizes 1 8 32] [--threads 2]

Prompts: ``--problems`` consecutive problems from the middle of the 164 ordered by prompt
length (the xdistill backend also orders by length, so a batch holds prompts of similar
length). Prints a table and keeps its rows as a result file under ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import time

from results import write_rows


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--load", default=None,
                   help="Megatron checkpoint with its hf_files/ (default: SmolLM2-135M, fetched "
                        "and converted once)")
    p.add_argument("--problems", type=int, default=24)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    from megatron_xdistill.evaluation.humaneval import STOP_STRINGS, problems
    from megatron_xdistill.evaluation.lm_eval_backend import XDistillLM
    from megatron_xdistill.generation import SamplingParams

    if args.load is None:
        from megatron_xdistill.demo.assets import fetch_model
        from megatron_xdistill.demo.workflow import convert_to_megatron

        args.load = str(convert_to_megatron("smollm2-135m", fetch_model("smollm2-135m")))
    lm = XDistillLM(load=args.load)
    encoded = sorted((lm.tok_encode(doc["prompt"]) for doc in problems()), key=len)
    middle = (len(encoded) - args.problems) // 2
    prompts = encoded[middle:middle + args.problems]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0)

    def stop_when(_i: int, ids: list[int]) -> bool:
        text = lm.tok_decode(ids, skip_special_tokens=False)
        return any(s in text for s in STOP_STRINGS)

    rows, first = [], None
    for batch in args.batch_sizes:
        start = time.perf_counter()
        responses = []
        for k in range(0, len(prompts), batch):
            responses += lm.model.generate(prompts[k:k + batch], params, [lm.eot_token_id],
                                           stop_when)
        seconds = time.perf_counter() - start
        first = first or responses
        tokens = sum(map(len, responses))
        rows.append({"batch": batch, "problems": len(prompts), "seconds": round(seconds, 1),
                     "new_tokens": tokens, "tokens_per_s": round(tokens / seconds, 1),
                     "problems_per_min": round(60 * len(prompts) / seconds, 2),
                     "longest_response": max(map(len, responses)),
                     "same_responses_as_first_row": responses == first})
    print(f"\n{'batch':>6} {'seconds':>8} {'tokens':>7} {'tok/s':>7} {'problems/min':>13} "
          f"{'longest':>8} {'same':>5}")
    for r in rows:
        print(f"{r['batch']:>6} {r['seconds']:>8} {r['new_tokens']:>7} {r['tokens_per_s']:>7} "
              f"{r['problems_per_min']:>13} {r['longest_response']:>8} "
              f"{str(r['same_responses_as_first_row']):>5}")
    write_rows("bench_generation", rows,
               params={"load": args.load, "threads": args.threads,
                       "max_new_tokens": args.max_new_tokens, "dtype": "float32"},
               notes="greedy HumanEval completions of SmolLM2-135M; a finished sequence leaves "
                     "its batch")
    return rows


if __name__ == "__main__":
    main()
