"""Time and peak memory of the student-side KD loss vs Megatron's vocab-parallel cross-entropy.

Same student logits [1, tokens, V_s] for both (``--dtype``: fp32 or bf16), TP = 1 on one process,
forward + backward. Each (method, size) runs in a fresh child process (CPU threads pinned to
``--threads``): the KD child never imports Megatron; the CE child does (``mcore_compat.install()``)
and calls ``tensor_parallel.vocab_parallel_cross_entropy`` on [s, b, v] logits, refreshing the
logits it destroys in place (outside the timed region). Time: the minimum over ``--repeat`` runs
after one warm-up (wall and process CPU time; on a GPU the ratio to CE uses wall time). Memory:
peak (GPU: torch's allocated bytes; CPU: RSS) of the timed runs minus what the inputs hold, net
of the .grad buffer where one is made (the CE's; the KD loss writes its gradient over the logits,
as training's teacher-0 call does, unless ``--fresh-grad``). Chunks: ~0.7 per token, sizes 1-2;
W has up to 4 entries per row (45% one-to-one rows), rows normalised to sum 1, 0.1% empty rows
(like the builders' output), or a real W with ``--projection``.

On a GPU each row also gives the kernel launches of one forward + backward (torch.profiler's
CUDA kernels) and the share of the bandwidth floor: reading the logits once and writing their
gradient once at the device's copy bandwidth (measured in the child), against the row's time.
The exact (image) and gold / H-KL forms (``gold_topk``: gold from the compact payload,
``--gold-topk`` / ``--gold-uncommon-topk``) take the fused Triton passes there (``loss/fused``);
``--blockwise`` measures the blockwise plan instead (``XDISTILL_FUSED_FORMS=0``).

  python benchmarks/bench_loss.py [--tokens 4096] [--vs 49152 128256] [--forms topk chunk_topk]
  python benchmarks/bench_loss.py --device cuda --tokens 16384 --vs 49152 128256 \
      --forms chunk_topk image gold hkl gold_topk --with-ce --dtype bfloat16

Every run writes its rows under benchmarks/results/bench_loss/ (benchmarks/results.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

_CHILD = r"""
import json, os, resource, sys, time
cfg = json.loads(sys.argv[1])
import torch
torch.set_num_threads(cfg["threads"])
import psutil

def rss():
    return psutil.Process().memory_info().rss

def reset_peak():  # from here on: the inputs' setup (payload, W) has its own, higher peak
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    elif os.path.exists("/proc/self/clear_refs"):  # Linux: VmHWM restarts from the RSS now
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")

def peak_rss():
    if os.path.exists("/proc/self/status"):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # the process's peak

n, vs, vt, form, k = cfg["tokens"], cfg["vs"], cfg["vt"], cfg["form"], cfg["topk"]
dtype = getattr(torch, cfg["dtype"])
dev = torch.device(cfg["device"])
gpu = dev.type == "cuda"
if gpu:
    dev = torch.device("cuda", dev.index or 0)
    torch.cuda.set_device(dev)

def fill(t):  # the same logits every time (B = 1: [1, n, v] and [n, 1, v] share one layout)
    return t.normal_(0.0, 2.0, generator=torch.Generator(dev).manual_seed(0))

def clock():  # (wall, process CPU) seconds, after the device's queued work
    if gpu:
        torch.cuda.synchronize()
    return time.perf_counter(), time.process_time()

def memory():  # bytes in use now (GPU: allocated by torch; CPU: resident set)
    return torch.cuda.memory_allocated() if gpu else rss()

gen = torch.Generator().manual_seed(0)
logits = fill(torch.empty((n, 1, vs) if form == "ce" else (1, n, vs), dtype=dtype, device=dev))
labels = torch.randint(0, vs, (1, n), generator=torch.Generator().manual_seed(1)).to(dev)
timings = []
if form == "ce":
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(cfg["port"]))
    from megatron_xdistill.mcore import compat as mcore_compat
    mcore_compat.install()
    import torch.distributed as dist
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
    dist.init_process_group("nccl" if gpu else "gloo", rank=0, world_size=1)
    work = logits  # [s, b, v]; the CE overwrites it, so it is refilled before every run
    target = labels.t().contiguous()
    base = memory()
    for i in range(cfg["repeat"] + 1):
        if i == 1:
            reset_peak()  # the timed runs' peak, not the warm-up's one-time work
        fill(work)
        leaf = work.requires_grad_(True)
        t0, c0 = clock()
        loss = vocab_parallel_cross_entropy(leaf, target, tp_group=dist.group.WORLD).mean()
        loss.backward()
        t1, c1 = clock()
        timings.append((t1 - t0, c1 - c0))
        leaf.grad = None
        work = work.detach()
else:
    from megatron_xdistill.loss import (PayloadSpec, ProjectionShard, TeacherPayload,
                                        parallel_kd_loss)
    c = int(n * 0.7)
    ids = (torch.arange(n) * c // n).view(1, n)
    real_w = None
    if cfg["projection"]:  # a real W (its vocabularies set vs and vt)
        from megatron_xdistill.projection.runtime import load_projection
        real_w = load_projection(cfg["projection"])
        idx, w = real_w.local_shard(0, vs)
    else:
        idx = torch.randint(0, vt, (vs, 4), generator=gen)
        w = torch.rand(vs, 4, generator=gen)
        kind = torch.rand(vs, 1, generator=gen)
        w[:, 1:] *= (kind > 0.45).float()        # ~45% one-to-one rows
        idx[:, 1:][(kind <= 0.45).expand(-1, 3)] = -1
        w /= w.sum(1, keepdim=True)              # rows sum to 1, as the projection builders write
        empty = torch.rand(vs, generator=gen) < 0.001  # a few empty rows (tokens W cannot map)
        idx[empty], w[empty] = -1, 0.0
    shard = ProjectionShard(idx, w, 0, vt)
    has = torch.ones(1, c, dtype=torch.bool)
    logp = torch.log_softmax(torch.randn(1, c, k, generator=gen), -1)
    common = None
    if form == "topk":
        payload = TeacherPayload(PayloadSpec("topk", c, k), logp, has,
                                 columns=torch.randperm(vt, generator=gen)[:k].sort().values[None])
    elif form == "chunk_topk":
        payload = TeacherPayload(PayloadSpec("chunk_topk", c, k), logp, has,
                                 columns=torch.randint(0, vt, (1, c, k), generator=gen),
                                 tail_logprob=torch.full((1, c), -2.0))
    elif form == "full":  # [c, V_t] log-probs written block by block (no full-size transient,
        spec = PayloadSpec("full", c, vt)  # which the peak RSS would count as the loss's memory)
        flat = torch.empty(1, spec.numel)
        rows = flat[0, : c * vt].view(c, vt)
        for lo in range(0, c, 256):
            rows[lo: lo + 256] = torch.log_softmax(
                torch.randn(min(256, c - lo), vt, generator=gen), -1)
        flat[0, c * vt:] = 1.0  # has_teacher
        payload = TeacherPayload.from_flat(flat, spec)
    elif form == "image":  # P on W's image from the full form's rows, the teacher's sums
        from megatron_xdistill.loss import teacher_image
        from megatron_xdistill.loss.definitions.payload import float64_as_pair
        image = teacher_image(idx, w, vs)
        spec = PayloadSpec("image", c, image.numel())
        flat = torch.empty(1, spec.numel)
        rows = flat[0, : c * image.numel()].view(c, image.numel())
        sums = torch.empty(c, 2, dtype=torch.float64)
        argmax = torch.empty(c)
        rest = torch.ones(vt, dtype=torch.bool)
        rest[image] = False
        for lo in range(0, c, 256):
            block = torch.log_softmax(torch.randn(min(256, c - lo), vt, generator=gen), -1)
            rows[lo: lo + 256] = block[:, image].exp()
            every = block.double()
            sums[lo: lo + 256, 0] = (every.exp() * every).sum(-1)
            sums[lo: lo + 256, 1] = every[:, rest].exp().sum(-1)
            argmax[lo: lo + 256] = block.argmax(-1).float()
        at = c * image.numel()
        flat[0, at + c: at + 5 * c] = float64_as_pair(sums).reshape(-1)  # after has_teacher
        flat[0, at: at + c] = 1.0
        flat[0, at + 5 * c:] = argmax
        payload = TeacherPayload.from_flat(flat, spec)
    else:  # gold / H-KL: half of the student vocabulary is common (a real W: its strict or
        # xtoken pairs)
        common = (torch.randperm(vs, generator=gen)[: vs // 2].sort().values if real_w is None
                  else real_w.common_vocab("xtoken" if form == "hkl" else "strict")[0])
        m = common.numel()
        unc = min(8192, vt - m)
        if form == "gold_topk":  # the compact payload: the teacher's top k pairs (distinct,
            # descending) + a bucket, its k' largest uncommon probabilities + a tail, of n
            span = max(0, min(unc, vs - m))
            k_top, k_unc = min(cfg["gold_topk"], m), min(cfg["gold_uncommon_topk"], span)
            logp = torch.log_softmax(torch.randn(1, c, k_top + 1, generator=gen), -1)
            start = torch.randint(0, m, (1, c, 1), generator=gen)
            payload = TeacherPayload(
                PayloadSpec("gold_topk", c, k_top, k_unc, span=span, pairs=m),
                logp[..., :k_top].sort(-1, descending=True).values, has,
                columns=(start + torch.arange(k_top)) % m, tail_logprob=logp[..., k_top],
                uncommon_probs=torch.rand(1, c, k_unc, generator=gen).sort(
                    -1, descending=True).values * 1e-3,
                uncommon_tail=torch.rand(1, c, generator=gen) * 0.1)
        else:
            payload = TeacherPayload(
                PayloadSpec("gold", c, m, unc), torch.log_softmax(torch.randn(1, c, m), -1), has,
                uncommon_probs=torch.rand(1, c, unc).sort(-1, descending=True).values * 1e-3)
    mode = {"gold": "gold", "gold_topk": "gold", "hkl": "hkl"}.get(form, "pkl")
    if form not in ("full", "image") or gpu:
        payload = TeacherPayload.from_flat(payload.to_flat().to(dev), payload.spec)
    ids, has = ids.to(dev), has.to(dev)
    common = None if common is None else common.to(dev)
    shard = shard.to(dev)
    base = memory()
    work = logits

    def kd_step():  # one forward + backward of the KD loss (+ CE with --with-ce)
        global work  # like the CE, the loss writes its gradient over the logits (training's
        fill(work)   # call with one teacher): refilled outside the timed region
        leaf = work.requires_grad_(True)
        t0, c0 = clock()
        terms = parallel_kd_loss(leaf, payload, ids, has, has, shard, student_vocab_size=vs,
                                 mode=mode, common_student_ids=common,
                                 labels=labels if cfg["with_ce"] else None,
                                 block_bytes=None if cfg["block_mib"] is None
                                 else cfg["block_mib"] << 20,
                                 grad_into_logits=cfg["grad_into_logits"],
                                 loss_weights=None if cfg["recompute"] else (1.0 / c, 1.0))
        (terms.kd_sum / c + terms.ce_sum).backward()  # every chunk counts: kd_count = c
        t1, c1 = clock()
        leaf.grad = None
        work = work.detach()
        return t1 - t0, c1 - c0

    for i in range(cfg["repeat"] + 1):
        if i == 1:
            reset_peak()  # the timed runs' peak, not the warm-up's (Numba's compiling, caches)
        timings.append(kd_step())
launches = floor_share = None
if gpu:  # kernels of one more forward + backward; the share of the bandwidth floor
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler
    with profiler(activities=[ProfilerActivity.CUDA]) as prof:
        if form == "ce":
            fill(work)
            leaf = work.requires_grad_(True)
            vocab_parallel_cross_entropy(leaf, target, tp_group=dist.group.WORLD).mean().backward()
            leaf.grad = None
            work = work.detach()
        else:
            kd_step()
        torch.cuda.synchronize()
    launches = sum(1 for e in prof.events() if e.device_type.name == "CUDA")
    src = torch.empty(1 << 28, dtype=torch.float32, device=dev)
    dst = torch.empty_like(src)
    dst.copy_(src)
    t0, _ = clock()
    for _ in range(5):
        dst.copy_(src)
    t1, _ = clock()
    copy_bw = 5 * 2 * src.numel() * 4 / (t1 - t0)  # bytes read + written a second
    floor_bytes = 2 * logits.numel() * logits.element_size()
    floor_share = floor_bytes / copy_bw / min(t[0] for t in timings[1:])
    del src, dst
# .grad: a new buffer, except where the KD loss writes it over the logits
grad_bytes = (0 if form != "ce" and cfg["grad_into_logits"]
              else logits.numel() * logits.element_size())
if gpu:
    peak = torch.cuda.max_memory_allocated()
else:
    peak = peak_rss()
profile = None
if cfg["profile"] and form != "ce":  # one more forward + backward under torch.profiler
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    with profiler(activities=acts) as prof:
        kd_step()
        clock()
    key = "self_device_time_total" if gpu else "self_cpu_time_total"
    profile = prof.key_averages().table(sort_by=key, row_limit=cfg["profile"])
best = timings[1:]
print(json.dumps({
    "wall_s": min(t[0] for t in best), "cpu_s": min(t[1] for t in best),
    "extra_gib": (peak - base) / 2**30, "grad_gib": grad_bytes / 2**30,
    "logits_gib": logits.numel() * logits.element_size() / 2**30, "profile": profile,
    "launches": launches, "floor_share": floor_share,
}))
"""


def run(cfg: dict) -> dict:
    """One measurement in a child process."""
    env = dict(os.environ, OMP_NUM_THREADS=str(cfg["threads"]))
    if cfg.get("blockwise"):
        env["XDISTILL_FUSED_FORMS"] = "0"
    out = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(cfg)], env=env,
                         capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def _positions_a_block(name: str, tokens: int, vs: int, args: argparse.Namespace) -> str:
    """Positions per block of the blockwise forms (the exact and gold ones on CPU, or with
    ``--blockwise``; "-" for the others, which a GPU runs whole)."""
    import torch

    from megatron_xdistill.loss.blocks.block_size import block_positions
    from megatron_xdistill.loss.kernels.gold import GoldKernel
    from megatron_xdistill.loss.kernels.pkl import DenseKernel

    kernel = {"KD full": DenseKernel, "KD image": DenseKernel, "KD gold": GoldKernel,
              "KD hkl": GoldKernel, "KD gold_topk": GoldKernel}.get(name)
    fused = (args.device.startswith("cuda") and not args.blockwise
             and name in ("KD image", "KD gold", "KD hkl", "KD gold_topk"))  # no blocks
    if kernel is None or fused:
        return "-"
    itemsize = 2 if args.dtype == "bfloat16" else 4
    block_bytes = None if args.block_mib is None else args.block_mib << 20
    return str(block_positions(kernel, tokens, vs, itemsize, torch.device(args.device),
                               block_bytes))


def _or_dash(value, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096])
    parser.add_argument("--vs", type=int, nargs="+", default=[49152, 128256])
    parser.add_argument("--vt", type=int, default=151936)
    parser.add_argument("--forms", nargs="+", default=["topk", "chunk_topk"],
                        choices=["topk", "chunk_topk", "full", "image", "gold", "hkl",
                                 "gold_topk"])
    parser.add_argument("--topk", type=int, default=256)
    parser.add_argument("--gold-topk", type=int, default=64,
                        help="gold_topk: the teacher's common pairs shipped (k; training's "
                             "--kd-gold-topk)")
    parser.add_argument("--gold-uncommon-topk", type=int, default=256,
                        help="gold_topk: its sorted uncommon probabilities shipped (k'; "
                             "training's --kd-gold-uncommon-topk)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu",
                        help="cpu or cuda[:i]; on a GPU the ratio uses wall time and memory is "
                             "torch's allocated bytes")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--block-mib", type=int, default=None,
                        help="one block's fp32 [block, V] buffer (default: the loss's own choice, "
                             "64 MiB and a share of the positions)")
    parser.add_argument("--with-ce", action="store_true", help="KD rows also fuse the CE")
    parser.add_argument("--fresh-grad", action="store_true",
                        help="the KD loss allocates the logits' gradient (grad_into_logits=False: "
                             "what a later-made loss on the same logits needs, e.g. teacher 1 "
                             "of several); default: written over the logits, as training's "
                             "call of teacher 0 and Megatron's CE do")
    parser.add_argument("--recompute", action="store_true",
                        help="the KD call gets no loss_weights: its backward recomputes each "
                             "block's softmax and sums (what a call gets whose loss weights are "
                             "not known before it, dynamic scaling, and teacher 0 of several "
                             "where another teacher's call recomputes); default: the forward "
                             "writes the gradient, as training's calls with known weights")
    parser.add_argument("--projection", default=None, metavar="PATH",
                        help="a real W (.safetensors from the projection CLI) instead of the "
                             "synthetic one; its vocabularies set V_s and V_t (gold: its strict "
                             "common pairs)")
    parser.add_argument("--blockwise", action="store_true",
                        help="the exact and gold forms by the blockwise plan, not the fused "
                             "Triton passes (XDISTILL_FUSED_FORMS=0)")
    parser.add_argument("--profile", type=int, default=0, metavar="ROWS",
                        help="after each KD row, the ROWS operations (GPU: kernels) that took "
                             "the most time in one more forward + backward (torch.profiler)")
    args = parser.parse_args(argv)
    if args.projection:
        from megatron_xdistill.projection.runtime import load_projection
        real_w = load_projection(args.projection)
        args.vs, args.vt = [real_w.student_vocab_size], real_w.teacher_vocab_size
    port = 29000 + os.getpid() % 1000
    clock = "wall_s" if args.device.startswith("cuda") else "cpu_s"
    head = (f"{'tokens':>6} {'V_s':>7} {'method':<16} {'wall s':>7} {'cpu s':>7} {'x CE':>5} "
            f"{'extra GiB':>9} {'net of grad':>11} {'% logits':>8} {'pos/block':>9} "
            f"{'launches':>8} {'% floor':>7}")
    print(f"V_t={args.vt} W={args.projection or 'synthetic'} topk={args.topk} "
          f"dtype={args.dtype} threads={args.threads} "
          f"block={'default' if args.block_mib is None else f'{args.block_mib} MiB'}"
          f"{' +CE' if args.with_ce else ''} KD grad="
          f"{'fresh buffer' if args.fresh_grad else 'over the logits'}, "
          f"{'recomputed in the backward' if args.recompute else 'written by the forward'}")
    print(head)
    kept = []  # the printed rows, for benchmarks/results.py
    for tokens in args.tokens:
        for vs in args.vs:
            base = dict(tokens=tokens, vs=vs, vt=args.vt, topk=args.topk, dtype=args.dtype,
                        gold_topk=args.gold_topk, gold_uncommon_topk=args.gold_uncommon_topk,
                        device=args.device,
                        threads=args.threads, repeat=args.repeat, port=port,
                        block_mib=args.block_mib, with_ce=args.with_ce,
                        grad_into_logits=not args.fresh_grad, recompute=args.recompute,
                        profile=args.profile, projection=args.projection,
                        blockwise=args.blockwise)
            ce = run({**base, "form": "ce"})
            rows = [("megatron CE", ce)]
            for form in args.forms:
                rows.append((f"KD {form}", run({**base, "form": form})))
            for name, r in rows:
                net = r["extra_gib"] - r["grad_gib"]
                print(f"{tokens:>6} {vs:>7} {name:<16} {r['wall_s']:>7.3f} {r['cpu_s']:>7.3f} "
                      f"{r[clock] / ce[clock]:>5.2f} {r['extra_gib']:>9.3f} {net:>11.3f} "
                      f"{100 * net / r['logits_gib']:>7.1f}% "
                      f"{_positions_a_block(name, tokens, vs, args):>9} "
                      f"{_or_dash(r.get('launches'), '{:d}'):>8} "
                      f"{_or_dash(r.get('floor_share'), '{:.0%}'):>7}", flush=True)
                kept.append({"tokens": tokens, "vs": vs, "method": name, **{
                    k: v for k, v in r.items() if k != "profile"},
                    "x_ce": r[clock] / ce[clock], "net_gib": net,
                    "net_pct_logits": 100 * net / r["logits_gib"],
                    "positions_a_block": _positions_a_block(name, tokens, vs, args)})
            for name, r in rows:
                if r.get("profile"):
                    print(f"\n{name}, {tokens} tokens, V_s {vs}: one forward + backward\n"
                          f"{r['profile']}", flush=True)
    from results import write_rows

    write_rows("bench_loss", kept, params={k: v for k, v in vars(args).items()
                                           if k not in ("tokens", "vs")})


if __name__ == "__main__":
    main()
