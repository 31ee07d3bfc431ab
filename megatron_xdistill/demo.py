"""`make demo`: the smallest real thing the package does today, end to end on this machine.

Until the full cross-tokenizer distillation demo lands, this trains a tiny Megatron-Core GPTModel
for a few steps on two CPU ranks with tensor parallelism (TP=2, gloo) and checks each step's loss
against the same model run unsharded in one process. It says so when it starts.
"""

from __future__ import annotations

import time

import torch

STEPS = 5


def _train(tp: int, steps: int) -> list[float]:
    """A few Adam steps of the tiny GPT on a fixed batch; returns the loss per step."""
    from megatron_xdistill.testing.tiny_gpt import build_tiny_gpt, init_model_parallel, tiny_config

    init_model_parallel(tp=tp)
    torch.manual_seed(0)
    model = build_tiny_gpt(tiny_config(tp=tp))
    # use_cpu_initialization draws the full weights and splits them: same start at every TP.
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 256, (4, 33), generator=gen)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    pos = torch.arange(32).expand(4, 32)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(inputs, pos, None, labels=labels).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main() -> None:
    print("megatron-xdistill demo (foundation stage): the cross-tokenizer distillation demo is not")
    print("built yet; this shows Megatron-Core training a tiny GPT on CPU ranks with gloo.")
    from megatron_xdistill.testing.multirank import RankPool

    start = time.time()
    with RankPool(1) as one:
        ref = one.run(_train, 1, STEPS)[0]
    with RankPool(2) as two:
        par = two.run(_train, 2, STEPS)[0]
    print(f"{'step':>4}  {'loss TP=1':>12}  {'loss TP=2':>12}  {'rel diff':>9}")
    for i, (a, b) in enumerate(zip(ref, par), 1):
        print(f"{i:>4}  {a:12.6f}  {b:12.6f}  {abs(a - b) / abs(a):9.1e}")
    print(f"done in {time.time() - start:.1f} s")


if __name__ == "__main__":
    main()
