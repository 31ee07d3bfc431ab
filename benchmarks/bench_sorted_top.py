"""Gold / H-KL's costliest step: the n largest uncommon probabilities of each chunk row, sorted.

The gold form compares the sorted uncommon probabilities of student and teacher (ULD); on a GPU
``torch.topk(8192)`` over ~24k uncommon columns is a large share of gold's time. This times the
ways to get those values, forward only and forward + backward (the gradient goes back to the
columns they came from):

  topk          x.topk(n, sorted=True).values (what runs on an accelerator today)
  sort          x.sort(descending=True).values[:, :n] (a full segmented sort)
  radix         loss.sorted_top's CPU path (a Numba radix select + sort), CPU only

  python benchmarks/bench_sorted_top.py [--device cuda] [--rows 1024 4096] [--width 24576]
      [--n 8192] [--repeat 5]

Each row of the table: mean milliseconds per call over ``--repeat`` calls after one warm-up, and
whether the values equal topk's (they must, to the last bit, for the method to be usable).
The rows are kept as a result file under ``benchmarks/results/`` (``benchmarks/results.py``).
"""

from __future__ import annotations

import argparse
import time

import torch
from results import write_rows


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _methods(device: torch.device) -> dict:
    from megatron_xdistill.loss.cpu.sorted_top import sorted_top

    out = {
        "topk": lambda x, n: x.topk(n, dim=1, sorted=True).values,
        "sort": lambda x, n: x.sort(dim=1, descending=True).values[:, :n],
    }
    if device.type == "cpu":
        out["radix"] = sorted_top
    return out


def _time(fn, x: torch.Tensor, n: int, backward: bool, repeat: int, device) -> float:
    def call():
        if backward:
            leaf = x.detach().requires_grad_(True)
            fn(leaf, n).sum().backward()
        else:
            with torch.no_grad():
                fn(x, n)

    call()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(repeat):
        call()
    _sync(device)
    return 1e3 * (time.perf_counter() - t0) / repeat


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--rows", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--width", type=int, default=24576, help="uncommon columns per row")
    parser.add_argument("--n", type=int, default=8192, help="values kept (gold's cap)")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    print(f"{'rows':>6} {'method':<8} {'pass':<18} {'ms / call':>10} {'equals topk':>12}",
          flush=True)
    gen = torch.Generator().manual_seed(0)
    kept = []
    for rows in args.rows:
        logits = torch.randn(rows, args.width, generator=gen) * 3
        x = torch.softmax(logits, dim=1).to(device)  # probabilities, as gold sorts them
        want = x.topk(args.n, dim=1, sorted=True).values
        for name, fn in _methods(device).items():
            with torch.no_grad():
                same = bool(torch.equal(fn(x, args.n), want))
            for backward in (False, True):
                ms = _time(fn, x, args.n, backward, args.repeat, device)
                print(f"{rows:>6} {name:<8} {'forward + backward' if backward else 'forward':<18} "
                      f"{ms:>10.2f} {str(same):>12}", flush=True)
                kept.append({"rows": rows, "method": name,
                             "pass": "forward + backward" if backward else "forward",
                             "ms_per_call": ms, "equals_topk": same})
    write_rows("bench_sorted_top", kept,
               params={"device": args.device, "width": args.width, "n": args.n,
                       "repeat": args.repeat, "threads": torch.get_num_threads()})


if __name__ == "__main__":
    main()
