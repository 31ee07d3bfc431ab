"""Run one training job as Ray actors: placement, ranks, log streaming, failures, restarts."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TextIO

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import (
    NodeAffinitySchedulingStrategy,
    PlacementGroupSchedulingStrategy,
)

from megatron_xdistill.launch.config import LaunchConfig
from megatron_xdistill.launch.rank_env import (
    LAUNCH_ID_VAR,
    RankSpec,
    assign_ranks,
    parse_entry_point,
    rank_env,
    visible_devices,
)
from megatron_xdistill.launch.worker import LogSink, RankWorker, reap

PREFIX = "xdistill-ray:"


class LaunchError(RuntimeError):
    """The job could not be placed or started."""


class _StartFailure(Exception):
    def __init__(self, failure: Failure) -> None:
        super().__init__(failure.message)
        self.failure = failure


@dataclass
class Failure:
    """Why a rank did not finish with exit code 0."""

    rank: int
    code: int
    message: str
    kind: str  # "died" (the actor's process is gone), "error", or "collective"
    time: float

    def order(self) -> tuple[int, float]:
        """A dead process or a plain error is the likeliest cause; peers' comm errors follow."""
        return ({"died": 0, "error": 1, "collective": 2}[self.kind], self.time)


def launch(config: LaunchConfig, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Run the job on the connected Ray cluster; returns the exit status.

    0 when every rank returned 0, else the first failing rank's code once ``max_restarts``
    restarts are used up. Actors, their child processes and the placement groups are gone when
    this returns or raises (KeyboardInterrupt included).
    """
    parse_entry_point(config.entry_point)
    printer = _Printer(out or sys.stdout, err or sys.stderr)
    groups = _create_placement_groups(config)
    sink = None
    try:
        _wait_placement(groups, config)
        sink = ray.remote(LogSink).options(
            name=f"xdistill-{config.launch_id}-logs", num_cpus=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(
                ray.get_runtime_context().get_node_id(), soft=True)).remote()
        for attempt in range(config.max_restarts + 1):
            failure = _Attempt(config, groups, sink, attempt, printer).run()
            if failure is None:
                return 0
            if attempt == config.max_restarts:
                return failure.code
            printer.note(f"restarting ({attempt + 1}/{config.max_restarts}); the entry point "
                         f"resumes from its latest checkpoint")
            _wait_placement(groups, config)
        raise AssertionError("unreachable")
    finally:
        with _signals_deferred():
            if sink is not None:
                ray.kill(sink)
            for group in groups:
                remove_placement_group(group)


class _Printer:
    def __init__(self, out: TextIO, err: TextIO) -> None:
        self.out, self.err = out, err

    def lines(self, items: list[tuple[int, str, str]]) -> None:
        for rank, stream, line in items:
            print(f"[rank {rank}] {line}", file=self.out if stream == "stdout" else self.err)
        self.out.flush()
        self.err.flush()

    def note(self, message: str) -> None:
        print(f"{PREFIX} {message}", file=self.err, flush=True)


def _create_placement_groups(config: LaunchConfig) -> list[PlacementGroup]:
    """One STRICT_PACK placement group per node, one bundle per rank (per GPU)."""
    bundle: dict[str, float] = {}
    if config.cpus_per_rank > 0:
        bundle["CPU"] = config.cpus_per_rank
    if config.gpus_per_rank > 0:
        bundle["GPU"] = config.gpus_per_rank
    if not bundle:
        raise LaunchError("each rank needs a CPU or a GPU (--cpus-per-rank > 0)")
    return [placement_group([dict(bundle)] * config.ranks_per_node, strategy="STRICT_PACK",
                            name=f"xdistill-{config.launch_id}-node{g}")
            for g in range(config.num_nodes)]


def _wait_placement(groups: list[PlacementGroup], config: LaunchConfig) -> None:
    ready, _ = ray.wait([g.ready() for g in groups], num_returns=len(groups),
                        timeout=config.placement_timeout_s)
    if len(ready) < len(groups):
        bundle = groups[0].bundle_specs[0]
        raise LaunchError(
            f"{len(groups) - len(ready)} of {len(groups)} nodes not placed after "
            f"{config.placement_timeout_s:.0f}s: each needs {config.ranks_per_node} x {bundle} "
            f"on one node; cluster has {ray.cluster_resources()}, "
            f"free {ray.available_resources()}")


def _group_nodes(groups: list[PlacementGroup]) -> list[str]:
    """The Ray node id each placement group (each STRICT_PACK group sits on one node) uses."""
    nodes = []
    for group in groups:
        table = placement_group_table(group).get("bundles_to_node_id", {})
        nodes.extend(set(table.values()))
    return nodes


class _Attempt:
    """One try at the job: fresh actors in the (kept) placement groups."""

    def __init__(self, config: LaunchConfig, groups: list[PlacementGroup], sink: Any,
                 attempt: int, printer: _Printer) -> None:
        self.config, self.groups, self.sink = config, groups, sink
        self.attempt, self.printer = attempt, printer
        self.specs = assign_ranks(config.num_nodes, config.ranks_per_node)
        self.where: dict[int, str] = {}  # rank -> "node g, ip, pid p" for messages
        self._take: Any = None  # the pending LogSink.take call
        self._nodes: set[str] = set()  # Ray nodes the actors reported

    def run(self) -> Failure | None:
        actors = [self._create(spec) for spec in self.specs]
        try:
            try:
                envs = self._environments(actors)
            except _StartFailure as exc:
                return self._report([exc.failure])
            refs = {actors[spec.rank].run.remote(self.config.entry_point,
                                                 self.config.entry_args, envs[spec.rank],
                                                 self.config.working_dir): spec.rank
                    for spec in self.specs}
            return self._watch(refs)
        finally:
            with _signals_deferred():
                self._drain(quiet_s=1.0, limit_s=3.0)  # after an interrupt: the last lines
                self._stop(actors)

    def _create(self, spec: RankSpec) -> Any:
        env = {**self.config.env, LAUNCH_ID_VAR: self.config.launch_id}
        return ray.remote(RankWorker).options(
            name=self.config.actor_name(spec.rank),
            num_cpus=self.config.cpus_per_rank, num_gpus=self.config.gpus_per_rank,
            max_restarts=0, runtime_env={"env_vars": env},
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self.groups[spec.group_rank],
                placement_group_bundle_index=spec.local_rank),
        ).remote(spec.rank, self.sink)

    def _environments(self, actors: list[Any]) -> dict[int, dict[str, str]]:
        """Ask every actor where it landed; build each rank's torchrun environment."""
        timeout = self.config.startup_timeout_s
        end = time.monotonic() + timeout
        infos = []
        for spec, actor in zip(self.specs, actors):
            try:
                infos.append(ray.get(actor.info.remote(),
                                     timeout=max(1.0, end - time.monotonic())))
            except GetTimeoutError as exc:
                raise LaunchError(f"rank {spec.rank}'s actor did not start within "
                                  f"{timeout:.0f}s") from exc
            except RayActorError as exc:
                raise _StartFailure(Failure(spec.rank, 1, "its actor failed to start: "
                                            f"{_death_reason(exc)}", "died", time.time())) from exc
        addresses = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        by_group: dict[int, list[dict[str, Any]]] = {}
        for spec, info in zip(self.specs, infos):
            self._nodes.add(info["node_id"])
            by_group.setdefault(spec.group_rank, []).append(info)
            self.where[spec.rank] = (f"node {spec.group_rank}, "
                                     f"{addresses.get(info['node_id'], '?')}, pid {info['pid']}")
        nodes = []
        for g, members in sorted(by_group.items()):
            node_ids = {m["node_id"] for m in members}
            if len(node_ids) != 1:  # STRICT_PACK promises one node per group
                raise LaunchError(f"node {g}'s ranks landed on several Ray nodes: {node_ids}")
            nodes.append(node_ids.pop())
        if len(set(nodes)) < len(nodes):
            self.printer.note("warning: some placement groups share a Ray node (nodes with more "
                              "free resources than one node's ranks need); ranks still run, "
                              "with one torchrun-style group per placement group")
        master_addr = addresses[nodes[0]]
        master_port = self.config.master_port or ray.get(actors[0].free_port.remote(),
                                                         timeout=timeout)
        self._describe(by_group, nodes, addresses, master_addr, master_port)
        envs = {}
        for spec in self.specs:
            env = rank_env(spec, master_addr, master_port, self.attempt, self.config.max_restarts)
            devices = visible_devices([m["gpu_ids"] for m in by_group[spec.group_rank]])
            if devices is not None:
                env["CUDA_VISIBLE_DEVICES"] = devices
            envs[spec.rank] = env
        return envs

    def _describe(self, by_group: dict[int, list[dict[str, Any]]], nodes: list[str],
                  addresses: dict[str, str], master_addr: str, master_port: int) -> None:
        cfg = self.config
        self.printer.note(f"attempt {self.attempt + 1}/{cfg.max_restarts + 1}: "
                          f"{cfg.num_nodes * cfg.ranks_per_node} ranks on {cfg.num_nodes} nodes, "
                          f"master {master_addr}:{master_port}, entry {cfg.entry_point}")
        for g, node in enumerate(nodes):
            first = g * cfg.ranks_per_node
            gpus = ",".join(gpu for m in by_group[g] for gpu in m["gpu_ids"]) or "none"
            self.printer.note(f"  node {g}: ranks {first}-{first + cfg.ranks_per_node - 1} on "
                              f"{addresses.get(node, '?')} (ray node {node[:12]}), GPUs {gpus}")

    def _watch(self, refs: dict[Any, int]) -> Failure | None:
        """Stream logs until every rank ended, or a rank failed (plus a grace period)."""
        running = dict(refs)
        failures: list[Failure] = []
        deadline = None
        self._take = self.sink.take.remote(0.5)
        while running and (deadline is None or time.monotonic() < deadline):
            if INTERRUPTED.is_set():  # a Ctrl-C whose KeyboardInterrupt a library swallowed
                raise KeyboardInterrupt
            ready, _ = ray.wait([self._take, *running], num_returns=1, timeout=0.5)
            for ref in ready:
                if ref == self._take:
                    self.printer.lines(ray.get(ref))
                    self._take = self.sink.take.remote(0.5)
                    continue
                failure = self._outcome(ref, running.pop(ref))
                if failure is not None:
                    failures.append(failure)
                    deadline = deadline or time.monotonic() + self.config.failure_grace_s
        self._drain()
        return self._report(failures)

    def _report(self, failures: list[Failure]) -> Failure | None:
        """Say which rank failed first (and who else did); None when nothing failed."""
        if not failures:
            return None
        failures.sort(key=Failure.order)
        first = failures[0]
        self.printer.note(f"rank {first.rank} failed ({self.where.get(first.rank, '?')}) with "
                          f"exit code {first.code}: {first.message}")
        for other in failures[1:]:
            self.printer.note(f"also failed: rank {other.rank} ({other.kind}): "
                              f"{other.message.splitlines()[-1][:200]}")
        self.printer.note(f"stopping all {len(self.specs)} ranks")
        return first

    def _outcome(self, ref: Any, rank: int) -> Failure | None:
        try:
            result = ray.get(ref)
        except RayActorError as exc:
            return Failure(rank, 1, f"its actor died: {_death_reason(exc)}", "died", time.time())
        except RayError as exc:  # the actor method itself broke (not the entry point)
            return Failure(rank, 1, str(exc), "error", time.time())
        if result["code"] == 0:
            return None
        message = (result["error"] or "").rstrip() or "returned a non-zero exit code"
        return Failure(rank, result["code"], message,
                       "collective" if result["collective"] else "error", result["time"])

    def _drain(self, quiet_s: float = 0.2, limit_s: float = 2.0) -> None:
        """Print what is still in flight to the sink: until no line came for ``quiet_s`` (lines
        that ranks printed just before an interrupt are still on their way), at most ``limit_s``."""
        end = time.monotonic() + limit_s
        quiet_until = time.monotonic() + quiet_s  # a take made earlier may have come back empty
        while self._take is not None:
            try:
                items = ray.get(self._take, timeout=max(0.1, end - time.monotonic()))
            except GetTimeoutError:
                return
            self.printer.lines(items)
            now = time.monotonic()
            if items:
                quiet_until = now + quiet_s
            wait = min(quiet_until, end) - now
            self._take = self.sink.take.remote(wait) if wait > 0 else None

    def _stop(self, actors: list[Any]) -> None:
        """Kill the actors, then every process they started, on every node of the job."""
        for actor in actors:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        reaper = ray.remote(reap)
        refs = [reaper.options(num_cpus=0, max_retries=0,
                               scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
                .remote(self.config.launch_id)
                for node in self._nodes | set(_group_nodes(self.groups))]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.config.stop_timeout_s)
        for ref in ready:
            with contextlib.suppress(Exception):
                ray.get(ref)
        if len(ready) < len(refs):
            self.printer.note(f"warning: {len(refs) - len(ready)} node(s) did not confirm that "
                              f"launch {self.config.launch_id}'s processes are gone")


def _death_reason(exc: RayActorError) -> str:
    """The informative part of Ray's actor-death message."""
    text = str(exc)
    lines = text.splitlines() or [type(exc).__name__]
    line = next((x for x in lines if "dead because" in x), lines[0]).strip()
    return line.split(" Some common causes include")[0]


#: Set by the command line's SIGINT handler, so an interrupt is acted on even when the
#: KeyboardInterrupt it raised was caught inside a library call (checked every 0.5 s).
INTERRUPTED = threading.Event()


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """Hold SIGINT/SIGTERM while cleaning up; a signal that came meanwhile is acted on after.

    A second Ctrl-C must not cut the cleanup short and leave actors or processes behind.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, _frame: received.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if received:
            handler = previous[received[0]]
            if callable(handler):
                handler(received[0], None)
            elif handler == signal.SIG_DFL:
                os.kill(os.getpid(), received[0])
