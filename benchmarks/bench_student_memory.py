"""Student activation memory and step time: sequence parallelism and activation recomputation.

Builds a student (Qwen2.5-Coder-0.5B's architecture by default: 14 heads, so TP=2 divides it;
random weights, fp32) on 2 CPU ranks in each configuration and runs forward + backward of one
[1 x --seq-length] sample with Megatron's vocab-parallel CE. Each configuration runs in fresh
processes; the table gives the peak resident memory of rank 0 during the first step above its
memory before it (activations, gradients and temporaries; the gradients are the same in every
row of one TP size) and the time of a second step.

  python benchmarks/bench_student_memory.py [--seq-length 1024] [--model qwen2.5-coder-0.5b]

Prints a table and keeps its rows as a result file under ``benchmarks/results/``
(``benchmarks/results.py``); the docs' tables are generated from those files
(``tools/docs_tables.py``).
"""

from __future__ import annotations

import argparse
import resource
import time

from results import write_rows

CONFIGS = {
    "baseline": (1, {}),
    "selective recompute": (1, {"recompute_granularity": "selective"}),
    "full recompute (uniform, 1)": (1, {"recompute_granularity": "full",
                                        "recompute_method": "uniform",
                                        "recompute_num_layers": 1}),
    "TP2": (2, {}),
    "TP2 + sequence parallel": (2, {"sequence_parallel": True}),
    "TP2 + SP + full recompute": (2, {"sequence_parallel": True,
                                      "recompute_granularity": "full",
                                      "recompute_method": "uniform",
                                      "recompute_num_layers": 1}),
}


def _rss_mib() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * resource.getpagesize() / 2**20


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _one_config(hf_dir: str, tp: int, options: dict, seq_length: int) -> dict:
    """Rank function: build the student at TP (DP = the rest), two fwd/bwd steps."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from conversion.launch import layout_groups
    from megatron_xdistill.models import build_model_for_layout, model_info_from_hf

    if parallel_state._GLOBAL_MEMORY_BUFFER is None:
        parallel_state._set_global_memory_buffer()
    groups = layout_groups(tp, 1, who="bench")
    info = model_info_from_hf(hf_dir)
    model, config = build_model_for_layout(info, groups, torch.float32, 0, use_te=False,
                                           **options)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, info.vocab_size, (1, seq_length + 1), generator=gen)
    positions = torch.arange(seq_length)[None]

    def step() -> None:
        logits = model(tokens[:, :-1], positions, None)  # [b, s, v / tp]
        loss = vocab_parallel_cross_entropy(logits.transpose(0, 1).contiguous().float(),
                                            tokens[:, 1:].t().contiguous(),
                                            tp_group=groups.pg_collection.tp).mean()
        loss.backward()

    start = _rss_mib()
    step()
    peak = _peak_mib() - start
    t0 = time.perf_counter()
    step()
    return {"peak_mib": peak, "step_s": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-length", type=int, default=1024)
    parser.add_argument("--model", default="qwen2.5-coder-0.5b",
                        help="architecture (assets' name; TP2 needs heads divisible by 2)")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    args = parser.parse_args(argv)

    from conversion.launch import run_distributed
    from megatron_xdistill.demo.assets import fetch_model

    hf_dir = str(fetch_model(args.model))
    rows = []
    for name in args.configs:
        tp, options = CONFIGS[name]
        print(f"[bench] {name} ...", flush=True)
        rows.append((name, tp, run_distributed(_one_config, 2, hf_dir, tp, options,
                                               args.seq_length)))
    print(f"\n{args.model} architecture, random fp32 weights, 2 CPU ranks, 1 x "
          f"{args.seq_length} tokens, forward + backward with Megatron's vocab-parallel CE\n")
    print("| configuration | TP | step peak over start (MiB) | step (s) |")
    print("|---|---|---|---|")
    for name, tp, out in rows:
        print(f"| {name} | {tp} | {out['peak_mib']:,.0f} | {out['step_s']:.2f} |")
    write_rows("bench_student_memory", [
        {"configuration": name, "tp": tp, "peak_mib": out["peak_mib"], "step_s": out["step_s"]}
        for name, tp, out in rows], params={"model": args.model, "seq_length": args.seq_length})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
