"""Teacher -> student payload transport: bytes per token and transfer bandwidth per payload form.

Colocated (synchronous exchange): two ranks (sender = a teacher's last stage, receiver = a
student rank) move one global batch of payloads per step through each transport, against a plain
device copy of the same bytes in one process as the limit:

* ``same node``: the slot transport (CPU: POSIX shared memory; ``--device cuda``: CUDA IPC, both
  ranks on one GPU, the receiver reading zero-copy views). Time = write into the slot + signal.
* ``p2p``: batched isend/irecv (CPU: gloo; GPU: NCCL, needs two GPUs, one per rank).

Disaggregated (streamed, ``RoutedStream``): one teacher rank posts steps without waiting, R student
ranks (a replica's TP ranks) each read every sample once; steady-state time per step after two
warm-up steps. Slots are written once however many ranks read them; p2p sends R copies.

Forms: full teacher vocabulary, microbatch-global top-k, per-chunk top-k + tail (k = 256 and the
demo's 64); chunks ~0.7 per token. Synchronous time per step is the slower rank's, median over
``--steps``.

  python benchmarks/bench_transport.py [--device cpu|cuda] [--tokens 2048] [--samples 2]

Prints a table and keeps its rows as a result file under ``benchmarks/results/``
(``benchmarks/results.py``); the docs' tables are generated from those files
(``tools/docs_tables.py``).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from results import write_rows

FORMS = (("full", None), ("topk", 256), ("chunk_topk", 256), ("chunk_topk", 64))


def _spec(form: str, k: int | None, chunks: int, vt: int):
    from megatron_xdistill.loss.definitions.payload import PayloadSpec

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

    from megatron_xdistill.transport.p2p import P2PTransport
    from megatron_xdistill.transport.routing import Route

    rank = dist.get_rank()
    if rank > 1:  # the third rank only serves measure_stream
        dist.barrier()
        return {"times": [], "copy_s": 0.0}
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


def measure_stream(kind: str, numel: int, samples: int, receivers: int, steps: int,
                   device_type: str) -> dict:
    """Disaggregated streaming on all ranks: rank 0 (a teacher) posts ``steps`` steps of
    ``samples`` payloads, each read by ranks 1..``receivers`` (a student replica's TP ranks),
    which read every byte once. Seconds per step in steady state (after two warm-up steps)."""
    import torch.distributed as dist

    from megatron_xdistill.transport.routed import RoutedStream
    from megatron_xdistill.transport.routing import Route

    rank = dist.get_rank()
    gpu = device_type == "cuda"
    device = torch.device("cuda", 0 if kind != "p2p" else rank) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
    routes = [Route(s, 0, r) for s in range(samples) for r in range(1, receivers + 1)]
    nodes = [0] + [1] * (dist.get_world_size() - 1) if kind == "p2p" else None
    stream = RoutedStream(routes, numel, nodes=nodes, device=device)
    outgoing = {s: torch.full((numel,), s + 1.0, device=device) for s in range(samples)}
    warmup = 2  # both slots written once: first-touch page faults and allocations are behind
    t0 = 0.0
    for step in range(warmup + steps):
        if step == warmup:
            _sync(device)
            dist.barrier()
            t0 = time.perf_counter()
        if rank == 0:
            stream.send(step, outgoing)
        elif rank <= receivers:
            got, _ = stream.receive(step)
            if step + 1 < warmup + steps:
                stream.prefetch(step + 1)
            # Read every byte (as the loss will), without allocating a copy.
            sums = [float(got[s].sum()) for s in range(samples)]
            if any(abs(v / ((s + 1.0) * numel) - 1) > 1e-3 for s, v in enumerate(sums)):
                raise RuntimeError(f"{kind}: wrong payload on rank {rank} at step {step}")
    stream.finish()
    _sync(device)
    dist.barrier()
    seconds = (time.perf_counter() - t0) / steps
    stream.close()
    return {"step_s": seconds}


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
    gpus = torch.cuda.device_count() if gpu else 0
    kinds = ["same node"]
    if not gpu or gpus >= 2:
        kinds.append("p2p")
    names = {"same node": "CUDA IPC" if gpu else "shared memory", "p2p": "NCCL" if gpu else "gloo"}

    from megatron_xdistill.testing.multirank import RankPool

    print(f"device={args.device} tokens={tokens} ({samples} x {per_sample}) V_t={args.vt} "
          f"chunks/sample={chunks}" + ("" if "p2p" in kinds else "  (NCCL: needs 2 GPUs)"))
    print("colocated (synchronous exchange, 1 sender -> 1 receiver):")
    print(f"{'payload':<18} {'B/token':>10} {'MB/step':>9} {'transport':<14} {'ms/step':>9} "
          f"{'GB/s':>7} {'copy GB/s':>9} {'% of copy':>9}")
    params = {"device": args.device, "tokens": tokens, "samples": samples, "vt": args.vt,
              "chunks_per_sample": chunks, "steps": args.steps}
    colocated, streamed = [], []
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
                colocated.append({"payload": label,
                                  "bytes_per_token": spec.bytes_per_token(per_sample),
                                  "mb_per_step": nbytes / 1e6, "transport": names[kind],
                                  "ms_per_step": 1e3 * step_s, "gb_s": gbs,
                                  "copy_gb_s": copy_gbs})
    write_rows("bench_transport", colocated, table="colocated", params=params)

    print("disaggregated (streamed, 1 teacher rank -> R student ranks reading every sample, "
          "as student TP = R):")
    print(f"{'payload':<18} {'R':>2} {'transport':<14} {'ms/step':>9} {'delivered GB/s':>15}")
    with RankPool(3) as pool:
        for form, k in (FORMS[0], FORMS[-1]):
            spec = _spec(form, k, chunks, args.vt)
            label = form if k is None else f"{form}-{k}"
            for receivers in (1, 2):
                for kind in kinds:
                    if gpu and kind == "p2p" and gpus < receivers + 1:
                        continue  # NCCL: one GPU per rank
                    out = pool.run(measure_stream, kind, spec.numel, samples, receivers,
                                   args.steps, args.device, timeout=1800)
                    step_s = max(o["step_s"] for o in out)
                    delivered = samples * spec.nbytes * receivers / step_s / 1e9
                    print(f"{label:<18} {receivers:>2} {names[kind]:<14} {1e3 * step_s:>9.2f} "
                          f"{delivered:>15.2f}", flush=True)
                    streamed.append({"payload": label, "receivers": receivers,
                                     "transport": names[kind], "ms_per_step": 1e3 * step_s,
                                     "delivered_gb_s": delivered})
    write_rows("bench_transport", streamed, table="disaggregated", params=params)


if __name__ == "__main__":
    main()
