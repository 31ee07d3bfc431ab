"""One training step of a distillation run at cluster scale, simulated on one CPU.

The project's own code runs for one rank of a world that does not exist
(:func:`.counting.simulated_rank`): the node/GPU all-gather, Megatron-Core's ``HyperCommGrid``
groups for the student's and every teacher's layout, the disaggregated worlds, the routing plans
and the transports' construction (:class:`~.routed.RoutedTransport` /
:class:`~.routed.RoutedStream` with slot buffers and point-to-point buffers on the ``meta``
device, so nothing is allocated). What it records is turned into time by the cost model of
:mod:`.scale_costs`; the payload traffic of a step follows from the plans and the node map.
"""

from __future__ import annotations

import math
import time
import tracemalloc
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace

import torch

from megatron_xdistill.loss import payload_spec
from megatron_xdistill.parallel.layout import ParallelLayout
from megatron_xdistill.parallel.placement import Placement
from megatron_xdistill.transport import routed
from megatron_xdistill.transport.construction import build_run_transports
from megatron_xdistill.transport.counting import DistRecord, simulated_rank
from megatron_xdistill.transport.routing import Route, layout_rank
from megatron_xdistill.transport.scale_costs import MODELS, CostModel, forward_flops_per_token


@dataclass(frozen=True)
class TeacherSetup:
    """One teacher: its model (a key of ``MODELS``), layout (``ep``: expert parallelism of an
    MoE teacher, within each stage's CP x DP ranks) and (disaggregated) its ranks."""

    model: str
    tp: int = 1
    cp: int = 1
    pp: int = 1
    ranks: int | None = None
    ep: int = 1


@dataclass(frozen=True)
class Scenario:
    """A world, both sides' models and layouts, the batch and the payload form."""

    gpus: int
    student: str = "llama-3.2-1b"
    student_tp: int = 1
    student_cp: int = 1
    student_pp: int = 1
    teachers: tuple[TeacherSetup, ...] = (TeacherSetup("qwen3-8b"),)
    placement: str = "colocated"
    gpus_per_node: int = 8
    seq_length: int = 4096
    micro_batch_size: int = 1
    micro_batches: int = 8  # per student replica and step: global batch = DP x mbs x this
    form: str = "chunk_topk"
    topk: int = 64
    num_common: int = 109566  # Llama-3 -> Qwen3 common pairs (strict), measured
    num_image: int = 109827  # Llama-3 -> Qwen3: W's image over the student vocabulary
    gold_topk: int = 64  # compact gold: --kd-gold-topk, common pairs shipped
    gold_uncommon_topk: int = 256  # --kd-gold-uncommon-topk, sorted uncommon probabilities

    def placement_of(self) -> Placement:
        if self.placement == "colocated":
            return Placement("colocated", self.gpus)
        split = tuple(t.ranks for t in self.teachers)
        if any(r is None for r in split):
            raise ValueError("disaggregated scenario: give every teacher its ranks")
        return Placement("disaggregated", self.gpus, sum(split),
                         split if len(split) > 1 else ())

    def layouts(self) -> tuple[ParallelLayout, list[ParallelLayout]]:
        placement = self.placement_of()
        student = ParallelLayout.for_world(placement.student_size, self.student_tp,
                                           self.student_cp, self.student_pp, who="student")
        teachers = [ParallelLayout.for_world(placement.teacher_size_of(k), t.tp, t.cp, t.pp,
                                             who=f"teacher {t.model}", ep=t.ep)
                    for k, t in enumerate(self.teachers)]
        return student, teachers

    def global_batch_size(self) -> int:
        """Weak scaling: every student replica trains ``micro_batches`` micro-batches; rounded
        up so that every teacher's data-parallel size divides it."""
        student, teachers = self.layouts()
        unit = student.dp * self.micro_batch_size
        for t in teachers:
            unit = unit * t.dp // math.gcd(unit, t.dp)
        want = student.dp * self.micro_batch_size * self.micro_batches
        return -(-want // unit) * unit

    def payload_numel(self, teacher: TeacherSetup) -> int:
        """Floats per sample (the loss package's payload spec for this form; the compact gold
        form's uncommon span is capped by the student's vocabulary too)."""
        spec = payload_spec(self.form, self.seq_length + 1, MODELS[teacher.model].vocab,
                            topk=self.topk, num_common=self.num_common,
                            num_image=self.num_image, gold_topk=self.gold_topk,
                            gold_uncommon_topk=self.gold_uncommon_topk,
                            student_vocab_size=MODELS[self.student].vocab)
        return spec.numel


class _MetaSlots:
    """Slot memory that holds nothing (construction only)."""

    kind = "CUDA IPC"

    def create(self, nbytes: int):
        return torch.empty(0, dtype=torch.uint8, device="meta"), None

    def open(self, handle) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8, device="meta")

    def sealed(self) -> None: ...

    def settle(self) -> None: ...

    def deliver(self, view: torch.Tensor) -> torch.Tensor:
        return view

    def release(self) -> None: ...


@contextmanager
def _meta_slots() -> Iterator[None]:
    saved = routed.slot_memory, routed._slot_memory_class
    routed.slot_memory = lambda device: _MetaSlots()
    routed._slot_memory_class = lambda device: _MetaSlots
    try:
        yield
    finally:
        routed.slot_memory, routed._slot_memory_class = saved


def places_of(gpus: int, gpus_per_node: int) -> tuple[list[int], list[str]]:
    """Node index and GPU id of every rank (torchrun's node-major order)."""
    return ([r // gpus_per_node for r in range(gpus)],
            [f"node{r // gpus_per_node}/gpu{r % gpus_per_node}" for r in range(gpus)])


@dataclass
class Construction:
    """One rank's construction: measured CPU seconds (process time) and peak heap, and what it
    asked of torch.distributed."""

    rank: int
    seconds: float
    plan_seconds: float
    peak_bytes: int
    record: DistRecord
    routes: list[list[Route]] = field(default_factory=list)


def construct(scenario: Scenario, rank: int, memory: bool = False,
              backend: str = "nccl") -> Construction:
    """Run the project's construction of ``scenario`` as ``rank``
    (:func:`.construction.build_run_transports`: what a Distiller builds) and time it in this
    process's CPU time, which other jobs on a loaded machine do not inflate. ``memory``:
    trace the Python heap (slower). ``backend``: the default group's and the cross-node
    groups' (NCCL on a GPU cluster; gloo to compare with a CPU run)."""
    placement = scenario.placement_of()
    student, teachers = scenario.layouts()
    gbs = scenario.global_batch_size()
    nodes, gpu_ids = places_of(scenario.gpus, scenario.gpus_per_node)
    numels = [scenario.payload_numel(t) for t in scenario.teachers]
    if memory:
        tracemalloc.start()
    start = time.process_time()
    with simulated_rank(rank, scenario.gpus, default_backend=backend,
                        gathered=lambda r, obj: (nodes[r], gpu_ids[r])) as record, _meta_slots():
        built = build_run_transports(placement, student, teachers, gbs,
                                     scenario.micro_batch_size, numels, device="meta",
                                     backend=backend)
    seconds = time.process_time() - start
    peak = 0
    if memory:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return Construction(rank, seconds, built.plan_seconds, peak, record, built.plans)


@dataclass
class Traffic:
    """One step's payload bytes: per rank across nodes (out/in) and within nodes."""

    out_bytes: list[int]
    in_bytes: list[int]
    same_node_bytes: int
    gpus_per_node: int

    def node_totals(self) -> tuple[list[int], list[int]]:
        n = len(self.out_bytes) // self.gpus_per_node
        g = self.gpus_per_node
        return ([sum(self.out_bytes[i * g:(i + 1) * g]) for i in range(n)],
                [sum(self.in_bytes[i * g:(i + 1) * g]) for i in range(n)])


def step_traffic(scenario: Scenario, plans: list[list[Route]], num_stats: int = 1) -> Traffic:
    """Bytes each rank sends and receives across nodes in one step, as the transports move
    them: one message per cross-node route (colocated, :class:`~.p2p.P2PTransport`), or one
    buffer per (sender, receiver) pair with ``num_stats`` trailing floats (disaggregated,
    :class:`~.stream.P2PStream`); same-node routes through slots, one copy per sample read
    by each receiver."""
    nodes, _ = places_of(scenario.gpus, scenario.gpus_per_node)
    out = [0] * scenario.gpus
    into = [0] * scenario.gpus
    same = 0
    streamed = scenario.placement == "disaggregated"
    for k, routes in enumerate(plans):
        nbytes = 4 * scenario.payload_numel(scenario.teachers[k])
        pairs = set()
        for r in routes:
            if r.src == r.dst:
                continue
            if nodes[r.src] == nodes[r.dst]:
                same += nbytes
                continue
            out[r.src] += nbytes
            into[r.dst] += nbytes
            pairs.add((r.src, r.dst))
        if streamed:
            for src, dst in pairs:
                out[src] += 4 * num_stats
                into[dst] += 4 * num_stats
    return Traffic(out, into, same, scenario.gpus_per_node)


def one_sender_plans(scenario: Scenario, plans: list[list[Route]]) -> list[list[Route]]:
    """The same copies, each sent by its teacher replica's first last-stage rank (TP 0, CP 0)
    alone: what the busiest link would carry without spreading the sends over TP x CP."""
    placement = scenario.placement_of()
    _, teachers = scenario.layouts()
    out = []
    for k, routes in enumerate(plans):
        layout, offset = teachers[k], placement.teacher_offset_of(k)
        out.append([Route(r.sample, layout_rank(layout, offset, 0, 0,
                                                layout.coords(r.src - offset)["dp"],
                                                layout.pp - 1), r.dst) for r in routes])
    return out


def _busiest(traffic: Traffic) -> tuple[int, float]:
    """Busiest GPU NIC's bytes (in or out) and the mean over GPUs."""
    gpu_bytes = [max(o, i) for o, i in zip(traffic.out_bytes, traffic.in_bytes, strict=True)]
    return max(gpu_bytes), sum(gpu_bytes) / len(gpu_bytes)


def compute_seconds(scenario: Scenario, costs: CostModel) -> dict[str, float]:
    """Student step and teacher forwards of one global batch from the FLOP model."""
    placement = scenario.placement_of()
    tokens = scenario.global_batch_size() * scenario.seq_length
    rate = costs.peak_flops * costs.mfu
    student = 3 * forward_flops_per_token(MODELS[scenario.student], scenario.seq_length) * tokens
    out = {"student_step_s": student / (placement.student_size * rate)}
    teacher_s = []
    for k, t in enumerate(scenario.teachers):
        flops = forward_flops_per_token(MODELS[t.model], scenario.seq_length) * tokens
        teacher_s.append(flops / (placement.teacher_size_of(k) * rate))
    out["teacher_forward_s"] = sum(teacher_s) if not placement.disaggregated else max(teacher_s)
    return out


def simulate(scenario: Scenario, costs: CostModel | None = None,
             ranks: list[int] | None = None, forms: tuple[str, ...] | None = None,
             memory: bool = True) -> list[dict]:
    """Reports of one step of ``scenario`` (JSON-ready), one per payload form (default: the
    scenario's): construction on the given ranks (default: rank 0 and the first teacher's first
    sender; the form only sizes buffers, so it is built once), traffic, compute, verdicts.
    ``memory``: also trace the Python heap of a construction (one more run)."""
    costs = costs or CostModel()
    placement = scenario.placement_of()
    student, teachers = scenario.layouts()
    sender = layout_rank(teachers[0], placement.teacher_offset_of(0), 0, 0, 0, teachers[0].pp - 1)
    ranks = ranks or sorted({0, sender})
    constructions = [construct(scenario, r) for r in ranks]
    peak = construct(scenario, ranks[0], memory=True).peak_bytes if memory else None
    per_rank = []
    for c in constructions:
        modelled = costs.construction(c.record, scenario.gpus)
        per_rank.append({"rank": c.rank, "cpu_s": round(c.seconds, 4),
                         "plan_s": round(c.plan_seconds, 4), **c.record.summary(), **modelled,
                         "construction_s": round(c.seconds + modelled["modelled_s"], 3)})
    construction_s = max(r["construction_s"] for r in per_rank)
    return [_step_report(replace(scenario, form=form), costs, constructions[0].routes, per_rank,
                         construction_s, peak)
            for form in (forms or (scenario.form,))]


def _step_report(scenario: Scenario, costs: CostModel, plans: list[list[Route]],
                 per_rank: list[dict], construction_s: float, peak: int | None) -> dict:
    placement = scenario.placement_of()
    student, teachers = scenario.layouts()
    traffic = step_traffic(scenario, plans)
    compute = compute_seconds(scenario, costs)
    node_out, node_in = traffic.node_totals()
    node_bytes = [max(o, i) for o, i in zip(node_out, node_in, strict=True)]
    busiest, mean = _busiest(traffic)
    alone, alone_mean = _busiest(step_traffic(scenario, one_sender_plans(scenario, plans)))
    transfer = busiest / costs.nic_bytes_per_s
    step_compute = compute["student_step_s"] + compute["teacher_forward_s"]
    if placement.disaggregated:  # teacher k+1 and its transfer overlap student step k
        period = max(compute["student_step_s"], compute["teacher_forward_s"])
        hides = transfer <= period
    else:  # synchronous exchange between the teacher forward and the student step
        period = step_compute + transfer
        hides = transfer <= costs.colocated_overhead * step_compute
    return {
        "scenario": {**asdict(scenario), "teachers": [asdict(t) for t in scenario.teachers]},
        "layouts": {"student": asdict(student), "teachers": [asdict(t) for t in teachers]},
        "global_batch_size": scenario.global_batch_size(),
        "payload_bytes_per_sample": [4 * scenario.payload_numel(t) for t in scenario.teachers],
        "routes": [len(p) for p in plans],
        "construction": per_rank,
        "construction_s": construction_s,
        "peak_python_heap_bytes": peak,
        "traffic": {
            "cross_node_bytes": sum(traffic.out_bytes),
            "same_node_bytes": traffic.same_node_bytes,
            "busiest_gpu_nic_bytes": busiest, "mean_gpu_nic_bytes": round(mean),
            "busiest_over_mean": round(busiest / mean, 2) if mean else None,
            "gpus_sending": sum(1 for b in traffic.out_bytes if b),
            "busiest_gpu_nic_bytes_one_sender": alone,
            "busiest_over_mean_one_sender": round(alone / alone_mean, 2) if alone_mean else None,
            "busiest_node_nic_bytes": max(node_bytes),
            "mean_node_nic_bytes": round(sum(node_bytes) / len(node_bytes)),
        },
        "transfer_s": transfer,
        "transfer_node_spread_s": max(node_bytes) / (costs.nic_bytes_per_s
                                                     * scenario.gpus_per_node),
        **compute,
        "period_s": period,
        "hides": hides,
        "constructs_under_10s": construction_s < 10.0,
    }
