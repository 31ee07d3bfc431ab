"""Training checkpoints: model, optimizer, scheduler, RNG and data position, written atomically.

Layout follows Megatron-LM: ``<save>/iter_0000100/`` (a dist_checkpointing directory, loadable at
another layout) and ``<save>/latest_checkpointed_iteration.txt``. A checkpoint is written into
``iter_0000100.tmp`` and renamed only after every rank finished, then the tracker file is
replaced atomically: an interrupted save never looks like a checkpoint, and the previous one
stays the latest.

The common state also carries what Megatron-LM's loader reads: ``args`` (Megatron-LM's names for
the student's architecture and layout, ``models.megatron_lm.megatron_lm_args``),
``checkpoint_version``, ``iteration``, the LR schedule as ``opt_param_scheduler`` and the RNG as
``rng_state`` (Megatron-LM's sharded layout), so a distilled student continues in Megatron-LM or
Megatron-Bridge without conversion. This trainer resumes its RNG from per-rank files beside them.

With a disaggregated teacher only the student ranks hold checkpointed state. Saving is still
collective over the whole world (dist_checkpointing's save is), so teacher ranks join it with
``model=None`` and contribute nothing; loading runs on the student ranks' group alone.
"""

from __future__ import annotations

import os
import re
import shutil
import time

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing

from megatron_xdistill.models.megatron_lm import CHECKPOINT_VERSION
from megatron_xdistill.models.model_checkpoint import (
    TRACKER_FILE,
    iteration_dir,
    tracked_iteration,
    write_collectively,
)
from megatron_xdistill.storage import write_text_atomic
from megatron_xdistill.training.resume_schedule import scheduler_state


def latest_iteration(root: str) -> int | None:
    """Iteration of the latest complete checkpoint under ``root``, or None."""
    iteration = tracked_iteration(root)
    if iteration is not None and not os.path.isdir(iteration_dir(root, iteration)):
        raise FileNotFoundError(
            f"{os.path.join(root, TRACKER_FILE)} names iteration {iteration} but "
            f"{iteration_dir(root, iteration)} is missing")
    return iteration


def read_common_state(root: str) -> dict:
    """Not collective: the common state of the latest checkpoint under the training root
    ``root`` (the position, schedule and args every rank agrees on)."""
    iteration = latest_iteration(root)
    if iteration is None:
        raise FileNotFoundError(f"no training checkpoint under {root} (no {TRACKER_FILE})")
    return dist_checkpointing.load_common_state_dict(iteration_dir(root, iteration))


def is_training_checkpoint(path: str) -> bool:
    """Whether ``path`` is a training run's root: its tracker names an iteration (a ``release``
    tracker names a released model, which is loaded, not resumed)."""
    return tracked_iteration(path) is not None


def written_by_this_trainer(root: str) -> bool:
    """Whether the latest checkpoint under the training root ``root`` is one of ours (its
    common state holds our run's position), not another Megatron-LM run's."""
    state = read_common_state(root)
    return isinstance(state, dict) and "common" in state


def _rng_state() -> dict:
    import random

    import numpy as np

    return {"python": random.getstate(), "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}


def megatron_lm_rng_state(model, dp_cp_group) -> object:
    """This rank's RNG as Megatron-LM's torch_dist checkpoints hold it: ``rng_state``, one list
    (of this rank's state dict) per (PP, TP) coordinate, replicated over DP x CP, with
    Megatron-LM's key names, so its ``--load`` restores it. A CPU run has no CUDA state to
    write: Megatron-LM then needs ``--no-load-rng``."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    ours = _rng_state()
    state = {"random_rng_state": ours["python"], "np_rng_state": ours["numpy"],
             "torch_rng_state": ours["torch"],
             "rng_tracker_states": get_cuda_rng_tracker().get_states()}
    if ours["cuda"] is not None:
        state["cuda_rng_state"] = ours["cuda"]
    tp, pp = model.pg_collection.tp, model.pg_collection.pp
    return ShardedObject("rng_state", [state], (pp.size(), tp.size()), (pp.rank(), tp.rank()),
                         replica_id=dist.get_rank(dp_cp_group))


def _set_rng_state(state: dict) -> None:
    import random

    import numpy as np

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


_SHARED_KEYS = ("common", "iteration")


def _shared_common(state: dict) -> dict:
    """The common-state keys every rank has, stateless ranks included (consistency check)."""
    return {key: state[key] for key in _SHARED_KEYS if key in state}


# The distributed optimizer's state in model space (gathered over DP at save): a run resumes it
# in any layout (Megatron-Core's default format cannot be saved with this version's checkpointing).
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def _pause_for_fault_tests() -> None:
    """``XDISTILL_FAULT_SAVE_PAUSE_S``: hold a save between its writes and its rename that long,
    so tests/test_faults.py kills a rank while a save is surely in flight (unset: no pause)."""
    pause = float(os.environ.get("XDISTILL_FAULT_SAVE_PAUSE_S", "0") or 0)
    if pause > 0:
        time.sleep(pause)


def prune_checkpoints(root: str, keep_last: int) -> list[str]:
    """Remove all but the newest ``keep_last`` iteration folders under ``root`` (never the one
    the tracker names, nor a ``.tmp`` being written); returns the removed paths. Each goes
    aside (``.removing``) before it is deleted, so a half-deleted folder never looks like a
    checkpoint."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    tracked = tracked_iteration(root)
    found = sorted((int(m.group(1)), m.group(0)) for m in
                   (re.fullmatch(r"iter_(\d{7,})", name) for name in os.listdir(root)) if m)
    removed = []
    for iteration, name in found[:-keep_last]:
        if iteration == tracked:
            continue
        path = os.path.join(root, name)
        aside = path + ".removing"
        os.replace(path, aside)
        shutil.rmtree(aside)
        removed.append(path)
    return removed


def save_checkpoint(root: str, iteration: int, model, optimizer, scheduler, dp_cp_group,
                    common: dict, partial_world: bool = False,
                    megatron_args: object | None = None, keep_last: int | None = None) -> str:
    """Collective over the world: write the checkpoint of ``iteration`` under ``root``; returns
    its path.

    ``common`` holds small picklable state every rank agrees on (consumed samples, args...).
    ``partial_world``: some ranks hold no part of the model (disaggregated teacher ranks); those
    call with ``model=None`` and write nothing, and every rank must pass True.
    ``megatron_args``: Megatron-LM's ``args`` for the model (stored for Megatron-LM's tools).
    ``keep_last``: once the tracker names the new one, rank 0 removes all but the newest that
    many (``--keep-last-checkpoints``; None keeps every one, as Megatron-LM does).
    """
    final = iteration_dir(root, iteration)

    def write(tmp: str) -> None:
        state = {"common": common, "iteration": iteration,
                 "checkpoint_version": CHECKPOINT_VERSION}
        if megatron_args is not None:
            state["args"] = megatron_args
        if model is not None:
            model_state = model.sharded_state_dict(metadata={"dp_cp_group": dp_cp_group})
            state = {"model": model_state, **state}
            if optimizer is not None:
                state["optimizer"] = optimizer.sharded_state_dict(model_state,
                                                                  metadata=OPTIMIZER_METADATA)
            if scheduler is not None:  # Megatron-LM's key
                state["opt_param_scheduler"] = scheduler.state_dict()
            state["rng_state"] = megatron_lm_rng_state(model, dp_cp_group)
        dist_checkpointing.save(
            state, tmp, preprocess_common_before_consistancy_check=_shared_common
            if partial_world else None)
        if model is not None:
            torch.save(_rng_state(), os.path.join(tmp, f"rng_rank{dist.get_rank():05d}.pt"))
        _pause_for_fault_tests()

    def commit() -> None:  # the tracker names the new iteration only once it is complete
        write_text_atomic(os.path.join(root, TRACKER_FILE), str(iteration))
        if keep_last is not None:
            for path in prune_checkpoints(root, keep_last):
                print(f"> removed {path} (--keep-last-checkpoints {keep_last})", flush=True)

    write_collectively(final, write, replace=True, after_commit=commit)
    return final


def load_checkpoint(root: str, model, optimizer, scheduler, dp_cp_group,
                    process_group: dist.ProcessGroup | None = None,
                    load_rng: bool = True) -> dict:
    """Collective over ``process_group`` (the ranks holding the model; default the world):
    restore the latest checkpoint under ``root``; returns its ``common`` state plus
    ``iteration``. Raises if there is none. ``optimizer=None`` / ``scheduler=None`` /
    ``load_rng=False`` leave those as they are (Megatron-LM's ``--no-load-optim``,
    ``--no-load-rng``)."""
    iteration = latest_iteration(root)
    if iteration is None:
        raise FileNotFoundError(f"no training checkpoint under {root} (no {TRACKER_FILE})")
    path = iteration_dir(root, iteration)
    model_state = model.sharded_state_dict(metadata={"dp_cp_group": dp_cp_group})
    request = {"model": model_state}
    if optimizer is not None:
        _create_optimizer_state(optimizer)
        request["optimizer"] = optimizer.sharded_state_dict(model_state, is_loading=True,
                                                            metadata=OPTIMIZER_METADATA)
    loaded = dist_checkpointing.load(request, path, process_group=process_group)
    model.load_state_dict(loaded["model"])
    if optimizer is not None:
        optimizer.load_state_dict(loaded["optimizer"])
    common_state = dist_checkpointing.load_common_state_dict(path)
    schedule = scheduler_state(common_state)
    if scheduler is not None and schedule is not None:
        # Only the step count: the scheduler's values were reconciled with the checkpoint's
        # before it was built (resume_schedule), and it overrides the state's with them.
        scheduler.load_state_dict(schedule)
    rng_path = os.path.join(path, f"rng_rank{dist.get_rank():05d}.pt")
    if load_rng and os.path.exists(rng_path):
        _set_rng_state(torch.load(rng_path, weights_only=False))
    return _position(common_state, iteration)


def _create_optimizer_state(optimizer) -> None:
    """Megatron-Core's distributed optimizer lists its state (Adam's step) before loading into
    it, which a fresh run does not have yet without TE/Apex: one zero-gradient step creates it.
    That step runs at lr 0 and weight decay 0, so it changes no parameter (its main copies of the
    parameters are not all overwritten by the load)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(part, DistributedOptimizer) and not part.optimizer.state:
            groups = part.optimizer.param_groups
            kept = [(g["lr"], g["weight_decay"]) for g in groups]
            for g in groups:
                g["lr"], g["weight_decay"] = 0.0, 0.0
            try:
                part._init_optimizer_states_with_dummy_values()
            finally:
                for g, (lr, wd) in zip(groups, kept):
                    g["lr"], g["weight_decay"] = lr, wd


def _position(common_state: dict, iteration: int) -> dict:
    out = dict(common_state.get("common", {}))
    out["iteration"] = int(common_state.get("iteration", iteration))
    return out


def load_position(root: str) -> dict:
    """Not collective: the ``common`` state and ``iteration`` of the latest checkpoint under
    ``root`` (what ranks that hold no model part, e.g. disaggregated teacher ranks, need)."""
    iteration = latest_iteration(root)
    if iteration is None:
        raise FileNotFoundError(f"no training checkpoint under {root} (no {TRACKER_FILE})")
    return _position(dist_checkpointing.load_common_state_dict(iteration_dir(root, iteration)),
                     iteration)
