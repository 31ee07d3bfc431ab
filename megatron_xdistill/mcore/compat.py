"""Run Megatron-Core on machines without CUDA (CPU + gloo); a no-op when CUDA is present.

Megatron-Core assumes a CUDA device in many places that are not about GPU compute: RNG state
tracking, ``torch.cuda.current_device()`` as an allocation target, streams and events around
communication, ``device="cuda"`` buffers in the pipeline schedules, and one Triton-only import.
Every workaround lives here, each with one line naming the Megatron code path it covers, so the
rest of the project (and its tests) can use ``megatron.core`` exactly as on a GPU machine.

One fix here applies on GPUs too: Megatron-Core 0.19 still reads the global parallel_state in
one checkpoint path of models built from a ``pg_collection`` (see
:func:`_patch_tied_embedding_checkpoint`); the student and the teacher never share that state.
And without TE/Apex its distributed optimizer cannot load its own fully reshardable checkpoint
into torch's Adam (:func:`_patch_distributed_optimizer_step_state`). Its checkpoint writer starts
a process per rank that a killed rank leaves behind (:func:`_in_process_write_results_queue`).

Entry points call :func:`install` once at start-up (``pretrain_xdistill.py``, the CLIs, the test
suite's configuration, the benchmarks), before any model is built; importing this package changes
nothing in torch or Megatron. Only what ``import megatron.core`` itself needs on a machine without
Triton is done when the package is imported (:mod:`megatron_xdistill.mcore.importable`).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from megatron_xdistill.mcore.importable import make_megatron_importable

_INSTALLED = False
_CUDA_MODE: _CudaToCpuMode | None = None


def cuda_available() -> bool:
    """True when a CUDA device is usable; then nothing in this module changes anything."""
    return torch.cuda.is_available()


def _cpu_if_cuda(device: Any) -> Any:
    """Map a CUDA device spec (``"cuda"``, ``"cuda:0"``, ``0``-as-cuda, torch.device) to CPU."""
    if isinstance(device, torch.device):
        return torch.device("cpu") if device.type == "cuda" else device
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    return device


class _CudaToCpuMode(TorchFunctionMode):
    """Redirects tensor creation/moves aimed at CUDA to the CPU.

    Covers: ``torch.empty(..., device="cuda")`` in pipeline_parallel.schedules / p2p_communication,
    ``tensor.cuda()`` in optimizer/clip_grads and dist_checkpointing, ``.to("cuda")`` everywhere.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # Covers: optimizer.clip_grads / optimizer / distrib_optimizer, which compare
            # `param.type()` with 'torch.cuda.FloatTensor' and friends.
            name = func(*args)
            return "torch.cuda." + name[len("torch.") :] if name.count(".") == 1 else name
        if func is torch.Tensor.cuda:
            tensor = args[0]
            non_blocking = kwargs.get("non_blocking", False)
            return tensor.to("cpu", non_blocking=non_blocking)
        if kwargs.get("pin_memory"):
            # Covers: rope_utils.get_pos_emb_on_this_cp_rank (`torch.tensor(..., pin_memory=True)`).
            kwargs["pin_memory"] = False
        if "device" in kwargs:
            kwargs["device"] = _cpu_if_cuda(kwargs["device"])
        if func in (torch.Tensor.to,) and len(args) > 1:
            args = (args[0], _cpu_if_cuda(args[1]), *args[2:])
        return func(*args, **kwargs)


class _NullStream:
    """Stand-in for ``torch.cuda.Stream``: work on CPU is already ordered.

    Covers: distributed/param_and_grad_buffer, pipeline_parallel schedules and p2p overlap streams.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event: Any = None) -> _NullEvent:
        return event if event is not None else _NullEvent()

    def query(self) -> bool:
        return True

    def __enter__(self) -> _NullStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


class _NullEvent:
    """Stand-in for ``torch.cuda.Event``; ``elapsed_time`` is 0 (timers use wall clock on CPU).

    Covers: megatron.core.timers, pipeline_parallel utils, distributed overlap bookkeeping.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Any) -> float:
        return 0.0


def _patch_torch_cuda() -> None:
    """Replace CUDA runtime queries that Megatron makes outside of compute with CPU answers."""
    cuda = torch.cuda
    # Covers: tensor_parallel layers, embeddings, grad buffers, schedules (`device=current_device()`).
    cuda.current_device = lambda: torch.device("cpu")
    # Covers: timers, finalize_model_grads, dist_checkpointing and optimizer `synchronize()` calls.
    cuda.synchronize = lambda device=None: None
    # Covers: param_and_grad_buffer / schedules / p2p communication streams and events.
    cuda.Stream = _NullStream
    cuda.Event = _NullEvent
    cuda.current_stream = lambda device=None: _NullStream()
    cuda.default_stream = lambda device=None: _NullStream()
    cuda.stream = lambda stream=None: contextlib.nullcontext()
    cuda.set_stream = lambda stream: None
    # Covers: training utilities that free cached memory.
    cuda.empty_cache = lambda: None
    # Covers: parallel_state.initialize_model_parallel -> `torch.cuda.set_device`-free paths.
    cuda.set_device = lambda device: None
    # Covers: tensor_parallel.random.model_parallel_cuda_manual_seed (`torch.cuda.manual_seed`).
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    # Covers: optimizer.clip_grads and distrib_optimizer type checks (`torch.cuda.FloatTensor`).
    cuda.FloatTensor = torch.FloatTensor
    cuda.HalfTensor = torch.HalfTensor
    cuda.BFloat16Tensor = torch.BFloat16Tensor
    cuda.IntTensor = torch.IntTensor
    cuda.LongTensor = torch.LongTensor
    # Covers: memory reporting in timers / logging.
    cuda.memory_stats = lambda device=None: {}
    cuda.max_memory_allocated = lambda device=None: 0
    cuda.memory_allocated = lambda device=None: 0


def _patch_rng_tracker() -> None:
    """Covers: tensor_parallel.random.CudaRNGStatesTracker (dropout / init forks) using the CPU
    generator in place of ``torch.cuda`` RNG state."""
    from megatron.core.tensor_parallel import random as mrandom

    def _get_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False):
        state = torch.get_rng_state()
        return state.clone() if clone else state

    def _set_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
        torch.set_rng_state(new_state)

    mrandom._get_cuda_rng_state = _get_state
    mrandom._set_cuda_rng_state = _set_state

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """The CUDA tracker's bookkeeping on the CPU generator."""

        def add(self, name: str, seed: int) -> None:
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

    mrandom.CudaRNGStatesTracker = CpuRNGStatesTracker
    mrandom.initialize_rng_tracker(force_reset=True)


def _patch_moe_split_sizes() -> None:
    """Covers: moe.token_dispatcher.MoEAlltoAllTokenDispatcher, whose all-to-all split sizes
    become numpy arrays only when they come from a CUDA tensor (``maybe_move_tensor_to_cpu``);
    on the CPU they stayed tensors, which gloo's ``all_to_all_single`` refuses."""
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    original = moe_utils.maybe_move_tensor_to_cpu

    def to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    moe_utils.maybe_move_tensor_to_cpu = to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = to_cpu


class _ParallelStateWithGroupRank:
    """parallel_state look-alike answering the DP x CP rank from an explicit group."""

    def __init__(self, real: Any, dp_cp_group: Any) -> None:
        self._real = real
        self._group = dp_cp_group

    def get_data_parallel_rank(self, *args: Any, **kwargs: Any) -> int:
        return self._group.rank()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def _patch_tied_embedding_checkpoint() -> None:
    """Covers: LanguageModule.tie_embeddings_and_output_weights_state_dict (PP > 1, tied
    embeddings), which asks the global parallel_state for the DP x CP rank even when the model was
    built from a pg_collection; with process-group collections it uses ``metadata['dp_cp_group']``.
    Needed on GPUs too (not a CPU workaround)."""
    from megatron.core.models.common.language_module import language_module as lm

    original = lm.LanguageModule.tie_embeddings_and_output_weights_state_dict
    if getattr(original, "_xdistill_patched", False):
        return

    def tie(self, sharded_state_dict, output_layer_weight_key, first_stage_word_emb_key,
            metadata=None):
        metadata = metadata or {}
        group = metadata.get("dp_cp_group")
        if group is None:
            return original(self, sharded_state_dict, output_layer_weight_key,
                            first_stage_word_emb_key, metadata)
        real = lm.parallel_state
        lm.parallel_state = _ParallelStateWithGroupRank(real, group)
        try:
            return original(self, sharded_state_dict, output_layer_weight_key,
                            first_stage_word_emb_key, metadata)
        finally:
            lm.parallel_state = real

    tie._xdistill_patched = True
    lm.LanguageModule.tie_embeddings_and_output_weights_state_dict = tie


class _SkipAbsent(dict):
    """A state dict in which a key the checkpoint does not hold reads as "nothing to copy"."""

    def __missing__(self, key: str) -> None:
        return None


def _patch_distributed_optimizer_step_state() -> None:
    """Covers: DistributedOptimizer.load_state_dict with torch's Adam (no TE/Apex, also on GPUs).
    Megatron gives every parameter's state one shared ``step`` tensor, which torch's Adam then
    increments once per parameter (step 1 resumes as step 1 + number of parameters: wrong bias
    correction); each parameter gets its own copy. And the fully reshardable load copies a
    per-parameter ``step`` from the checkpoint, where it is not (Megatron restores it from the
    param groups); absent keys are skipped."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    set_states = DistributedOptimizer._set_main_param_and_optimizer_states
    if getattr(set_states, "_xdistill_patched", False):
        return
    load = DistributedOptimizer.load_state_dict

    def set_main_param_and_optimizer_states(self, model_param, tensors):
        return set_states(self, model_param, _SkipAbsent(tensors))

    def load_state_dict(self, state_dict):
        result = load(self, state_dict)
        for state in self.optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()
        return result

    set_main_param_and_optimizer_states._xdistill_patched = True
    DistributedOptimizer._set_main_param_and_optimizer_states = set_main_param_and_optimizer_states
    DistributedOptimizer.load_state_dict = load_state_dict


def _in_process_write_results_queue() -> None:
    """Covers: dist_checkpointing.save (torch_dist, also on GPUs): its writer collects the
    writer threads' results through ``filesystem_async.get_write_results_queue``, a queue served
    by a multiprocessing Manager, i.e. a server process per rank. That process outlives a rank
    killed by SIGKILL, keeps the job's stdout open (the launcher's pipe never closes) and never
    exits. Our saves are synchronous (the writers are threads of the saving process), so an
    in-process queue serves them; an async save (not used here) would need the Manager."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", False) is None:
        filesystem_async._results_queue = queue.Queue()


def install() -> None:
    """Install all CPU workarounds (idempotent). Does nothing when CUDA is available."""
    global _INSTALLED, _CUDA_MODE
    if _INSTALLED:
        return
    _INSTALLED = True
    make_megatron_importable()
    _patch_tied_embedding_checkpoint()
    _patch_distributed_optimizer_step_state()
    _in_process_write_results_queue()
    if cuda_available():
        return
    _patch_torch_cuda()
    _patch_rng_tracker()
    _patch_moe_split_sizes()
    _CUDA_MODE = _CudaToCpuMode()
    _CUDA_MODE.__enter__()


def require_installed(what: str) -> None:
    """Raise, naming ``what``, unless :func:`install` ran in this process: without it Megatron
    would fail on a CPU deep inside (or, on GPUs, save and resume some states wrongly)."""
    if not _INSTALLED:
        raise RuntimeError(
            f"{what} needs megatron_xdistill.mcore.compat.install() first (it adapts "
            f"Megatron-Core to this machine; pretrain_xdistill.py, xdistill-convert, "
            f"xdistill-evaluate and the test suite call it at start-up): call it once before "
            f"using megatron_xdistill's models or runtime from your own code")


def default_backend() -> str:
    """torch.distributed backend for this machine: nccl with CUDA, gloo otherwise."""
    return "nccl" if cuda_available() else "gloo"
