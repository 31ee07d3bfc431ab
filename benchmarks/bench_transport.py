"""Teacher -> student payload transport: bytes per token and transfer bandwidth per payload form.

Two ranks (sender = a teacher's last stage, receiver = a student rank) move one global batch of
payloads per step through each transport, against a plain device copy of the same bytes in one
process as the limit:

* ``same node``: the slot transport (CPU: POSIX shared memory; ``--device cuda``: CUDA IPC, both
  ranks on one GPU, the receiver reading zero-copy views). Time = write into the slot + signal.
* ``p2p``: batched isend/irecv (CPU: gloo; GPU: NCCL, needs two GPUs, one per rank).

Forms: full teacher vocabulary, microbatch-global top-k, per-chunk top-k + tail (k = 256 and the
demo's 64); chunks ~0.7 per token. Time per step is the slower rank's, median over ``--steps``.

  python benchmarks/bench_transport.py [--device cpu|cuda] [--tokens 2048] [--samples 2]

Measured on 2 CPU cores (1 thread per rank, 2 x 1,024 tokens, V_t = 151,936, 3 steps):

  payload          B/token   MB/step  transport      ms/step   GB/s  copy GB/s  % of copy
  full             424,949     870.3  shared memory    93.84   9.27      14.64        63%
  full             424,949     870.3  gloo            768.70   1.13      16.02         7%
  topk-256             720       1.5  shared memory     0.68   2.16      33.48         6%
  chunk_topk-256     1,438       2.9  shared memory     0.64   4.64      31.07        15%
  chunk_topk-64        364       0.7  shared memory     0.52   1.44      33.13         4%
  chunk_topk-64        364       0.7  gloo              0.50   1.50      31.47         5%

Compact payloads cost 300-1,200x fewer bytes than full logits; below a few MB a step is bound by
the per-step signal (~0.5 ms), not by bandwidth. GPU numbers: ``--device cuda`` on a GPU machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

FORMS = (("full", None), ("topk", 256), ("chunk_topk", 256), ("chunk_topk", 64))


def _spec(form: str, k: int | None, chunks: int, vt: int):
    from megatron_xdistill.loss.payload import PayloadSpec

    return PayloadSpec(form, chunks, vt if form == "full" else k)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _copy_limit(nbytes: int, device: torch.device, steps: int) -> float:
    """Seconds of one device copy of ``nbytes`` (median)."""
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(steps + 1):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def measure(kind: str, numel: int, samples: int, steps: int, device_type: str) -> dict:
    """On both ranks: ``steps`` exchanges of ``samples`` payloads of ``numel`` from rank 0 to 1."""
    import torch.distributed as dist

    from megatron_xdistill.transport.gloo import P2PTransport
    from megatron_xdistill.transport.routing import Route

    rank = dist.get_rank()
    gpu = device_type == "cuda"
    if gpu:
        index = rank if kind == "p2p" else 0
        torch.cuda.set_device(index)
        device = torch.device("cuda", index)
    else:
        device = torch.device("cpu")
    routes = [Route(s, 0, 1) for s in range(samples)]
    if kind == "p2p":
        group = dist.new_group([0, 1], backend="nccl") if gpu else None
        transport = P2PTransport(routes, group=group, device=device)

        def step(out):
            return transport.exchange(out, numel)
    else:
        if gpu:
            from megatron_xdistill.transport.cuda_ipc import CudaIpcTransport

            transport = CudaIpcTransport(routes, numel, device=device)
        else:
            from megatron_xdistill.transport.shm import SharedMemoryTransport

            transport = SharedMemoryTransport(routes, numel)
        step = transport.exchange
    outgoing = ({s: torch.full((numel,), s + 1.0, device=device) for s in range(samples)}
                if rank == 0 else {})
    times = []
    for i in range(steps + 1):
        dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        got = step(outgoing)
        _sync(device)
        times.append(time.perf_counter() - t0)
        if rank == 1 and i == 0:  # the receiver got the sender's values
            for s in range(samples):
                ends = got[s].reshape(-1)[[0, -1]].cpu()
                if not torch.equal(ends, torch.full((2,), s + 1.0)):
                    raise RuntimeError(f"{kind}: sample {s} arrived as {ends.tolist()}")
    limit = _copy_limit(samples * numel * 4, device, steps) if rank == 0 else 0.0
    if kind != "p2p":
        transport.close()
    return {"times": times[1:], "copy_s": limit}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--tokens", type=int, default=None,
                        help="tokens per global batch (default 2048 on CPU, 16384 on GPU)")
    parser.add_argument("--samples", type=int, default=None, help="default 2 (CPU) / 4 (GPU)")
    parser.add_argument("--vt", type=int, default=151936)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)
    gpu = args.device == "cuda"
    tokens = args.tokens or (16384 if gpu else 2048)
    samples = args.samples or (4 if gpu else 2)
    per_sample = tokens // samples
    chunks = int(per_sample * 0.7)
    kinds = ["same node"]
    if not gpu or torch.cuda.device_count() >= 2:
        kinds.append("p2p")
    names = {"same node": "CUDA IPC" if gpu else "shared memory", "p2p": "NCCL" if gpu else "gloo"}

    from megatron_xdistill.testing.multirank import RankPool

    print(f"device={args.device} tokens={tokens} ({samples} x {per_sample}) V_t={args.vt} "
          f"chunks/sample={chunks}" + ("" if "p2p" in kinds else "  (NCCL: needs 2 GPUs)"))
    print(f"{'payload':<18} {'B/token':>10} {'MB/step':>9} {'transport':<14} {'ms/step':>9} "
          f"{'GB/s':>7} {'copy GB/s':>9} {'% of copy':>9}")
    with RankPool(2) as pool:
        for form, k in FORMS:
            spec = _spec(form, k, chunks, args.vt)
            nbytes = samples * spec.nbytes
            label = form if k is None else f"{form}-{k}"
            for kind in kinds:
                out = pool.run(measure, kind, spec.numel, samples, args.steps, args.device,
                               timeout=1800)
                step_s = statistics.median(max(a, b) for a, b in zip(out[0]["times"],
                                                                   out[1]["times"]))
                gbs, copy_gbs = nbytes / step_s / 1e9, nbytes / out[0]["copy_s"] / 1e9
                print(f"{label:<18} {spec.bytes_per_token(per_sample):>10,.0f} "
                      f"{nbytes / 1e6:>9.1f} {names[kind]:<14} {1e3 * step_s:>9.2f} "
                      f"{gbs:>7.2f} {copy_gbs:>9.2f} {100 * gbs / copy_gbs:>8.0f}%", flush=True)


if __name__ == "__main__":
    main()
