"""Model checkpoints: a Megatron-LM release root plus ``xdistill_model.json``.

A saved model is laid out as Megatron-LM lays out a released model, so its ``--load`` takes it
as it is: ``<dir>/latest_checkpointed_iteration.txt`` naming ``release`` and ``<dir>/release/``
holding the dist_checkpointing (torch_dist) tensors with Megatron-LM's ``args`` in their common
state. Folders written before this layout (the tensors directly in ``<dir>``) still load.

The JSON holds the :class:`ModelInfo` the weights belong to, so ``--load`` needs no architecture
flags, and the tensors load at any TP/PP (dist_checkpointing reshards; padded vocab rows load with
``allow_shape_mismatch``). Writes go to ``<dir>.tmp`` and are renamed only after every rank has
finished, so an interrupted write never leaves a directory that looks complete.

Megatron-LM training checkpoints (``<root>/latest_checkpointed_iteration.txt`` naming ``iter_N/``
or ``release/``) are accepted wherever a checkpoint directory is: the tracked folder is read, and
the model info is found next to it or at the root, or else read from the Megatron-LM run's
``args`` in its common state (:mod:`.megatron_lm`: checkpoints of Megatron-LM and
Megatron-Bridge load as the student or the teacher without conversion).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.validation import StrictHandling
from megatron.core.process_groups_config import ProcessGroupCollection
from torch.distributed.checkpoint.api import CheckpointException as TorchCheckpointException

from megatron_xdistill.models.description import (  # noqa: F401 - this module's API too
    FORMAT,
    FORMAT_VERSION,
    MODEL_INFO_FILE,
    VOCAB_SLACK,
    CheckpointError,
    _first_cause,
    _info_path,
    check_tokenizer_fits,
    iteration_dir,
    load_model_info,
    read_model_json,
    resolve_checkpoint_dir,
    save_model_info,
    tracked_iteration,
)
from megatron_xdistill.models.hf_config import ModelInfo
from megatron_xdistill.models.megatron_lm import (
    CHECKPOINT_VERSION,
    RELEASE,
    TRACKER_FILE,
    megatron_lm_args,
    tracked_folder,
)
from megatron_xdistill.storage import (
    atomic_directory,
    refuse_existing,
    swap_in_directory,
    write_text_atomic,
)

#: HF files kept in ``<ckpt>/hf_files/`` so an export writes a complete HF folder unaided.
HF_FILES_DIR = "hf_files"
HF_SIDE_FILES = (
    "config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja",
    "chat_template.json", "generation_config.json",
)


def hf_files_dir(path: str) -> str | None:
    """The ``hf_files/`` of a checkpoint (or training run), or of its root; None if absent."""
    candidates = [path, os.path.dirname(os.path.abspath(path))]
    if os.path.isfile(os.path.join(path, TRACKER_FILE)):
        candidates.insert(1, resolve_checkpoint_dir(path))
    for candidate in candidates:
        folder = os.path.join(candidate, HF_FILES_DIR)
        if os.path.isdir(folder):
            return folder
    return None


def _copy_side_files(folder: str, target: str) -> list[str]:
    os.makedirs(target, exist_ok=True)
    copied = []
    for name in HF_SIDE_FILES:
        if os.path.isfile(os.path.join(folder, name)):
            shutil.copy2(os.path.join(folder, name), target)
            copied.append(name)
    return copied


def copy_hf_files(source: str, ckpt_dir: str) -> list[str]:
    """Copy config and tokenizer/generation files into ``<ckpt_dir>/hf_files`` from an HF model
    folder or from another checkpoint (e.g. a training run's ``--load``); returns the names."""
    return _copy_side_files(hf_files_dir(source) or source, os.path.join(ckpt_dir, HF_FILES_DIR))


def keep_hf_files(run_root: str, *sources: str | None) -> str | None:
    """Give a training run ``run_root/hf_files`` (once) from the first source that has them (a
    checkpoint with ``hf_files/`` or an HF folder), so evaluating or exporting the run needs no
    ``--tokenizer-model`` / ``--hf-template``. Written to a temporary folder, then renamed."""
    target = os.path.join(run_root, HF_FILES_DIR)
    if os.path.isdir(target):
        return target
    for source in sources:
        if not source or not os.path.isdir(source):
            continue
        folder = hf_files_dir(source) or source
        if not os.path.isfile(os.path.join(folder, "config.json")):
            continue
        with atomic_directory(target) as staging:
            _copy_side_files(folder, str(staging))
        return target
    return None


def sharded_model_state_dict(model, pg_collection: ProcessGroupCollection | None = None) -> dict:
    """``model.sharded_state_dict`` with the DP x CP group of ``pg_collection`` for replica ids."""
    metadata = {"dp_cp_group": pg_collection.dp_cp} if pg_collection is not None else None
    return model.sharded_state_dict(metadata=metadata)


def all_ranks_ok(ok: bool) -> bool:
    """Collective: True when every rank passes True (so a failure on one rank stops them all)."""
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def write_collectively(final: str, write: Callable[[str], None], *, replace: bool,
                       after_commit: Callable[[], None] | None = None) -> None:
    """Collective: a checkpoint folder that appears whole or not at all.

    Every rank runs ``write(tmp)`` into ``<final>.tmp``; once all of them succeeded, rank 0
    renames it to ``final`` (an existing ``final`` is replaced, through a rename aside, only
    with ``replace``) and runs ``after_commit`` (e.g. the tracker file). If any rank fails,
    every rank raises (the failing one its own error) and the temporary folder is removed."""
    rank = dist.get_rank()
    tmp = final + ".tmp"
    if rank == 0:
        if os.path.exists(tmp):
            shutil.rmtree(tmp)
        os.makedirs(tmp)
    dist.barrier()
    error: BaseException | None = None
    try:
        write(tmp)
    except Exception as exc:  # noqa: BLE001 - every rank must learn about it, then re-raise
        error = exc
    ok = all_ranks_ok(error is None)
    if rank == 0:
        if ok:
            if not replace:
                refuse_existing(final, replace)  # appeared while it was being written
            swap_in_directory(tmp, final)
            if after_commit is not None:
                after_commit()
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    if error is not None:
        raise error
    if not ok:
        raise CheckpointError(f"saving {final} failed on another rank; nothing was written")


def save_megatron_checkpoint(
    model,
    ckpt_dir: str,
    info: ModelInfo,
    pg_collection: ProcessGroupCollection | None = None,
    overwrite: bool = False,
    extra: dict[str, Any] | None = None,
    before_commit: Callable[[str], None] | None = None,
) -> str:
    """Collective: save ``model`` (any layout) and its model info to ``ckpt_dir``, atomically.

    ``before_commit(tmp_dir)`` runs on rank 0 after the tensors are written and before the
    rename (e.g. to add tokenizer files). If it or any rank fails, nothing appears at
    ``ckpt_dir`` and the temporary directory is removed. An existing ``ckpt_dir`` is replaced
    only with ``overwrite=True``.
    """
    ckpt_dir = os.path.abspath(ckpt_dir)
    refuse_existing(ckpt_dir, overwrite)

    state = sharded_model_state_dict(model, pg_collection)
    # What Megatron-LM's loader reads beside the tensors (its --use-checkpoint-args).
    tp = pg_collection.tp.size() if pg_collection is not None else 1
    pp = pg_collection.pp.size() if pg_collection is not None else 1
    args = megatron_lm_args(info, tp=tp, pp=pp, cp=1, seq_length=info.max_position_embeddings,
                            bf16=info.hf_dtype == "bfloat16", iteration=0, consumed_samples=0)
    state.update(checkpoint_version=CHECKPOINT_VERSION, iteration=0,
                 **({} if args is None else {"args": args}))

    def write(tmp: str) -> None:
        tensors = tracked_folder(tmp, RELEASE)
        os.makedirs(tensors, exist_ok=True)
        dist_checkpointing.save(state, tensors)
        if dist.get_rank() == 0:
            write_text_atomic(os.path.join(tmp, TRACKER_FILE), RELEASE)
            save_model_info(info, tmp, extra)
            if before_commit is not None:
                before_commit(tmp)

    write_collectively(ckpt_dir, write, replace=overwrite)
    return ckpt_dir


def load_megatron_checkpoint(
    model, ckpt_dir: str, pg_collection: ProcessGroupCollection | None = None,
    process_group=None,
) -> str:
    """Collective: load a checkpoint's model weights into ``model`` (any layout); returns the
    dist_checkpointing directory read. A tensor the model needs but the checkpoint lacks raises;
    extra checkpoint content (optimizer state of a training checkpoint) is ignored.
    ``process_group``: the ranks that hold ``model`` (default: the whole world), e.g. only the
    teacher ranks of a disaggregated run, which load while the student ranks load theirs."""
    path = resolve_checkpoint_dir(ckpt_dir)
    request = sharded_model_state_dict(model, pg_collection)
    try:
        state = dist_checkpointing.load(request, path, strict=StrictHandling.RAISE_UNEXPECTED,
                                        process_group=process_group)
    except CheckpointError:
        raise
    # torch's CheckpointException (a read that failed) is a BaseException
    except (Exception, TorchCheckpointException) as err:  # noqa: BLE001 - name the checkpoint
        raise CheckpointError(
            f"{path}: cannot load the model from this checkpoint ({_first_cause(err)}); it is "
            f"incomplete or corrupt, or was made for another architecture: point --load / "
            f"--teacher-load at an intact checkpoint") from err
    # dist_checkpointing merges the checkpoint's common (non-tensor) state into the result: a
    # training checkpoint's "iteration", "common", "scheduler", optimizer param groups. Keep
    # only what the model asked for.
    model.load_state_dict({key: value for key, value in state.items() if key in request})
    return path
